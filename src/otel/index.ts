/**
 * OpenTelemetry metrics for stages and gates, through `@opentelemetry/api` (an optional peer
 * dependency: only this entry point imports it). Histograms are fed by the
 * `node:diagnostics_channel` events, subscribed to only while instrumented; counts, calls in
 * flight, waiting calls and limits are read from `snapshot()` when the SDK collects.
 * The names, units and attributes are listed in docs/metrics.md.
 *
 * @module floodgate/otel
 */
import diagnostics_channel from "node:diagnostics_channel";
import type { BatchObservableResult, Histogram, Observable } from "@opentelemetry/api";
import {
  type CallMessage,
  CHANNELS,
  type DrainMessage,
  type GrantMessage,
  type ReleaseMessage,
} from "../channels.js";
import { InvalidOptionsError } from "../errors.js";
import type { Snapshot } from "../types.js";
import { checkTargets, isArray, messageOf } from "../validate.js";
import { ATTRIBUTES, BUCKETS, METRICS } from "./names.js";
import { checkOptions, type Instrumentable, type InstrumentOptions } from "./options.js";
import { Row, walk } from "./row.js";

export { ATTRIBUTES, METER_NAME, METRICS } from "./names.js";
export type { Instrumentable, InstrumentOptions } from "./options.js";

/**
 * What `instrument` returns. `close()` (or leaving a `using` block) unsubscribes from the
 * channels and removes the observable callback: the stages are no longer measured. The
 * instruments themselves stay on the meter (OpenTelemetry has no way to remove them).
 */
export interface Instrumentation extends Disposable {
  /** Stop measuring. A second call does nothing. */
  close(): void;
}

/** The stages (by `rowKey`) each meter measures now. */
const measured = new WeakMap<object, Set<string>>();

const rowKey = (name: string, kind: string, backend: string) => `${kind}\u0000${backend}\u0000${name}`;

/**
 * Record OpenTelemetry metrics for `targets`: stages, gates (with each of their stages, nested
 * gates included) or a list of them. The metrics, their units and attributes are in
 * docs/metrics.md:
 *
 * - `floodgate.admissions`, `floodgate.refusals` (by `floodgate.refusal.reason`: `timeout`,
 *   `abort`, `drain`) and `floodgate.sheds`: counters, in `{call}`;
 * - `floodgate.admission.wait.duration` and `floodgate.call.duration` (admission to release, by
 *   `floodgate.call.outcome`): histograms, in seconds;
 * - `floodgate.call.active` and `floodgate.call.waiting`: up-down counters, in `{call}`;
 * - `floodgate.permit.limit`: a gauge, in `{permit}` (left out where no limit applies).
 *
 * Each carries `floodgate.stage.name`, `floodgate.stage.kind` and `floodgate.backend`, and
 * `floodgate.class` at a stage with classes (its admissions, calls in flight and waiting, and
 * both histograms are per class there). A gate is measured as a stage of kind `gate` too (its
 * own admissions and refusals; no histograms): a fused gate's waits are counted there.
 *
 * The histograms come from the `node:diagnostics_channel` events, subscribed to from now until
 * `close()`: a call admitted before counts its whole service time once it is released.
 * A stage is measured once per meter: instrumenting it again on the same meter, before the first
 * instrumentation's `close()`, throws (it would count every wait and service time twice).
 * Without a meter or a provider, the global provider's `floodgate` meter is used (a no-op until
 * an SDK is registered). The histograms are the only per-call cost; `histograms: false` leaves
 * them out.
 *
 * Throws `InvalidOptionsError` naming the field for a target without `snapshot()` (`targets`, or
 * `targets.i` in a list), an empty list, a stage already measured on the same meter (`targets`;
 * stages are told apart by name, kind and backend), a `meter` or `meterProvider` of the wrong
 * shape, both of them, a `histograms` that is not a boolean, or an unknown option.
 */
