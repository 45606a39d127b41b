/**
 * The public shape every stage and gate shares: outcomes, tickets, stages, the options of one
 * admission and the snapshots, each with the TSDoc a user reads in an editor. Over 350 lines
 * because it is mostly that documentation, and a type is read beside its neighbours; each
 * stage's own options are in options.ts.
 */
import type {
  AimdOptions,
  IntervalGateOptions,
  QueueOptions,
  SemaphoreOptions,
  TokenBucketOptions,
} from "./options.js";

/**
 * What happened to an admitted call, reported when its ticket is released.
 *
 * - `success`: the call went out and the server handled it.
 * - `dropped`: the server said it was overloaded (429, 503, a timeout). Adaptive stages back off,
 *   a token bucket with a `penalty` slows that key down.
 * - `ignored`: the call failed before it told us anything about the server (a bug, a DNS error).
 *   No stage learns from it.
 */
export type Outcome = "success" | "dropped" | "ignored";

/** The kinds of stage floodgate ships. */
export type StageKind =
  | "semaphore"
  | "tokenBucket"
  | "queue"
  | "intervalGate"
  | "aimd"
  | "gate"
  // A stage of your own names its kind (see docs/custom-stage.md).
  | (string & {});

/**
 * Options for one admission. Every field is optional; a stage reads the ones it needs. Each
 * field given is checked by its type on every stage: `undefined` means "not given", and anything
 * else of the wrong type (`null`, a string for a number, a BigInt) rejects the call with
 * `InvalidOptionsError` naming the field. No value is ever coerced.
 */
export interface AdmitOptions {
  /** Token bucket key (supplier, account). A non-empty string. @default "default" */
  key?: string;
  /** Host for interval gates. A non-empty string. @default "default" */
  host?: string;
  /**
   * The traffic class the call draws on, at a stage built with `classes` (a non-empty string
   * naming one of them; the stage's `defaultClass` when left out). A `Gate` hands it to its
   * stages that have classes. See docs/classes.md.
   */
  class?: string;
  /** Weight of the call: permits for a semaphore, tokens for a bucket. An integer >= 0. @default 1 */
  cost?: number;
  /**
   * For a `Gate`: the cost at each stage by stage name, overriding `cost` there. An LLM call
   * costs 1 request but 1200 tokens: `{ costs: { tpm: 1200 } }`. An object whose every value is
   * an integer >= 0.
   */
  costs?: Readonly<Record<string, number>>;
  /** Abort the wait. The promise rejects with `signal.reason` unchanged and nothing stays held. */
  signal?: AbortSignal;
  /**
   * Longest time to wait, in milliseconds: a number >= 0. On expiry the wait rejects with
   * `AdmitTimeoutError` and holds nothing; the limit is never forced. `0` means "only if free
   * right now"; `undefined` or `Infinity` wait for ever.
   */
  timeoutMs?: number;
}

/** How a call ended, for `classify`. */
export type Settled<T> = { ok: true; value: T } | { ok: false; error: unknown };

/** Options for `stage.run(fn, options)`, `gate.run(fn, options)` and `gate.enqueue(fn, options)`. */
export interface RunOptions<T = unknown> extends AdmitOptions {
  /**
   * Turn the call's result into an outcome. An outcome recorded on the ticket inside `fn` wins.
   * @default `defaultClassify`: a value or error with status 429 or 503, or a timeout error, is
   * `dropped`; another value is `success`; another error is `ignored`.
   */
  classify?: (settled: Settled<T>) => Outcome;
}

/** Options for an admission that never waits. */
export type TryAdmitOptions = Pick<AdmitOptions, "key" | "host" | "class" | "cost" | "costs">;

/**
 * Proof of admission. Release it exactly once with the call's outcome; a second release does
 * nothing. `await using ticket = await stage.admit()` releases it as `ignored` unless an outcome
 * was recorded with `record()`.
 */
