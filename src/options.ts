import type { Clock } from "./clock.js";

/** Options every stage takes. The backend passes its own down unless a stage overrides them. */
export interface StageOptions {
  /** Time source. @default the backend's clock, else the system clock */
  clock?: Clock;
  /** pino-shaped logger; each stage logs to a child bound to `{ stage, kind, backend }`. @default silent */
  logger?: Logger;
}

/**
 * What a Redis stage does when Redis cannot be reached (in memory there is nothing to fail, and
 * these are accepted and ignored, so one set of options serves both backends).
 */
export interface BackendErrorOptions {
  /**
   * - `fail-closed`: the call is not admitted; `admit` rejects with `BackendUnavailableError`
   *   carrying the cause. The global cap is never exceeded.
   * - `fail-open`: the call is admitted with no limit at all until Redis answers again.
   * - `local`: the call goes through an in-memory stage holding `localShare` of the limits. Each
   *   process then enforces its share on its own: the fleet-wide cap holds only if the shares of
   *   the running processes add up to at most 1.
   *
   * After a failure the stage stays on its fallback for a second, then tries Redis again; every
   * switch is logged. @default "fail-closed" (or the backend's)
   */
  onBackendError?: "fail-closed" | "fail-open" | "local";
  /**
   * This process's share of the limits for `onBackendError: "local"`: limit, capacity, refill and
   * queue size are multiplied by it (at least 1 permit), interval spacing divided by it.
   * In (0, 1]. @default 1
   */
  localShare?: number;
}

/** One traffic class of a stage: its share of the limit, and how it borrows. See docs/classes.md. */
export interface TrafficClassOptions {
  /**
   * Its weight. The limit is divided among the classes in proportion to their shares (80 and 20,
   * or 4 and 1, give the same split); what a class gets is its guarantee, at least one permit.
   * A finite number > 0.
   */
  share: number;
  /**
   * Among classes borrowing beyond their guarantee, a higher priority goes first. It never
   * touches a guarantee: a class below its guarantee is served first whatever its priority.
   * An integer. @default 0
   */
  priority?: number;
  /**
   * The most of the limit the class may hold, its guarantee and what it borrows together, as a
   * fraction (rounded down to whole permits, never below its exact portion rounded up).
   * In (0, 1]. @default 1
   */
  maxShare?: number;
  /**
   * The fraction of its guarantee other classes may borrow while this class does not use it;
   * the rest (rounded up to whole permits) stays free for it, so its next calls start at once
   * instead of waiting for a borrowed permit to come back. Kubernetes API Priority and Fairness
   * calls it `lendablePercent`. In [0, 1]. @default 1 (all of it, fully work-conserving)
   */
  lendable?: number;
}

/**
 * Traffic classes of a semaphore or an AIMD limiter (shares of its limit), or of a token bucket
 * (shares of its refill and capacity).
 */
export interface ClassOptions {
  /**
   * Named classes that divide the limit into guaranteed shares and lend what they leave idle.
   * A call names its class (`{ class: "interactive" }`). At most 16 classes. On Redis the
   * classes are fleet-wide, and every process must build the stage with the same classes in the
   * same order. See docs/classes.md.
   */
  classes?: Record<string, TrafficClassOptions>;
  /** The class of a call that names none; without it such a call is refused. One of `classes`. */
  defaultClass?: string;
}

/** Traffic classes of a stage that holds permits (a semaphore, an AIMD limiter). */
export interface PermitClassOptions extends ClassOptions {
  /**
   * What a class below its guarantee does while others hold the permits it lent: `"wait"` for
   * them to be released, or `"signal"`, which also aborts the `ticket.signal` of enough borrowed
   * tickets (lowest priority first, latest first) with `ReclaimedError`, so their calls wrap up
   * sooner. Either way no permit is taken back before its release: the limit holds. Needs
   * `classes`. See docs/classes.md. @default "wait"
   */
  reclaim?: "wait" | "signal";
}

/** `backend.semaphore(name, options)`: at most `limit` permits held at once. */
export interface SemaphoreOptions extends StageOptions, BackendErrorOptions, PermitClassOptions {
  /** Permits. A call of cost `c` holds `c` of them. An integer in [1, 2^31). */
  limit: number;
  /**
   * How long a permit lives unless renewed, in milliseconds. On Redis a holder renews its lease
   * while it runs, so the lease only ends early when the holder dies. In memory the process
   * holding the permit is the process that would die with it, so leases never run out.
   * An integer >= 100. @default 30000
   */
  leaseMs?: number;
}

