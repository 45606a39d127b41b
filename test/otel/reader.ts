import type { Attributes } from "@opentelemetry/api";
import {
  AggregationTemporality,
  type DataPoint,
  DataPointType,
  type Histogram,
  MeterProvider,
  MetricReader,
} from "@opentelemetry/sdk-metrics";

/** A reader that collects on demand: the SDK's in-memory path, without an export interval. */
class OnDemandReader extends MetricReader {
  constructor() {
    super({ aggregationTemporalitySelector: () => AggregationTemporality.CUMULATIVE });
  }
  protected async onShutdown(): Promise<void> {}
  protected async onForceFlush(): Promise<void> {}
}

/** One metric as collected: its instrument, unit and points. */
export interface Collected {
  name: string;
  unit: string;
  type: string;
  points: DataPoint<number | Histogram>[];
}

/** A MeterProvider with a reader collected on demand, and lookups into what it collected. */
export class TestMetrics {
  readonly reader = new OnDemandReader();
  readonly provider = new MeterProvider({ readers: [this.reader] });

  /** Every metric, by name, as the SDK collects them now. */
  async collect(): Promise<Map<string, Collected>> {
    const { resourceMetrics, errors } = await this.reader.collect();
    if (errors.length > 0) throw errors[0];
    const out = new Map<string, Collected>();
    for (const scope of resourceMetrics.scopeMetrics) {
      for (const m of scope.metrics) {
        out.set(m.descriptor.name, {
          name: m.descriptor.name,
          unit: m.descriptor.unit,
          type:
            m.dataPointType === DataPointType.HISTOGRAM
              ? "histogram"
              : m.dataPointType === DataPointType.GAUGE
                ? "gauge"
                : m.dataPointType === DataPointType.SUM && m.isMonotonic
                  ? "counter"
                  : "up-down counter",
          points: m.dataPoints as DataPoint<number | Histogram>[],
        });
      }
    }
    return out;
  }

  /** The value of `name` at exactly `attributes`; undefined when there is no such point. */
  async value(name: string, attributes: Attributes): Promise<number | undefined> {
    return pointOf(await this.collect(), name, attributes) as number | undefined;
  }

  /** The histogram of `name` at exactly `attributes`. */
  async histogram(name: string, attributes: Attributes): Promise<Histogram | undefined> {
    return pointOf(await this.collect(), name, attributes) as Histogram | undefined;
  }

  shutdown(): Promise<void> {
    return this.provider.shutdown();
  }
}

const sameAttributes = (a: Attributes, b: Attributes) => {
  const ka = Object.keys(a).sort();
  const kb = Object.keys(b).sort();
  return ka.length === kb.length && ka.every((k, i) => k === kb[i] && a[k] === b[k]);
};

/** The value of the point of `name` at exactly `attributes`, in `collected`. */
export function pointOf(
  collected: Map<string, Collected>,
  name: string,
  attributes: Attributes,
): number | Histogram | undefined {
  return collected.get(name)?.points.find((p) => sameAttributes(p.attributes, attributes))?.value;
}

/** The attribute sets of every point of `name`, for asserting which series exist. */
export function seriesOf(collected: Map<string, Collected>, name: string): Attributes[] {
  return collected.get(name)?.points.map((p) => p.attributes) ?? [];
}