export interface Ticket extends AsyncDisposable {
  /** Name of the stage that granted it. */
  readonly stage: string;
  /** Cost this ticket holds. */
  readonly cost: number;
  /** True once released (or refunded). */
  readonly released: boolean;
  /**
   * Aborts when the permit behind this ticket is lost (a Redis lease that expired) or the stage is
   * closed. Hand it to the call (`fetch(url, { signal: ticket.signal })`) to stop work that no
   * longer holds its permit. In memory it aborts only on `close()`.
   */
  readonly signal: AbortSignal;
  /** Remember the outcome to use when the ticket is released without one. Last call wins. */
  record(outcome: Outcome): void;
  /** Give the capacity back and report the outcome (default: the recorded one, else `ignored`). */
  release(outcome?: Outcome): Promise<void>;
  /**
   * Give back everything the ticket took, as if the call had never been admitted: tokens return
   * to their bucket, an interval slot is handed back when no later call has claimed one, and no
   * adaptive stage learns anything. Use it when the call was never sent.
   */
  refund(): Promise<void>;
  /**
   * Reserve, then settle: the call was admitted at an estimated `cost` (prompt tokens) and the
   * response tells the actual one. A token bucket charges the difference at once when the call
   * cost more (the key may go into debt: later calls wait until it is paid back), and gives the
   * difference back when it cost less (only while no later call has taken from the key, so the
   * bucket never ends up fuller than if the right cost had been asked). Stages that bound
   * concurrency rather than volume ignore it. On a gate ticket, a number settles every stage and
   * a record settles stages by name: `ticket.settle({ tpm: usage.total_tokens })`; a name that is
   * no stage of the gate rejects with `InvalidOptionsError` naming `actual.<name>`, as `costs`
   * does, and nothing is settled.
   * `actual` is an integer >= 0 (or a record of them); anything else rejects with
   * `InvalidOptionsError` naming `actual`, on every stage. A semaphore, queue or AIMD ticket
   * keeps its `cost`: its release gives back exactly what it took, whatever was settled. A
   * debt too large to be paid back in `Number.MAX_SAFE_INTEGER` ms is waited on that long.
   */
  settle(actual: number | Readonly<Record<string, number>>): Promise<void>;
  /** Same as `release()`. */
  close(): Promise<void>;
}

/**
 * Plain numbers that describe a stage now. The four that localise a bottleneck — `queueDepth`,
 * `tokenWaitMs`, `permitWaitMs` and `shed` — are always present (zero where they do not apply).
 */
export interface Snapshot {
  name: string;
  kind: StageKind;
  backend: string;
  /** Tickets granted and not yet released. */
  inFlight: number;
  /** Callers waiting for admission now. */
  waiting: number;
  /** Jobs holding a queue slot now (bounded queues). */
  queueDepth: number;
  /** Admissions refused because a queue was full, since the stage was built. */
  shed: number;
  /** Admissions granted since the stage was built. */
  admitted: number;
  /** Waits that ended in `AdmitTimeoutError`. */
  timedOut: number;
  /** Waits that ended because their signal aborted. */
  aborted: number;
  /** Total milliseconds callers waited for rate: token buckets and interval gates. */
  tokenWaitMs: number;
  /** Total milliseconds callers waited for permits: semaphores and AIMD limiters. */
  permitWaitMs: number;
  /** Total milliseconds producers waited for a queue slot. */
  queueWaitMs: number;
  /**
   * Leases that ran out before their ticket was released (a frozen or cut-off holder); each is a
   * call that may have overlapped the next holder. Always 0 in memory.
   */
  leasesLost: number;
  /** Current concurrency limit (semaphore, AIMD, queue size); `Infinity` where none applies. */
  limit: number;
  /** Each traffic class, by name, on a stage built with `classes`. */
  classes?: Record<string, ClassSnapshot>;
  /**
   * Little's law over the last 10 s: throughput, service time (admission to release), mean in
   * flight and their product. Every built-in stage and gate fills it; a custom stage may not.
   */
  flow?: FlowSnapshot;
  /**
   * Redis stages that hold permits (semaphore, AIMD limiter, bounded queue): the permits held
   * across the whole fleet, as the last reply of Redis said. Absent until a first reply.
   */
  fleet?: FleetSnapshot;
}

/** What a Redis permit stage last heard of the whole fleet. */
export interface FleetSnapshot {
  /** Permits held across every process sharing the stage. */
  inFlight: number;
  /** The fleet-wide limit (the current one, for an AIMD limiter). */
  limit: number;
  /** How long ago the call whose reply said so was sent, in ms. */
  ageMs: number;
}