/** After a `dropped` outcome, slow the key's refill down and let it recover. */
export interface PenaltyOptions {
  /** Refill is multiplied by this on each drop; drops compound. In (0, 1). @default 0.5 */
  factor?: number;
  /** Milliseconds for a penalised rate to climb back linearly to full. An integer >= 1. @default 30000 */
  recoveryMs?: number;
  /** Penalties never push the refill below this share of `refillPerSecond`. In (0, 1]. @default 0.1 */
  minFactor?: number;
}

/** `backend.tokenBucket(name, options)`: a sustained rate per key with bursts up to `capacity`. */
export interface TokenBucketOptions extends StageOptions, BackendErrorOptions, ClassOptions {
  /** Most tokens a key can hold: the largest burst and the largest single cost. An integer >= 1. */
  capacity: number;
  /**
   * Tokens added per second, per key. A finite number > 0 (fractions allowed: 0.5 is one per 2 s).
   * A rate so slow that a wait would pass `Number.MAX_SAFE_INTEGER` ms is accepted, and the wait
   * (and a Redis key's expiry) is held at that, alike in memory and on Redis.
   */
  refillPerSecond: number;
  /** Tokens a key starts with. An integer in [0, capacity]. @default capacity */
  initialTokens?: number;
  /**
   * Slow a key down after a `dropped` outcome (a 429 from that supplier). Off unless given;
   * `penalty: {}` turns it on with the defaults.
   */
  penalty?: PenaltyOptions;
  /**
   * Give each key its own bucket: every call names its `key` (a supplier, an account), and a
   * call without one is refused with `InvalidOptionsError`. Unkeyed (the default), the stage is
   * one bucket for all calls: a `key` given to the stage itself is refused (it would be a sign
   * that `keyed: true` was meant), and a `Gate` does not pass its call's `key` to it.
   * @default false
   */
  keyed?: boolean;
}

/** `backend.queue(name, options)`: at most `maxSize` jobs waiting; then block or shed. */
export interface QueueOptions extends StageOptions, BackendErrorOptions {
  /** Jobs that may wait at once. An integer >= 1. */
  maxSize: number;
  /**
   * What a full queue does to a new job. `block`: the producer's `admit`/`enqueue` waits for a
   * slot (backpressure). `shed`: it rejects at once with `ShedError`, which is counted.
   * @default "block"
   */
  whenFull?: "block" | "shed";
}

/** `backend.intervalGate(name, options)`: a minimum spacing between calls to each host. */
export interface IntervalGateOptions extends StageOptions, BackendErrorOptions {
  /**
   * Least milliseconds between the starts of two calls to one host. A finite number >= 0; a
   * spacing past `Number.MAX_SAFE_INTEGER` ms (with its jitter) is held at that.
   */
  minIntervalMs: number;
  /**
   * Up to this many milliseconds of random delay added on top of `minIntervalMs` for each call,
   * so spacing is in [minIntervalMs, minIntervalMs + jitterMs). A finite number >= 0, held at
   * `Number.MAX_SAFE_INTEGER` ms with the spacing. @default 0
   */
  jitterMs?: number;
  /** Source of randomness in [0, 1) for the jitter. @default the backend's, else Math.random */
  random?: () => number;
  /**
   * The host of a call that names none. Without it, a call that reaches the interval gate
   * without `host` is refused with `InvalidOptionsError` (spacing every call under one made-up
   * host is rarely what was meant). A non-empty string.
   */
  defaultHost?: string;
}

/** `backend.aimd(name, options)`: a semaphore whose limit adapts to the outcomes it sees. */
export interface AimdOptions extends StageOptions, BackendErrorOptions, PermitClassOptions {
  /** Limit to start at. An integer in [min, max]. */
  initial: number;
  /** Lowest limit. An integer >= 1. @default 1 */
  min?: number;
  /** Highest limit. An integer >= min. */
  max: number;
  /**
   * On a drop the limit becomes `floor(limit * backoffRatio)` (never below `min`). At most one
   * decrease per window of drops: a drop from a call admitted before the last decrease is not
   * counted again. In [0.5, 1). @default 0.9
   */
  backoffRatio?: number;
  /**
   * A `success` whose call ran longer than this many milliseconds counts as a drop (the server is
   * slowing down). A finite number > 0. @default no such limit
   */
  slowCallMs?: number;
  /** As for the semaphore. @default 30000 */
  leaseMs?: number;
}

/** `memory(options)`: defaults handed to every stage of the backend. */
export interface MemoryBackendOptions extends StageOptions {
  /** Randomness for jitter. @default Math.random */
  random?: () => number;
}

/** Structured logger the stages write to: pino's shape (`child`, `debug`, `warn`). */
export interface Logger {
  child(bindings: Record<string, unknown>): Logger;
  debug(obj: object, msg?: string): void;
  info(obj: object, msg?: string): void;
  warn(obj: object, msg?: string): void;
  error(obj: object, msg?: string): void;
  isLevelEnabled?(level: string): boolean;
}
