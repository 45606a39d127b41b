/**
 * The memory token bucket (described at `MemoryTokenBucket`). Over 350 lines because its plain
 * and classed lines share each key's bucket, its one timer and the stage's tickets; the
 * arithmetic is src/algorithms/token-bucket.ts, the class rule src/algorithms/bucket-classes.ts.
 */
import { LONGEST_MS } from "../admit.js";
import {
  type BucketClassLine,
  type BucketPick,
  type BucketShares,
  bucketShares,
  type ClassLedger,
  chargeClass,
  creditClass,
  ledgerIsFull,
  newLedger,
  nextBucketClass,
} from "../algorithms/bucket-classes.js";
import {
  type BucketConfig,
  isIdle,
  lineTakeInPlace,
  type MutableBucketState,
  penalizeInPlace,
  refundInPlace,
  settleInPlace,
  takeInPlace,
  tokensAt,
  waitMs,
} from "../algorithms/token-bucket.js";
import { type ClassBook, classBook, classRule } from "../base/classes.js";
import { TimedLine } from "../base/line-stage.js";
import { BaseTicket } from "../base/stage.js";
import { type WaitEntry, WaitList } from "../base/wait-list.js";
import { bothRules, bucketRule, UNKEYED } from "../call-rule.js";
import type { Clock } from "../clock.js";
import { DEFAULTS } from "../defaults.js";
import { fusable } from "../fuse.js";
import type { TokenBucketOptions } from "../options.js";
import type { AdmitOptions, ClassSnapshot, Outcome, Snapshot, StageKind, Ticket } from "../types.js";
import { parseOptions, tokenBucketSchema } from "../validate.js";
import { memoryFusion } from "./fused-gate.js";
import { MemoryLineStage } from "./line-stage.js";

/** The class lines of every key of a bucket without classes: none, and never added to. */
const NO_CLASS_LINES: readonly ClassLine[] = Object.freeze([]);

/**
 * One key's bucket: the algorithm's state plus its FIFO of waiters and the timer for its head.
 * With traffic classes, its waiters stand in one line per class instead, and `ledger` keeps
 * what each class has drawn.
 */
class KeyBucket extends TimedLine implements MutableBucketState {
  /** The latest ticket granted from this key; only it can be refunded exactly. */
  lastGrant: BaseTicket | undefined = undefined;
  /**
   * The bucket as of the end of its line (without classes): when its last waiter would go, and
   * what would be left then, as `lineTakeInPlace` works it out. Kept while `endOf` is the line's
   * tail, so each new waiter extends it; anything else that moves the line (a waiter leaving,
   * a refund, a settle, a penalty) drops it, and it is worked out again when next needed.
   */
  end: MutableBucketState | undefined = undefined;
  endOf: WaitEntry | null = null;
  /** One line per class (without classes, one empty list shared by every key). */
  classLines: readonly ClassLine[] = NO_CLASS_LINES;
  ledger: ClassLedger | undefined = undefined;
  constructor(
    public tokens: number,
    public updatedAt: number,
    public factor = 1,
    public penalizedAt = 0,
  ) {
    super();
  }
}

/** The waiters of one class at one key's bucket. */
class ClassLine extends WaitList {
  constructor(
    readonly bucket: KeyBucket,
    readonly cls: number,
  ) {
    super();
  }
}

/** A token bucket's ticket, with the class it drew on (-1 without classes). */
class BucketTicket extends BaseTicket {
  cls = -1;
}

/**
 * A token bucket per key: each key holds up to `capacity` tokens and gains `refillPerSecond`.
 * A call of cost `c` waits until its key holds `c` tokens; waiters of one key are served first in,
 * first out, each key on a single timer. A cost above `capacity` is refused at once.
 *
 * With traffic classes (`classes`), the refill and capacity are divided into guaranteed shares
 * that lend what they leave idle: each key's waiters stand in a line per class, and the next to
 * take tokens is the head `nextBucketClass` picks (src/algorithms/bucket-classes.ts).
 */