/**
 * A stage's flow over a sliding window (the last 10 s, shorter while the stage is younger), in
 * this process. Little's law says `littleInFlight` (throughput × service time) and
 * `meanInFlight` agree when calls complete within the window; both against `limit` say how much
 * of its concurrency the stage used.
 */
export interface FlowSnapshot {
  /** The span the figures cover, in ms. */
  windowMs: number;
  /** Tickets released in the window (refunds are not counted: the call was never made). */
  released: number;
  /** `released` per second. */
  throughput: number;
  /** Mean ms from admission to release of the tickets released in the window. */
  serviceMs: number;
  /** 95th percentile of the same (over the most recent 256 of them). */
  serviceP95Ms: number;
  /** Tickets in flight, averaged over the window (time-weighted). */
  meanInFlight: number;
  /** `throughput × serviceMs / 1000`: the calls in flight Little's law gives. */
  littleInFlight: number;
  /** `meanInFlight / limit`; 0 where the stage has no concurrency limit. */
  utilisation: number;
  /**
   * ms callers waited for this stage in the window (for tokens, permits or a queue slot; a
   * fused gate's waits at the stage that refused them), counted when each wait ended.
   */
  waitedMs: number;
}

/** One traffic class of a stage, at the moment of the snapshot. */
export interface ClassSnapshot {
  /** Permits the class is owed whenever it has demand, at the current limit. */
  guarantee: number;
  /** Most permits it may hold, borrowing included, at the current limit. */
  ceiling: number;
  /** Permits of its guarantee it never lends, at the current limit (see `lendable`). */
  kept: number;
  /** Its priority among borrowers. */
  priority: number;
  /** Its calls holding a ticket. */
  inFlight: number;
  /** Permits it holds (a call of cost `c` holds `c`). */
  held: number;
  /** Its calls waiting. */
  waiting: number;
  /** Its admissions so far. */
  admitted: number;
}

/** A gate's snapshot: the sums over its stages, and each stage's own. */
export interface GateSnapshot extends Snapshot {
  stages: Snapshot[];
}

/**
 * Anything that admits calls. Every primitive is a stage, and so is a `Gate`, so gates nest.
 */
