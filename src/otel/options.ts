/** What `instrument` takes: its targets and its options, checked, and the meter they name. */
import { type Meter, type MeterProvider, metrics } from "@opentelemetry/api";
import { z } from "zod";
import { InvalidOptionsError } from "../errors.js";
import type { Snapshot } from "../types.js";
import { got, messageOf, parseOptions } from "../validate.js";
import { METER_NAME } from "./names.js";

/** What `instrument` reads: anything with `snapshot()`, such as a stage or a `Gate`. */
export interface Instrumentable {
  snapshot(): Snapshot;
}

/** Options for `instrument`. Give at most one of `meter` and `meterProvider`. */
export interface InstrumentOptions {
  /** The meter to create the instruments on. */
  meter?: Meter;
  /**
   * The provider to get the `floodgate` meter from.
   * @default the global one: `metrics.getMeterProvider()` of `@opentelemetry/api`
   */
  meterProvider?: MeterProvider;
  /**
   * Record the two histograms (wait and service time). They are the only figures that cost
   * something per call: two values a call a stage, fed by the diagnostics channels. `false`
   * leaves them out and subscribes to no per-call channel: the counts and gauges, read from
   * `snapshot()` at collection, remain.
   * @default true
   */
  histograms?: boolean;
}

const isMeter = (v: unknown): v is Meter =>
  typeof v === "object" &&
  v !== null &&
  [
    "createHistogram",
    "createObservableCounter",
    "createObservableUpDownCounter",
    "createObservableGauge",
    "addBatchObservableCallback",
    "removeBatchObservableCallback",
  ].every((m) => typeof (v as Record<string, unknown>)[m] === "function");

const optionsSchema = z
  .strictObject({
    meter: z.custom<Meter>(isMeter, { error: "must be an OpenTelemetry Meter" }).optional(),
    meterProvider: z
      .custom<MeterProvider>(
        (v) =>
          typeof v === "object" && v !== null && typeof (v as { getMeter?: unknown }).getMeter === "function",
        { error: "must be an OpenTelemetry MeterProvider" },
      )
      .optional(),
    histograms: z.boolean({ error: "must be true or false" }).optional(),
  })
  .refine((o) => o.meter === undefined || o.meterProvider === undefined, {
    path: ["meterProvider"],
    error: "must not be given with meter",
  });

/** `options` checked: an `InvalidOptionsError` naming the field, else the meter they name and the histograms rule. */
export function checkOptions(options: InstrumentOptions): { meter: Meter; histograms: boolean } {
  const o = parseOptions(optionsSchema, "instrument", undefined, options);
  return { meter: o.meter ?? providerMeter(o.meterProvider), histograms: o.histograms ?? true };
}

/** The `floodgate` meter of `provider`, or of the global provider. */
function providerMeter(provider: MeterProvider | undefined): Meter {
  let meter: unknown;
  try {
    meter = (provider ?? metrics.getMeterProvider()).getMeter(METER_NAME);
  } catch (error) {
    throw new InvalidOptionsError(
      undefined,
      "meterProvider",
      `instrument: meterProvider.getMeter() threw (${messageOf(error)})`,
    );
  }
  if (!isMeter(meter)) {
    throw new InvalidOptionsError(
      undefined,
      "meterProvider",
      `instrument: meterProvider.getMeter() must return an OpenTelemetry Meter, ${got(meter)}`,
    );
  }
  return meter;
}