export class MemoryTokenBucket extends MemoryLineStage<KeyBucket> {
  readonly kind: StageKind = "tokenBucket";
  readonly #config: BucketConfig;
  readonly #initial: number;
  readonly #penaltyFactor: number | undefined;
  readonly #minFactor: number;
  readonly #keyed: boolean;
  /** The stage's classes, or undefined: one line per key. */
  readonly #book: ClassBook | undefined;
  readonly #shares: BucketShares | undefined;
  /** What `nextBucketClass` reads of each class, rewritten in place before each pick. */
  readonly #view: BucketClassLine[] = [];
  readonly #pickOut: BucketPick = { cls: -1, waitMs: 0 };

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
    this.#book = classBook("tokenBucket", name, o, o.capacity, o.capacity);
    this.callRule = bucketRule(this.#keyed);
    if (this.#book) {
      this.#shares = bucketShares(this.#config, this.#book.configs);
      for (let i = 0; i < this.#book.names.length; i++)
        this.#view.push({ headCost: undefined, headAt: 0, headSince: 0 });
      this.callRule = bothRules(this.callRule, classRule(this.#book));
    } else fusable(this, memoryFusion(clock));
    this.init(o.logger);
  }

  /** The names of the stage's classes, when it has them. */
  override get classes(): readonly string[] | undefined {
    return this.#book?.names;
  }

  /** The class of a call that names none, when the stage has classes. */
  get defaultClass(): string | undefined {
    return this.#book?.defaultClass;
  }

  protected override newTicket(cost: number, key: string, now: number): BaseTicket {
    return new BucketTicket(this, cost, key, now);
  }

  /** The class a call draws on (its index), or -1 without classes. */
  #classOf(o: AdmitOptions, cost: number): number {
    return this.#book === undefined ? -1 : this.#book.indexOf(o, cost);
  }

  /**
   * The class whose head takes tokens next at `b` (or -1) and how long until that may change.
   * With `extra` (a class with nobody in line), that class is looked at as if a call of cost
   * `extraCost` stood at its head, arrived after everyone.
   */
  #pick(b: KeyBucket, now: number, extra = -1, extraCost = 0): BucketPick {
    const view = this.#view;
    for (let i = 0; i < view.length; i++) {
      const v = view[i]!;
      const head = b.classLines[i]!.head;
      v.headCost = i === extra ? extraCost : head?.cost;
      v.headAt = i === extra ? Number.POSITIVE_INFINITY : (head?.seq ?? 0);
      v.headSince = i === extra ? now : (head?.enqueuedAt ?? now);
    }
    return nextBucketClass(
      view,
      b.ledger!,
      this.#shares!,
      this.#book!.configs,
      b,
      this.#config,
      now,
      this.#pickOut,
    );
  }

  /** Take `cost` tokens from `b` for class `cls` now, if its turn has come; false if not. */
  #takeFor(b: KeyBucket, cls: number, cost: number, now: number): boolean {
    if (cls < 0) return b.size === 0 && this.#take(b, cost, now);
    if (b.classLines[cls]!.size !== 0 || this.#pick(b, now, cls, cost).cls !== cls) return false;
    this.#charge(b, cls, cost, now);
    return true;
  }

  /** `cost` tokens out of `b` for class `cls`, its turn having come (its call waiting since `since`). */
  #charge(b: KeyBucket, cls: number, cost: number, now: number, since = now): void {
    this.#take(b, cost, now);
    chargeClass(b.ledger!, this.#shares!, this.#config, cls, cost, now, since);
  }

  protected isIdle(b: KeyBucket, now: number): boolean {
    // Full and unpenalised: a fresh key would be no better off. (A fresh key starts with
    // `initialTokens`, which is never more.) With classes, nobody of any class waits and every
    // class's ledger is full again.
    if (b.size !== 0 || !isIdle(b, this.#config, now)) return false;
    if (b.ledger === undefined) return true;
    for (const line of b.classLines) if (line.size !== 0) return false;
    return ledgerIsFull(b.ledger, this.#shares!, this.#config, now);
  }

  protected newLine(now: number): KeyBucket {
    const b = new KeyBucket(this.#initial, now);
    if (this.#book) {
      b.classLines = this.#book.names.map((_, i) => new ClassLine(b, i));
      b.ledger = newLedger(this.#shares!, now);
    }
    return b;
  }

  /** Grant the key's waiters that fit (with classes: in the order `nextBucketClass` picks). */
  protected grantReady(b: KeyBucket, _key: string, now: number): void {
    if (b.ledger) {
      for (let cls = this.#pick(b, now).cls; cls >= 0; cls = this.#pick(b, now).cls) {
        const w = b.classLines[cls]!.head!;
        this.#charge(b, cls, w.cost, now, w.enqueuedAt);
        this.#granted(b, this.grant(w, "token"), cls);
      }
      return;
    }
    for (let w = b.head; w && this.#take(b, w.cost, now); w = b.head) b.lastGrant = this.grant(w, "token");
  }

  /** Note a ticket of class `cls` granted from `b`: the latest grant, and its class's count. */
  #granted(b: KeyBucket, ticket: BaseTicket, cls: number): BaseTicket {
    b.lastGrant = ticket;
    if (cls >= 0) {
      (ticket as BucketTicket).cls = cls;
      this.#book!.take(cls, ticket.cost);
    }
    return ticket;
  }

  /** How long until the head's cost is in the bucket (a debt is waited out too). */
  protected headWaitMs(b: KeyBucket, head: WaitEntry, now: number): number {
    return waitMs(b, this.#config, head.cost, now);
  }

  /** With classes, until the pick may change; without, as for any line. */
  protected override nextWaitMs(b: KeyBucket, now: number): number | undefined {
    if (!b.ledger) return super.nextWaitMs(b, now);
    const ms = this.#pick(b, now).waitMs;
    return ms === Number.POSITIVE_INFINITY ? undefined : ms;
  }

  /** Take `cost` from `b` if it holds that many now. */
  #take(b: KeyBucket, cost: number, now: number): boolean {
    return takeInPlace(b, this.#config, cost, now);
  }

  /** A ticket for tokens just taken from `b` for class `cls` (-1: none) at `now`, without waiting. */
  #issue(b: KeyBucket, cost: number, key: string, cls: number, now: number): BaseTicket {
    return this.#granted(b, this.issue(cost, key, undefined, "token", false, now), cls);
  }

  /** A ticket of cost 0: it takes nothing, so it goes at once, the bucket untouched (as on Redis). */
  #free(key: string, cls: number): BaseTicket {
    const ticket = this.issue(0, key, undefined, "token");
    if (cls >= 0) {
      (ticket as BucketTicket).cls = cls;
      this.#book!.take(cls, 0);
    }
    return ticket;
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
    const cls = this.#classOf(o, cost);
    if (cost === 0) return Promise.resolve(this.#free(key, cls));
    const now = this.clock.now();
    const b = this.line(key, now);
    if (this.#takeFor(b, cls, cost, now)) return Promise.resolve(this.#issue(b, cost, key, cls, now));
    if (cls >= 0) {
      const promise = this.wait(b.classLines[cls]!, cost, key, o);
      this.schedule(b, key);
      return promise;
    }
    if (o.timeoutMs !== undefined && !o.signal?.aborted) {
      // Refuse at once what cannot be granted in time, behind the line as it stands, rather
      // than wait and fail.
      const ms =
        b.size === 0
          ? Math.min(waitMs(b, this.#config, cost, now), LONGEST_MS)
          : this.#endWaitMs(b, cost, now);
      if (ms > o.timeoutMs) {
        this.timedOut++;
        return Promise.reject(this.#timeout(o.timeoutMs, ms));
      }
    }
    const promise = this.wait(b, cost, key, o);
    this.#extendEnd(b, cost, now);
    this.schedule(b, key);
    return promise;
  }

  /**
   * Milliseconds until a call of `cost` would go behind `b`'s waiters, as they stand: each in
   * turn once the refill has brought its tokens (as the Redis bucket reserves its callers'
   * places). A refund, a settle or a waiter leaving may bring it sooner.
   */
  #endWaitMs(b: KeyBucket, cost: number, now: number): number {
    const end = this.#end(b, now);
    const probe = {
      tokens: end.tokens,
      updatedAt: end.updatedAt,
      factor: end.factor,
      penalizedAt: end.penalizedAt,
    };
    return lineTakeInPlace(probe, this.#config, cost, now, -1).waitMs;
  }

  /** `b` as of the end of its line: kept since the line's tail joined, else worked out again. */
  #end(b: KeyBucket, now: number): MutableBucketState {
    if (b.end !== undefined && b.endOf === b.tail) return b.end;
    const end = { tokens: b.tokens, updatedAt: b.updatedAt, factor: b.factor, penalizedAt: b.penalizedAt };
    for (let w: WaitEntry | null = b.head; w; w = w.next) lineTakeInPlace(end, this.#config, w.cost, now, -1);
    b.end = end;
    b.endOf = b.tail;
    return end;
  }

  /** A waiter of `cost` just joined `b`'s line: the line's end moves past it, if it is kept. */
  #extendEnd(b: KeyBucket, cost: number, now: number): void {
    const end = b.end;
    if (end === undefined || b.tail === null || b.endOf !== b.tail.prev) {
      b.end = undefined;
      return;
    }
    lineTakeInPlace(end, this.#config, cost, now, -1);
    b.endOf = b.tail;
  }

  override admitNow(o: AdmitOptions, cost: number): BaseTicket | undefined {
    if (
      this.refusing ||
      !Number.isInteger(cost) ||
      cost < 0 ||
      cost > this.#config.capacity ||
      o.signal?.aborted
    ) {
      return undefined;
    }
    const key = this.#keyed ? o.key : UNKEYED;
    if (key === undefined) return undefined;
    const cls = this.#classOf(o, cost);
    if (cost === 0) return this.#free(key, cls);
    const now = this.time();
    const b = this.line(key, now);
    if (!this.#takeFor(b, cls, cost, now)) return undefined;
    return this.#issue(b, cost, key, cls, now);
  }

  override fuseProbe(o: AdmitOptions, cost: number): number {
    this.throwIfRefusing();
    const key = this.#keyed ? o.key : UNKEYED;
    if (key === undefined || !Number.isInteger(cost) || cost < 0 || cost > this.#config.capacity) {
      return Number.NaN;
    }
    if (cost === 0) return 0;
    const now = this.time();
    const b = this.line(key, now);
    // With waiters of its own, the bucket's tokens are theirs first: after them, at the soonest.
    if (b.size !== 0) return Math.max(1, Math.min(this.#endWaitMs(b, cost, now), LONGEST_MS));
    return Math.min(waitMs(b, this.#config, cost, now), LONGEST_MS);
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const cost = o.cost ?? 1;
    const key = this.#keyed ? o.key! : UNKEYED;
    const cls = this.#classOf(o, cost);
    if (cost === 0) return Promise.resolve(this.#free(key, cls));
    const now = this.clock.now();
    const b = this.line(key, now);
    if (!this.#takeFor(b, cls, cost, now)) return Promise.resolve(undefined);
    return Promise.resolve(this.#issue(b, cost, key, cls, now));
  }

  #timeout(timeoutMs: number, retryAfterMs: number) {
    const e = this.timeoutError(timeoutMs, retryAfterMs);
    this.log.warn({ timeoutMs, retryAfterMs }, "admission timed out");
    return e;
  }

  releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): void {
    const cls = (ticket as BucketTicket).cls;
    if (cls >= 0) this.#book!.giveBackAt(cls, ticket.cost);
    if (refund) {
      // Tokens come back only when no call has taken from the key since: then the bucket ends
      // up no fuller than if this call had never been admitted. After another grant, the
      // refill the cap threw away cannot be told apart, so nothing comes back. With classes,
      // they come back to the ticket's class too.
      const b = this.lines.get(ticket.key);
      if (!b || b.lastGrant !== ticket) return;
      b.lastGrant = undefined;
      b.end = undefined;
      const now = this.clock.now();
      refundInPlace(b, this.#config, ticket.cost, now);
      if (cls >= 0) this.#credit(b, cls, ticket.cost, now);
      this.serveLine(b, ticket.key);
    } else if (outcome === "dropped" && this.#penaltyFactor !== undefined) {
      const now = this.clock.now();
      const b = this.line(ticket.key, now);
      b.end = undefined;
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
    const cls = (ticket as BucketTicket).cls;
    // What the class's tickets cost follows the ticket, whether or not tokens come back.
    if (cls >= 0) this.#book!.reprice(cls, actual - estimated);
    const now = this.clock.now();
    const b = this.line(ticket.key, now);
    b.end = undefined;
    // A charge may leave a debt (see settleInPlace); a give-back needs the latest grant.
    if (!settleInPlace(b, this.#config, actual - estimated, b.lastGrant === ticket, now)) return;
    if (cls >= 0) {
      if (actual > estimated)
        chargeClass(b.ledger!, this.#shares!, this.#config, cls, actual - estimated, now);
      else this.#credit(b, cls, estimated - actual, now);
    }
    this.serveLine(b, ticket.key);
  }

  /** `amount` tokens back to class `cls` of `b` (up to what its ledger holds with its head waiting). */
  #credit(b: KeyBucket, cls: number, amount: number, now: number): void {
    const head = b.classLines[cls]!.head;
    creditClass(
      b.ledger!,
      this.#shares!,
      this.#config,
      cls,
      amount,
      now,
      head?.cost ?? 0,
      head?.enqueuedAt ?? now,
    );
  }

  /** The key's bucket of a line: itself, or the bucket a class's line belongs to. */
  #bucketOf(list: WaitList): KeyBucket {
    return list instanceof ClassLine ? list.bucket : (list as KeyBucket);
  }

  protected afterWaiterGone(list: WaitList, waiter: { key: string }): void {
    const b = this.#bucketOf(list);
    b.end = undefined;
    this.serveLine(b, waiter.key);
  }

  protected override grantDue(list: WaitList, key: string): undefined {
    this.serveLine(this.#bucketOf(list), key);
  }

  /** Every line waiters stand in: each key's, or each class's line of each key. */
  protected override lists(): Iterable<WaitList> {
    if (!this.#book) return super.lists();
    const out: WaitList[] = [];
    for (const b of this.lines.map.values()) out.push(...b.classLines);
    return out;
  }

  override snapshot(): Snapshot {
    const snap = super.snapshot();
    const book = this.#book;
    if (!book) return snap;
    const shares = this.#shares!;
    const classes: Record<string, ClassSnapshot> = {};
    book.names.forEach((name, i) => {
      let waiting = 0;
      for (const b of this.lines.map.values()) waiting += b.classLines[i]!.size;
      classes[name] = {
        guarantee: shares.rate[i]!,
        ceiling: this.#config.refillPerSecond * shares.ceiling[i]!,
        kept: shares.kept[i]!,
        priority: book.configs[i]!.priority,
        inFlight: book.calls[i]!,
        held: book.used[i]!,
        waiting,
        admitted: book.admitted[i]!,
      };
    });
    snap.classes = classes;
    return snap;
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