export function instrument(
  targets: Instrumentable | readonly Instrumentable[],
  options: InstrumentOptions = {},
): Instrumentation {
  const list = checkTargets<Instrumentable>("instrument", targets, "snapshot", true);
  const { meter, histograms } = checkOptions(options);

  // The rows, by name (their kind and backend tell apart stages of one name).
  const rows = new Map<string, Row[]>();
  const rowOf = (name: string, kind: string, backend: string): Row | undefined => {
    const found = rows.get(name);
    if (found !== undefined) for (const r of found) if (r.kind === kind && r.backend === backend) return r;
    return undefined;
  };
  list.forEach((t, i) => {
    let snapshot: Snapshot;
    try {
      snapshot = t.snapshot();
    } catch (error) {
      const field = isArray(targets) ? `targets.${i}` : "targets";
      throw new InvalidOptionsError(
        undefined,
        field,
        `instrument: ${field}.snapshot() threw (${messageOf(error)})`,
      );
    }
    for (const s of walk(snapshot)) {
      if (rowOf(s.name, s.kind, s.backend) !== undefined) continue;
      const row = new Row(s.name, s.kind, s.backend, s.classes !== undefined);
      rows.set(s.name, [...(rows.get(s.name) ?? []), row]);
    }
  });

  // A stage is measured once per meter: a second instrumentation would record every wait and
  // service time twice, on the same series.
  const all = [...rows.values()].flat();
  const keys = all.map((r) => rowKey(r.name, r.kind, r.backend));
  const taken = measured.get(meter) ?? new Set<string>();
  for (const [i, r] of all.entries()) {
    if (!taken.has(keys[i]!)) continue;
    throw new InvalidOptionsError(
      undefined,
      "targets",
      `instrument: ${r.kind} "${r.name}" (${r.backend}) is already measured on this meter; close() that instrumentation first, or leave it out (measured twice, its waits and service times would count twice)`,
    );
  }
  for (const k of keys) taken.add(k);
  measured.set(meter, taken);

  const call = { unit: "{call}" };
  const seconds = { unit: "s", advice: { explicitBucketBoundaries: BUCKETS } };
  const wait: Histogram | undefined = histograms
    ? meter.createHistogram(METRICS.waitDuration, {
        ...seconds,
        description: "How long a call waited for admission at a stage (0 when admitted at once).",
      })
    : undefined;
  const held: Histogram | undefined = histograms
    ? meter.createHistogram(METRICS.callDuration, {
        ...seconds,
        description: "Service time: how long a call held its ticket, from admission to release.",
      })
    : undefined;
  const admissions = meter.createObservableCounter(METRICS.admissions, {
    ...call,
    description: "Calls admitted by a stage.",
  });
  const refusals = meter.createObservableCounter(METRICS.refusals, {
    ...call,
    description: "Waits that ended without admission: timed out, aborted, or rejected by a drain.",
  });
  const sheds = meter.createObservableCounter(METRICS.sheds, {
    ...call,
    description: "Calls a full bounded queue refused.",
  });
  const active = meter.createObservableUpDownCounter(METRICS.active, {
    ...call,
    description: "Calls holding a ticket of a stage now.",
  });
  const waiting = meter.createObservableUpDownCounter(METRICS.waiting, {
    ...call,
    description: "Calls waiting for admission at a stage now.",
  });
  const limit = meter.createObservableGauge(METRICS.limit, {
    unit: "{permit}",
    description:
      "A stage's current concurrency limit: permits of a semaphore or AIMD limiter, slots of a queue.",
  });
  const observables: Observable[] = [admissions, refusals, sheds, active, waiting, limit];

  const reasons = (r: Row, reason: string) => ({ ...r.attributes, [ATTRIBUTES.reason]: reason });
  const observe = (result: BatchObservableResult) => {
    const seen = new Set<Row>();
    for (const t of list) {
      let snapshot: Snapshot;
      try {
        snapshot = t.snapshot();
      } catch {
        continue;
      }
      for (const s of walk(snapshot)) {
        const r = rowOf(s.name, s.kind, s.backend);
        if (r === undefined || seen.has(r)) continue;
        seen.add(r);
        if (s.classes !== undefined) {
          for (const [name, c] of Object.entries(s.classes)) {
            const a = r.of(name);
            result.observe(admissions, c.admitted, a);
            result.observe(active, c.inFlight, a);
            result.observe(waiting, c.waiting, a);
          }
        } else {
          result.observe(admissions, s.admitted, r.attributes);
          result.observe(active, s.inFlight, r.attributes);
          result.observe(waiting, s.waiting, r.attributes);
        }
        result.observe(refusals, s.timedOut, reasons(r, "timeout"));
        result.observe(refusals, s.aborted, reasons(r, "abort"));
        result.observe(refusals, r.drained, reasons(r, "drain"));
        result.observe(sheds, s.shed, r.attributes);
        if (Number.isFinite(s.limit)) result.observe(limit, s.limit, r.attributes);
      }
    }
  };
  meter.addBatchObservableCallback(observe, observables);

  // The histograms, and the drains' rejections, from the channels.
  const waited = (c: CallMessage, seconds: number) => {
    const r = rowOf(c.stage, c.kind, c.backend);
    if (r !== undefined) wait!.record(seconds, r.of(c.key));
  };
  const onAdmit = (m: unknown) => waited(m as CallMessage, 0);
  // A clock stepped back gives a negative span, which a histogram refuses: counted as 0.
  const onGrant = (m: unknown) => waited(m as GrantMessage, Math.max(0, (m as GrantMessage).waitedMs) / 1000);
  const onRelease = (m: unknown) => {
    const rel = m as ReleaseMessage;
    // NaN from a stage of your own that does not time its tickets.
    if (Number.isNaN(rel.heldMs)) return;
    const r = rowOf(rel.stage, rel.kind, rel.backend);
    if (r !== undefined) held!.record(Math.max(0, rel.heldMs) / 1000, r.released(rel.key, rel.outcome));
  };
  const onDrain = (m: unknown) => {
    const d = m as DrainMessage;
    const found = rows.get(d.stage)?.find((r) => r.kind === d.kind);
    if (found !== undefined) found.drained += d.rejected;
  };
  const subscriptions: [string, (m: unknown) => void][] = [[CHANNELS.drain, onDrain]];
  if (histograms) {
    subscriptions.push([CHANNELS.admit, onAdmit], [CHANNELS.grant, onGrant], [CHANNELS.release, onRelease]);
  }
  for (const [name, fn] of subscriptions) diagnostics_channel.subscribe(name, fn);

  let closed = false;
  const close = () => {
    if (closed) return;
    closed = true;
    for (const [name, fn] of subscriptions) diagnostics_channel.unsubscribe(name, fn);
    meter.removeBatchObservableCallback(observe, observables);
    for (const k of keys) taken.delete(k);
  };
  return { close, [Symbol.dispose]: close };
}
