import { LONGEST_MS } from "../admit.js";
import {
  type BucketConfig,
  isIdle,
  type MutableBucketState,
  penalizeInPlace,
  refundInPlace,
  settleInPlace,
  takeInPlace,
  tokensAt,
  waitMs,
} from "../algorithms/token-bucket.js";
import { TimedLine } from "../base/line-stage.js";
import type { BaseTicket } from "../base/stage.js";
import type { WaitEntry, WaitList } from "../base/wait-list.js";
import { bucketRule, UNKEYED } from "../call-rule.js";
import type { Clock } from "../clock.js";
import { DEFAULTS } from "../defaults.js";
import type { TokenBucketOptions } from "../options.js";
import type { AdmitOptions, Outcome, StageKind, Ticket } from "../types.js";
import { parseOptions, tokenBucketSchema } from "../validate.js";
import { MemoryLineStage } from "./line-stage.js";

/** One key's bucket: the algorithm's state plus its FIFO of waiters and the timer for its head. */
class KeyBucket extends TimedLine implements MutableBucketState {
  /** The latest ticket granted from this key; only it can be refunded exactly. */
  lastGrant: BaseTicket | undefined = undefined;
  constructor(
    public tokens: number,
    public updatedAt: number,
    public factor = 1,
    public penalizedAt = 0,
  ) {
    super();
  }
}

/**
 * A token bucket per key: each key holds up to `capacity` tokens and gains `refillPerSecond`.
 * A call of cost `c` waits until its key holds `c` tokens; waiters of one key are served first in,
 * first out, each key on a single timer. A cost above `capacity` is refused at once.
 */
export class MemoryTokenBucket extends MemoryLineStage<KeyBucket> {
  readonly kind: StageKind = "tokenBucket";
  readonly #config: BucketConfig;
  readonly #initial: number;
  readonly #penaltyFactor: number | undefined;
  readonly #minFactor: number;
  readonly #keyed: boolean;

  constructor(name: string, options: TokenBucketOptions, clock: Clock) {
    const o = parseOptions(tokenBucketSchema, "tokenBucket", name, options);
    const fillMs = Math.ceil((o.capacity * 1000) / o.refillPerSecond);
    super(name, clock, Math.min(Math.max(1000, fillMs), 600_000));
    this.#config = {
      capacity: o.capacity,
      refillPerSecond: o.refillPerSecond,
      recoveryMs: o.penalty?.recoveryMs ?? DEFAULTS.tokenBucket.penalty.recoveryMs,
    };
    this.#initial = o.initialTokens ?? o.capacity;
    this.#penaltyFactor = o.penalty ? (o.penalty.factor ?? DEFAULTS.tokenBucket.penalty.factor) : undefined;
    this.#minFactor = o.penalty?.minFactor ?? DEFAULTS.tokenBucket.penalty.minFactor;
    this.#keyed = o.keyed ?? false;
    this.callRule = bucketRule(this.#keyed);
    this.init(o.logger);
  }

