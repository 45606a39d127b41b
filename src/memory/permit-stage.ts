import { BaseStage, type BaseTicket, type RunWaiter, type WaitFor } from "../base/stage.js";
import { WaitList } from "../base/wait-list.js";
import type { Clock } from "../clock.js";
import type { AdmitOptions, Outcome, RunOptions, Snapshot, Ticket } from "../types.js";

/**
 * Permits counted against a limit, waiters served strictly first in, first out, so a large `cost`
 * at the head is never starved by small ones behind it. The semaphore, the bounded queue and the
 * AIMD limiter are all this, with a different rule for the limit and for a full house.
 */
export abstract class PermitStage extends BaseStage {
  protected limit: number;
  protected used = 0;
  protected readonly waiters = new WaitList();
  protected readonly waitFor: WaitFor = "permit";

  constructor(name: string, limit: number, clock: Clock) {
    super(name, clock);
    this.limit = limit;
  }

  /**
   * The largest cost one call can ever be admitted with: a larger one is refused at once with
   * `InvalidOptionsError`, and a Gate refuses it before it takes any stage.
   */
  override get maxCost(): number {
    return this.limit;
  }

  /**
   * Whether `cost` can be granted now without overtaking anyone: nobody in line and room for it.
   * A cost of 0 takes nothing, so it goes at once even past callers in line (as on Redis).
   */
  protected fitsNow(cost: number): boolean {
    return (this.waiters.size === 0 || cost === 0) && this.used + cost <= this.limit;
  }

  /** Take `cost` permits now and issue their ticket. */
  protected take(cost: number): BaseTicket {
    this.used += cost;
    return this.issue(cost, "", undefined, this.waitFor);
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const cost = o.cost ?? 1;
    if (this.fitsNow(cost)) return Promise.resolve(this.take(cost));
    return this.shedding() ?? this.wait(this.waiters, cost, "", o);
  }

  override admitNow(o: AdmitOptions, cost: number): BaseTicket | undefined {
    if (
      this.closed ||
      !Number.isInteger(cost) ||
      cost < 0 ||
      cost > this.maxCost ||
      !this.fitsNow(cost) ||
      o.signal?.aborted
    ) {
      return undefined;
    }
    return this.take(cost);
  }

  override waitInGate<T>(
    w: RunWaiter<T>,
    o: AdmitOptions,
    timeoutMs: number | undefined,
  ): Promise<T> | undefined {
    const cost = w.cost;
    if (
      this.closed ||
      !this.blocks ||
      !Number.isInteger(cost) ||
      cost < 0 ||
      cost > this.maxCost ||
      timeoutMs === 0 ||
      o.signal?.aborted ||
      this.fitsNow(cost)
    ) {
      return undefined;
    }
    w.enqueuedAt = this.clock.now();
    return this.lineUp(this.waiters, w, o.signal, timeoutMs);
  }

  /** Whether a call that finds no room waits for it (a queue may shed instead). */
  protected get blocks(): boolean {
    return true;
  }

  /** What a call that finds no room gets instead of a place in line: a shedding queue's error. */
  protected shedding(): Promise<never> | undefined {
    return undefined;
  }

  /**
   * Admit, call `fn`, release with the outcome. With room, `fn` is called before `run` returns;
   * otherwise the waiting call holds `fn` itself and calls it, in the caller's context, once
   * granted.
   */
  override run<T>(fn: (ticket: Ticket) => T | PromiseLike<T>, options?: RunOptions<T>): Promise<T> {
    if (typeof fn !== "function") return super.run(fn, options);
    let o: RunOptions<T>;
    try {
      o = this.check(options) as RunOptions<T>;
    } catch (error) {
      return Promise.reject(error);
    }
    const cost = o.cost ?? 1;
    if (this.fitsNow(cost)) return this.callTicket(this.take(cost), fn, o.classify);
    return this.shedding() ?? this.waitToRun(this.waiters, cost, "", o, fn);
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const cost = o.cost ?? 1;
    return Promise.resolve(this.fitsNow(cost) ? this.take(cost) : undefined);
  }

  releaseTicket(ticket: BaseTicket, _outcome: Outcome, _refund: boolean): void {
    this.used -= ticket.cost;
    this.drain();
  }

  /** Grant waiters from the head while they fit. */
  protected drain(): void {
    const list = this.waiters;
    for (let w = list.head; w && this.used + w.cost <= this.limit; w = list.head) {
      this.used += w.cost;
      this.grant(w, this.waitFor);
    }
  }

  protected afterWaiterGone(): void {
    this.drain();
  }

  protected lists(): Iterable<WaitList> {
    return [this.waiters];
  }

  /** Permits held now. */
  get held(): number {
    return this.used;
  }

  snapshot(): Snapshot {
    return this.baseSnapshot(this.limit);
  }
}
