/** The names floodgate's metrics and their attributes go by, and the histograms' buckets. */

/** The instrumentation scope floodgate's meter is named by. */
export const METER_NAME = "floodgate";

/** The metric names `instrument` records, by what they measure. */
export const METRICS = {
  /** Counter, `{call}`: calls admitted. */
  admissions: "floodgate.admissions",
  /** Counter, `{call}`: waits that ended without admission (timeout, abort, drain). */
  refusals: "floodgate.refusals",
  /** Counter, `{call}`: calls a full bounded queue refused (`whenFull: "shed"`). */
  sheds: "floodgate.sheds",
  /** Histogram, `s`: how long a call waited for admission (0 when admitted at once). */
  waitDuration: "floodgate.admission.wait.duration",
  /** Histogram, `s`: service time, from admission to release. */
  callDuration: "floodgate.call.duration",
  /** UpDownCounter, `{call}`: calls holding a ticket now. */
  active: "floodgate.call.active",
  /** UpDownCounter, `{call}`: calls waiting for admission now. */
  waiting: "floodgate.call.waiting",
  /** Gauge, `{permit}`: the current concurrency limit (semaphore, AIMD, queue size). */
  limit: "floodgate.permit.limit",
} as const;

/** The attribute names on floodgate's metrics. */
export const ATTRIBUTES = {
  /** The stage's (or gate's) name. */
  stage: "floodgate.stage.name",
  /** Its kind: `semaphore`, `tokenBucket`, `queue`, `intervalGate`, `aimd`, `gate`, or your own. */
  kind: "floodgate.stage.kind",
  /** Its backend: `memory`, `redis`, `gate`, or your own. */
  backend: "floodgate.backend",
  /** The traffic class, at a stage built with `classes`. */
  class: "floodgate.class",
  /** On `floodgate.call.duration`: `success`, `dropped`, `ignored` or `refund`. */
  outcome: "floodgate.call.outcome",
  /** On `floodgate.refusals`: `timeout`, `abort` or `drain`. */
  reason: "floodgate.refusal.reason",
} as const;

/** Bucket boundaries for both histograms, in seconds (those of `http.client.request.duration`). */
export const BUCKETS = [0, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10];
