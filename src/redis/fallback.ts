import { admitOptions, fnError, pauseError } from "../admit.js";
import { addFlows } from "../base/flow.js";
import { callWith, RESOLVED, type RecordingTicket } from "../base/run.js";
import type { Clock } from "../clock.js";
import { isFloodgateError } from "../errors.js";
import { HeldTicket } from "../ticket.js";
import type {
  AdmitOptions,
  IntervalGateStage,
  Logger,
  RunOptions,
  Snapshot,
  Stage,
  StageKind,
  Ticket,
  TryAdmitOptions,
} from "../types.js";

const NEVER = new AbortController().signal;

/** How long a stage stays on its fallback before it asks Redis again, in milliseconds. */
export const RETRY_REDIS_MS = 1000;

/** A ticket for a call let through with no limit (`fail-open`): it holds nothing to give back. */
class OpenTicket extends HeldTicket {
  constructor(
    readonly stage: string,
    readonly kind: StageKind,
    cost: number,
  ) {
    super(cost);
  }
  protected get ownerKind(): StageKind {
    return this.kind;
  }
  get signal(): AbortSignal {
    return NEVER;
  }
  protected giveBack(): Promise<void> {
    return RESOLVED;
  }
}

/**
 * A Redis stage with a policy for when Redis cannot be reached: let calls through (`fail-open`)
 * or through an in-memory stage holding this process's share of the limits (`local`). A failure
 * switches to the fallback for `RETRY_REDIS_MS`, then the next call tries Redis again. Every
 * switch is logged at warn. Tickets are released where they were granted.
 */
export class FallbackStage implements IntervalGateStage {
  readonly name: string;
  readonly kind: StageKind;
  readonly holds: "call" | "wait";
  #downUntil = Number.NEGATIVE_INFINITY;
  #down = false;
  #open = 0;

  constructor(
    readonly primary: Stage,
    readonly policy: "fail-open" | "local",
    readonly local: Stage | undefined,
    readonly clock: Clock,
    readonly log: Logger,
  ) {
    this.name = primary.name;
    this.kind = primary.kind;
    this.holds = primary.holds;
  }

  /** The largest cost the primary stage admits. */
  get maxCost(): number | undefined {
    return this.primary.maxCost;
  }

  /** The call option the primary stage is keyed by. */
  get keyedBy(): "key" | "host" | undefined {
    return this.primary.keyedBy;
  }

  /** True while calls go to the fallback. */
  get degraded(): boolean {
    return this.#down && this.clock.now() < this.#downUntil;
  }

  #fail(error: unknown): void {
    this.#downUntil = this.clock.now() + RETRY_REDIS_MS;
    if (!this.#down) {
      this.#down = true;
      this.log.warn({ err: error, policy: this.policy }, "Redis unavailable; switching to fallback");
    }
  }

  #recovered(): void {
    if (this.#down) {
      this.#down = false;
      this.log.warn({ policy: this.policy }, "Redis answers again; switching back");
    }
  }

  #fallback(options: AdmitOptions | undefined, wait: boolean): Promise<Ticket | undefined> {
    if (this.policy === "fail-open") {
      this.#open++;
      return Promise.resolve(new OpenTicket(this.name, this.kind, options?.cost ?? 1));
    }
    return wait ? this.local!.admit(options) : this.local!.tryAdmit(options);
  }

  async #route(options: AdmitOptions | undefined, wait: boolean): Promise<Ticket | undefined> {
    if (this.degraded) return this.#fallback(options, wait);
    try {
      const ticket = await (wait ? this.primary.admit(options) : this.primary.tryAdmit(options));
      this.#recovered();
      return ticket;
    } catch (error) {
      if (!isFloodgateError(error, "BACKEND_UNAVAILABLE")) throw error;
      this.#fail(error);
      return this.#fallback(options, wait);
    }
  }

  admit(options?: AdmitOptions): Promise<Ticket> {
    let o: AdmitOptions;
    try {
      o = admitOptions(this.kind, this.name, options, "admit");
    } catch (error) {
      return Promise.reject(error);
    }
    return this.#route(o, true) as Promise<Ticket>;
  }

  tryAdmit(options?: TryAdmitOptions): Promise<Ticket | undefined> {
    let o: AdmitOptions;
    try {
      o = admitOptions(this.kind, this.name, options, "tryAdmit");
    } catch (error) {
      return Promise.reject(error);
    }
    return this.#route(o, false);
  }

  /** As `stage.run`: admit (from Redis or the fallback), call `fn`, release with its outcome. */
  run<T>(fn: (ticket: Ticket) => T | PromiseLike<T>, options?: RunOptions<T>): Promise<T> {
    const notFn = fnError(this.kind, this.name, fn);
    if (notFn) return Promise.reject(notFn);
    let o: RunOptions<T>;
    try {
      o = admitOptions(this.kind, this.name, options) as RunOptions<T>;
    } catch (error) {
      return Promise.reject(error);
    }
    return this.#route(o, true).then((ticket) =>
      callWith(ticket as RecordingTicket, fn, o.classify, this.log),
    );
  }

  async pause(host: string, ms: number): Promise<void> {
    const invalid = pauseError(this.name, host, ms);
    if (invalid) throw invalid;
    const pauseOf = (s: Stage | undefined) => (s as IntervalGateStage | undefined)?.pause?.(host, ms);
    await pauseOf(this.local);
    try {
      await pauseOf(this.primary);
    } catch (error) {
      if (!isFloodgateError(error, "BACKEND_UNAVAILABLE")) throw error;
      this.#fail(error);
    }
  }

  snapshot(): Snapshot {
    const s = this.primary.snapshot();
    const l = this.local?.snapshot();
    if (l) {
      s.inFlight += l.inFlight;
      s.waiting += l.waiting;
      s.queueDepth += l.queueDepth;
      s.shed += l.shed;
      s.admitted += l.admitted;
      s.timedOut += l.timedOut;
      s.aborted += l.aborted;
      s.tokenWaitMs += l.tokenWaitMs;
      s.permitWaitMs += l.permitWaitMs;
      s.queueWaitMs += l.queueWaitMs;
      s.leasesLost += l.leasesLost;
      if (s.flow && l.flow) s.flow = addFlows(s.flow, l.flow, s.limit);
    }
    s.admitted += this.#open;
    return s;
  }

  async close(): Promise<void> {
    await Promise.all([this.primary.close(), this.local?.close()]);
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