  protected isIdle(b: KeyBucket, now: number): boolean {
    // Full and unpenalised: a fresh key would be no better off. (A fresh key starts with
    // `initialTokens`, which is never more.)
    return b.size === 0 && isIdle(b, this.#config, now);
  }

  protected newLine(now: number): KeyBucket {
    return new KeyBucket(this.#initial, now);
  }

  /** Grant the key's waiters that fit. */
  protected grantReady(b: KeyBucket, _key: string, now: number): void {
    for (let w = b.head; w && this.#take(b, w.cost, now); w = b.head) b.lastGrant = this.grant(w, "token");
  }

  /** How long until the head's cost is in the bucket (a debt is waited out too). */
  protected headWaitMs(b: KeyBucket, head: WaitEntry, now: number): number {
    return waitMs(b, this.#config, head.cost, now);
  }

  /** Take `cost` from `b` if it holds that many now. */
  #take(b: KeyBucket, cost: number, now: number): boolean {
    return takeInPlace(b, this.#config, cost, now);
  }

  /** A ticket for tokens just taken from `b` without waiting. */
  #issue(b: KeyBucket, cost: number, key: string): BaseTicket {
    b.lastGrant = this.issue(cost, key, undefined, "token");
    return b.lastGrant;
  }

  /**
   * The largest cost one call can ever be admitted with: a larger one is refused at once with
   * `InvalidOptionsError`, and a Gate refuses it before it takes any stage.
   */
  override get maxCost(): number {
    return this.#config.capacity;
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const cost = o.cost ?? 1;
    const key = this.#keyed ? o.key! : UNKEYED;
    // A cost of 0 takes nothing: admitted at once, the bucket untouched (as on Redis).
    if (cost === 0) return Promise.resolve(this.issue(0, key, undefined, "token"));
    const now = this.clock.now();
    const b = this.line(key, now);
    if (b.size === 0 && this.#take(b, cost, now)) return Promise.resolve(this.#issue(b, cost, key));
    if (o.timeoutMs !== undefined && !o.signal?.aborted && b.size === 0) {
      // Refuse at once what cannot be granted in time, rather than wait and fail.
      const ms = Math.min(waitMs(b, this.#config, cost, now), LONGEST_MS);
      if (ms > o.timeoutMs) {
        this.timedOut++;
        return Promise.reject(this.#timeout(o.timeoutMs, ms));
      }
    }
    const promise = this.wait(b, cost, key, o);
    this.schedule(b, key);
    return promise;
  }

  override admitNow(o: AdmitOptions, cost: number): BaseTicket | undefined {
    if (
      this.closed ||
      !Number.isInteger(cost) ||
      cost < 0 ||
      cost > this.#config.capacity ||
      o.signal?.aborted
    ) {
      return undefined;
    }
    const key = this.#keyed ? o.key : UNKEYED;
    if (key === undefined) return undefined;
    if (cost === 0) return this.issue(0, key, undefined, "token");
    const now = this.clock.now();
    const b = this.line(key, now);
    if (b.size !== 0 || !this.#take(b, cost, now)) return undefined;
    return this.#issue(b, cost, key);
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const cost = o.cost ?? 1;
    const key = this.#keyed ? o.key! : UNKEYED;
    if (cost === 0) return Promise.resolve(this.issue(0, key, undefined, "token"));
    const now = this.clock.now();
    const b = this.line(key, now);
    if (b.size > 0 || !this.#take(b, cost, now)) return Promise.resolve(undefined);
    return Promise.resolve(this.#issue(b, cost, key));
  }

  #timeout(timeoutMs: number, retryAfterMs: number) {
    const e = this.timeoutError(timeoutMs, retryAfterMs);
    this.log.warn({ timeoutMs, retryAfterMs }, "admission timed out");
    return e;
  }

  releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): void {
    if (refund) {
      // Tokens come back only when no call has taken from the key since: then the bucket ends
      // up no fuller than if this call had never been admitted. After another grant, the
      // refill the cap threw away cannot be told apart, so nothing comes back.
      const b = this.lines.get(ticket.key);
      if (!b || b.lastGrant !== ticket) return;
      b.lastGrant = undefined;
      refundInPlace(b, this.#config, ticket.cost, this.clock.now());
      this.drain(b, ticket.key);
    } else if (outcome === "dropped" && this.#penaltyFactor !== undefined) {
      const now = this.clock.now();
      const b = this.line(ticket.key, now);
      const rateFactor = penalizeInPlace(b, this.#config, this.#penaltyFactor, this.#minFactor, now);
      this.log.warn({ key: ticket.key, rateFactor }, "key penalised after drop");
      this.schedule(b, ticket.key);
    }
  }

  /** Re-price the ticket at `actual`: charge the difference, or give it back while still the latest. */
  override settleTicket(ticket: BaseTicket, actual: number): void {
    const estimated = ticket.cost;
    if (actual === estimated) return;
    ticket.cost = actual;
    const now = this.clock.now();
    const b = this.line(ticket.key, now);
    // A charge may leave a debt (see settleInPlace); a give-back needs the latest grant.
    if (!settleInPlace(b, this.#config, actual - estimated, b.lastGrant === ticket, now)) return;
    this.drain(b, ticket.key);
  }

  protected afterWaiterGone(list: WaitList, waiter: { key: string }): void {
    this.drain(list as KeyBucket, waiter.key);
  }

  /** Tokens `key` holds now (refilled, capped). */
  tokens(key: string = UNKEYED): number {
    const b = this.lines.get(key);
    return b ? tokensAt(b, this.#config, this.clock.now()) : this.#initial;
  }

  /** Keys currently kept in memory. */
  get keyCount(): number {
    return this.lines.size;
  }

  /** Delete idle keys now rather than at the next sweep; returns how many went. */
  evictIdle(): number {
    return this.lines.sweep();
  }
}