export interface Stage extends AsyncDisposable {
  readonly name: string;
  readonly kind: StageKind;
  /**
   * What a ticket of this stage stands for. `call`: held while the call runs. `wait`: held while
   * the call waits in a gate (a bounded queue); a `Gate` releases it as soon as every later stage
   * has admitted the call.
   */
  readonly holds: "call" | "wait";
  /**
   * The call option the stage keeps separate budgets by: `"key"` for a keyed token bucket,
   * `"host"` for an interval gate, undefined for one budget for all calls. A `Gate` passes a
   * call's `key` only to stages keyed by it, and refuses a `key` that no stage of it takes; a
   * stage of your own that reads `key` declares `keyedBy: "key"`.
   */
  readonly keyedBy?: "key" | "host" | undefined;
  /**
   * The largest cost one call can ever be admitted with (a bucket's capacity, a semaphore's
   * limit, a queue's maxSize, an AIMD limiter's min), when the stage has one. A `Gate` refuses a
   * larger cost at any of its stages before it takes any of them (reading it when the Gate is
   * built: it does not change for the stages floodgate builds).
   */
  readonly maxCost?: number | undefined;
  /**
   * The traffic classes the stage divides its limit among, in declaration order, when it was
   * built with `classes`. A `Gate` hands a call's `class` only to stages that have classes, and
   * refuses a `class` that none of them knows.
   */
  readonly classes?: readonly string[] | undefined;
  /** The class a call that names none draws on, at a stage with classes. */
  readonly defaultClass?: string | undefined;
  /** Wait for admission. See `AdmitOptions` for cancellation and timeouts. */
  admit(options?: AdmitOptions): Promise<Ticket>;
  /** Admit only if that needs no wait; resolves `undefined` when refused. */
  tryAdmit(options?: TryAdmitOptions): Promise<Ticket | undefined>;
  /**
   * Optional fast path for a `Gate`: the ticket, at once and without a promise, when `admit` with
   * these options would grant one without waiting; `undefined`, with nothing taken, in every
   * other case (it would wait, it refuses, it is closed, the signal is aborted). A Gate calls it
   * on the stages at the head of its list that have it, in order, so a call they all admit at
   * once needs no promise in between; at the first `undefined` it awaits that stage's `admit`
   * as usual. `options` are the Gate call's own, already checked (read `key` only if the stage is
   * `keyedBy: "key"`); `cost` is what the call costs at this stage (`costs[name]`, else `cost`,
   * else 1). It should not throw: if it does, the Gate gives back what it holds and the call
   * rejects with that error. The memory stages have it.
   */
  admitNow?(options: AdmitOptions, cost: number): Ticket | undefined;
  /**
   * Admit, call `fn` with the ticket, release the ticket with the call's outcome, and settle as
   * `fn` does. Rejects as `admit` does, and then `fn` is never called. Every stage floodgate
   * builds has it; a stage of your own may leave it out (a `Gate` admits and releases such a
   * stage itself).
   */
  run?<T>(fn: (ticket: Ticket) => T | PromiseLike<T>, options?: RunOptions<T>): Promise<T>;
  /** The stage's numbers now. */
  snapshot(): Snapshot;
  /**
   * Refuse new admissions, reject every waiter with `ClosedError` and abort every outstanding
   * ticket's `signal`. Held tickets can still be released.
   */
  close(): Promise<void>;
  /**
   * Shut down gracefully: refuse new calls at once with `DrainingError`, reject the waiting ones
   * (or, with `waiting: "admit"`, admit them as room frees), give the calls in flight `graceMs`
   * to release, then abort the rest through their `signal`, release them, and close. Every
   * stage floodgate builds has it; a `Gate` closes a stage of your own that lacks it.
   */
  drain?(options?: DrainOptions): Promise<DrainResult>;
}

/** An interval gate: a stage that can also hold a host back. */
export interface IntervalGateStage extends Stage {
  /**
   * Let no call start to `host` for `ms` milliseconds from now (a Retry-After). Never shortens an
   * earlier pause or the current spacing. On Redis it pauses the host for the whole fleet.
   * `host` is a non-empty string and `ms` a finite number >= 0; one above
   * `Number.MAX_SAFE_INTEGER` pauses that long. Never throws: bad arguments reject with
   * `InvalidOptionsError`, on both backends.
   */
  pause(host: string, ms: number): Promise<void>;
}

/** A factory of stages: `memory()` or `redis(client, { prefix })`. */
export interface Backend extends AsyncDisposable {
  readonly kind: "memory" | "redis";
  semaphore(name: string, options: SemaphoreOptions): Stage;
  tokenBucket(name: string, options: TokenBucketOptions): Stage;
  queue(name: string, options: QueueOptions): Stage;
  intervalGate(name: string, options: IntervalGateOptions): IntervalGateStage;
  aimd(name: string, options: AimdOptions): Stage;
  /** Close every stage the backend built. */
  close(): Promise<void>;
}

export type { Logger } from "./options.js";

/** Options for `drain()` (see `Stage.drain`). */
export interface DrainOptions {
  /**
   * How long calls in flight (and, with `waiting: "admit"`, calls still waiting) get to finish,
   * in ms; then their tickets' `signal` aborts with `DrainingError` and they are released.
   * A finite number >= 0. @default 30_000
   */
  graceMs?: number;
  /**
   * What calls already waiting get: `"reject"`, `DrainingError` at once; `"admit"`, admitted as
   * room frees, within the grace (those still waiting when it runs out are rejected).
   * @default "reject"
   */
  waiting?: "reject" | "admit";
}

/** What a drain did. */
export interface DrainResult {
  /** Calls that released their ticket within the grace (in flight when the drain began, or admitted during it). */
  completed: number;
  /** Calls still in flight when the grace ran out: their `signal` aborted and their ticket was released. */
  aborted: number;
  /** Waiting calls rejected with `DrainingError`. */
  rejected: number;
  /** How long the drain took, in ms on the stage's clock. */
  tookMs: number;
}
