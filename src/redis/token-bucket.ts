/**
 * The Redis token bucket without classes (the stage is described at `RedisTokenBucket`). Over
 * 350 lines because a reservation's life (taken, slept on, due, given up, its place passed on to
 * the next caller of this process) runs through the key's line, its places and the stage's
 * waiting together; the script calls are bucket-scripts.ts, the classed bucket bucket-classes.ts.
 */
import { KeyedLineStage, TimedLine } from "../base/line-stage.js";
import { answerWith, BaseTicket, type StepDone } from "../base/stage.js";
import { type WaitEntry, Waiter, type WaitList } from "../base/wait-list.js";
import { bucketRule, UNKEYED } from "../call-rule.js";
import { DEFAULTS } from "../defaults.js";
import { fusable } from "../fuse.js";
import type { TokenBucketOptions } from "../options.js";
import type { AdmitOptions, Outcome, StageKind, Ticket } from "../types.js";
import { parseOptions, tokenBucketSchema } from "../validate.js";
import { ScriptBatch } from "./batch.js";
import { BucketScripts, type TakeReply } from "./bucket-scripts.js";
import type { RedisLink } from "./link.js";
import type { RedisContext } from "./semaphore.js";

/** A key's reserved waiters, and its takes: those made in one turn go together. */
class BucketLine extends TimedLine {
  /** KEYS of the key's scripts. */
  readonly keys: readonly string[];

  constructor(
    readonly redisKey: string,
    readonly takes: ScriptBatch,
  ) {
    super();
    this.keys = [redisKey];
  }
}

/** A ticket that knows its grant, so a refund can tell whether it is still the latest. */
class GrantTicket extends BaseTicket {
  grant = "";
}

/** A caller whose tokens are reserved in Redis: it goes when their time comes. */
class Reservation extends Waiter {
  grant = "";
  /** When it goes, on the stage's clock. */
  dueAt = 0;
  /** When its place began (the caller before it goes, or when it asked), on the stage's clock. */
  fromAt = 0;
  /** When its `timeoutMs` runs out, on the stage's clock (Infinity: never). */
  deadline = Number.POSITIVE_INFINITY;
  /** It came too late for its place and is asking for a new one. */
  asking = false;
}

/** A reservation's place in its key's line: what it holds, when it began and when it goes. */
interface Place {
  cost: number;
  grant: string;
  fromAt: number;
  dueAt: number;
}

/**
 * How late (ms) a reserved caller may still take its place whatever its cost: a timer on a busy
 * machine fires a few milliseconds late, and a place lost for that goes unused. Going that late
 * can pass the cap by at most this long's refill, less the room the bucket has above the cost
 * (nothing for a bucket whose capacity holds the cost and 20 ms of refill). See `#due`.
 */
export const LATE_MS = 20;

/**
 * `redis(...).tokenBucket(name, options)`: one bucket per key in Redis, refilled by the server's
 * clock and shared by the fleet, with one line per key across the fleet. A caller whose tokens
 * are not there (or who comes while others wait) reserves its place in the same script call and
 * sleeps until its tokens have refilled: the key's callers go in the order Redis saw them ask,
 * whichever process they run in, with one script call per admission and no polling. A wait
 * longer than `timeoutMs` is refused at once. A caller that gives up leaves its place to the
 * next of this process; a caller that wakes too late for its place asks again (see `#due`). Idle
 * keys expire in Redis once they would be full again. docs/redis.md says what differs from
 * memory.
 */
export class RedisTokenBucket extends KeyedLineStage<BucketLine> {
  readonly kind: StageKind = "tokenBucket";
  override readonly backend = "redis";
  readonly #link: RedisLink;
  readonly #capacity: number;
  readonly #refill: number;
  readonly #penaltyFactor: number | undefined;
  readonly #keyed: boolean;
  /** Its script calls. */
  readonly #scripts: BucketScripts;

  constructor(name: string, options: TokenBucketOptions, ctx: RedisContext) {
    super(name, ctx.clock, 10_000);
    const o = parseOptions(tokenBucketSchema, "tokenBucket", name, options);
    this.#link = ctx.link;
    fusable(this, ctx.fusion);
    this.#capacity = o.capacity;
    this.#refill = o.refillPerSecond;
    this.#penaltyFactor = o.penalty ? (o.penalty.factor ?? DEFAULTS.tokenBucket.penalty.factor) : undefined;
    this.#keyed = o.keyed ?? false;
    this.callRule = bucketRule(this.#keyed);
    const settings = {
      capacity: o.capacity,
      refillPerSecond: o.refillPerSecond,
      recoveryMs: o.penalty?.recoveryMs ?? DEFAULTS.tokenBucket.penalty.recoveryMs,
      initial: o.initialTokens ?? o.capacity,
      penaltyFactor: this.#penaltyFactor,
      minFactor: o.penalty?.minFactor ?? DEFAULTS.tokenBucket.penalty.minFactor,
    };
    this.#scripts = new BucketScripts(this.name, ctx.link, ctx.prefix, settings, () => this.log);
    this.init(o.logger ?? ctx.logger);
  }

  protected isIdle(line: BucketLine): boolean {
    return line.size === 0;
  }

  /** `key`'s line, made when first asked for. */
  #line(key: string): BucketLine {
    let line = this.lines.get(key);
    if (!line) {
      const redisKey = this.#scripts.redisKey(key);
      line = new BucketLine(redisKey, new ScriptBatch((args) => this.#scripts.sendTakes(redisKey, args), 3));
      this.lines.set(key, line);
    }
    return line;
  }

  /**
   * Take `cost` for one caller, or reserve it when the caller waits up to `maxWaitMs` ("-1": as
   * long as it takes), with the key's other takes of this turn of the event loop, in one script
   * call that runs them in order.
   */
  #take(line: BucketLine, cost: number, grant: string, maxWaitMs: string): Promise<TakeReply> {
    return line.takes.run(String(cost), grant, maxWaitMs).catch((error: unknown) => {
      this.#scripts.takeFailed(line.redisKey, cost, grant, error);
      throw error;
    });
  }

  protected override newTicket(cost: number, key: string, now: number): BaseTicket {
    return new GrantTicket(this, cost, key, now);
  }

  protected override newWaiter(cost: number, key: string, now: number): Waiter {
    return new Reservation(this, cost, key, now);
  }

  /**
   * The largest cost one call can ever be admitted with: a larger one is refused at once with
   * `InvalidOptionsError`, and a Gate refuses it before it takes any stage.
   */
  override get maxCost(): number {
    return this.#capacity;
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const cost = o.cost ?? 1;
    const key = this.#keyed ? o.key! : UNKEYED;
    if (cost === 0) return Promise.resolve(this.issue(0, key, undefined, "token"));
    return this.#admit(key, cost, o);
  }

  /**
   * Take, or reserve and wait until the reservation is due. A wait longer than `timeoutMs` is
   * refused at once, with nothing reserved; one that would end past it once the reply is here
   * (the round trip counts) gives its reservation back and times out.
   */
  async #admit(key: string, cost: number, o: AdmitOptions): Promise<Ticket> {
    const startedAt = this.clock.now();
    const grant = this.#scripts.grantId();
    const timeoutMs = o.timeoutMs;
    const bounded = timeoutMs !== undefined && timeoutMs !== Number.POSITIVE_INFINITY;
    const reply = await this.#take(this.#line(key), cost, grant, bounded ? String(timeoutMs) : "-1");
    const taken = Number(reply[0]);
    const waitMs = Number(reply[1]);
    if (taken === 1) {
      if (o.signal?.aborted) {
        void this.#scripts.refund(key, cost, grant);
        throw o.signal.reason;
      }
      return this.#granted(cost, key, grant);
    }
    const reserved = taken === 2;
    const elapsed = this.clock.now() - startedAt;
    if (!reserved || this.closed || o.signal?.aborted || (bounded && elapsed + waitMs > timeoutMs)) {
      // Given back only while it is the key's latest; otherwise its place goes unused.
      if (reserved) void this.#scripts.refund(key, cost, grant);
      if (o.signal?.aborted) throw o.signal.reason;
      if (this.closed) throw this.closedSignal.reason;
      this.timedOut++;
      this.log.warn({ timeoutMs, retryAfterMs: waitMs }, "admission timed out");
      throw this.timeoutError(timeoutMs!, waitMs);
    }
    // The line of this key now (an idle one may have been swept while the take was out).
    const w = this.lineUpWaiter(
      this.#line(key),
      cost,
      key,
      o.signal ? { signal: o.signal } : {},
    ) as Reservation;
    w.enqueuedAt = startedAt;
    if (bounded) w.deadline = startedAt + timeoutMs;
    this.#place(w, grant, reply);
    return w.promise;
  }

  /** Reservation `w` has the place a take's `reply` gave it, as grant `grant`: it goes when due. */
  #place(w: Reservation, grant: string, reply: TakeReply): void {
    const now = this.clock.now();
    const waitMs = Number(reply[1]);
    w.grant = grant;
    w.fromAt = now + Number(reply[2]);
    w.dueAt = now + waitMs;
    w.timer = this.clock.setTimeout(() => this.#due(w), waitMs);
  }

  /**
   * A reservation's time has come: its caller goes. One woken too late (its process was frozen,
   * or its event loop held up) asks again instead, at the end of the line: its place's tokens
   * refilled while it did not come, and the bucket may have run full and thrown refill away while
   * the places after it were used, so going now could pass the cap. A place is kept that long:
   * until the bucket could have filled the room above its cost (then nothing was thrown away),
   * and at least `LATE_MS`, the lateness of a timer on a busy machine (see there for what that
   * may cost).
   */
  #due(w: Reservation): void {
    w.timer = undefined;
    if (!w.list) return;
    const late = this.clock.now() - w.dueAt;
    if (late > Math.max(LATE_MS, ((this.#capacity - w.cost) * 1000) / this.#refill)) {
      this.#again(w, late);
      return;
    }
    (this.grant(w, "token") as GrantTicket).grant = w.grant;
  }

  /** Ask again for reservation `w`, which came `late` ms after its place (see `#due`). */
  #again(w: Reservation, late: number): void {
    w.asking = true;
    this.log.warn(
      { key: w.key, lateMs: late },
      "a reserved caller came too late for its place; it asks again",
    );
    const line = this.#line(w.key);
    const grant = this.#scripts.grantId();
    const left = w.deadline - this.clock.now();
    const maxWait = w.deadline === Number.POSITIVE_INFINITY ? "-1" : String(Math.max(0, left));
    this.#take(line, w.cost, grant, maxWait).then(
      (reply) => {
        const taken = Number(reply[0]);
        if (!w.list) {
          // It left while the take was out: what was taken goes back (while the latest).
          if (taken !== 0) void this.#scripts.refund(w.key, w.cost, grant);
          return;
        }
        w.asking = false;
        if (taken === 1) {
          (this.grant(w, "token") as GrantTicket).grant = grant;
        } else if (taken === 2) {
          this.#place(w, grant, reply);
        } else {
          const timeoutMs = w.deadline - w.enqueuedAt;
          this.timedOut++;
          this.log.warn({ key: w.key, timeoutMs }, "admission timed out");
          this.failWaiter(w, this.timeoutError(timeoutMs, Number(reply[1])));
        }
      },
      (error: unknown) => {
        this.log.warn({ err: error, key: w.key }, "Redis unavailable; admission failed closed");
        this.failWaiter(w, error);
      },
    );
  }

  #granted(cost: number, key: string, grant: string): Ticket {
    if (this.closed) {
      void this.#scripts.refund(key, cost, grant);
      throw this.closedSignal.reason;
    }
    const ticket = this.issue(cost, key, undefined, "token") as GrantTicket;
    ticket.grant = grant;
    return ticket;
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const cost = o.cost ?? 1;
    const key = this.#keyed ? o.key! : UNKEYED;
    if (cost === 0) return Promise.resolve(this.issue(0, key, undefined, "token"));
    const grant = this.#scripts.grantId();
    return this.#take(this.#line(key), cost, grant, "0").then(([taken]) =>
      Number(taken) === 1 ? this.#granted(cost, key, grant) : undefined,
    );
  }

  protected override tryStepChecked(o: AdmitOptions, done: StepDone, name?: string): void {
    const cost = o.cost ?? 1;
    if (cost === 0) {
      super.tryStepChecked(o, done);
      return;
    }
    const key = this.#keyed ? o.key! : UNKEYED;
    // (A fused call's name is unique to its try, as a grant must be.)
    const grant = name ?? this.#scripts.grantId();
    const line = this.#line(key);
    this.#link.step(
      this.name,
      "token-bucket-take",
      line.keys,
      this.#scripts.takeArgs(cost, grant, "0"),
      (reply: TakeReply) =>
        answerWith(done, () => (Number(reply[0]) === 1 ? this.#granted(cost, key, grant) : undefined)),
      (error) => {
        this.#scripts.takeFailed(line.redisKey, cost, grant, error);
        done(undefined, error);
      },
      this.#scripts.lateTake,
    );
  }

  /**
   * A reserved caller gave up (abort, a signal that cannot be listened to). Its place goes to
   * this process's next reservation of the key, as a memory line's next waiter moves up: that
   * one goes as soon as the place holds its cost (a smaller cost, sooner: the place fills with
   * the refill up to its time), and its own place goes on to the next, in order, while each fits.
   * The last place left is given back to Redis, which takes it only while it is the key's latest
   * (see token-bucket-refund); otherwise it goes unused: at most one caller's tokens per caller
   * that gives up. Other processes' callers keep their places.
   */
  protected afterWaiterGone(list: WaitList, waiter: WaitEntry): void {
    const line = list as BucketLine;
    const gone = waiter as Reservation;
    // One asking again has no place now: what its take brings back is given back then.
    if (gone.asking) return;
    let place: Place = { cost: gone.cost, grant: gone.grant, fromAt: gone.fromAt, dueAt: gone.dueAt };
    const now: Reservation[] = [];
    for (let next = line.head as Reservation | null; next; next = next.next as Reservation | null) {
      if (next.seq < gone.seq) continue;
      if (next.asking) break;
      const own: Place = { cost: next.cost, grant: next.grant, fromAt: next.fromAt, dueAt: next.dueAt };
      if (!this.#moveTo(next, place)) break;
      if (next.dueAt <= this.clock.now()) now.push(next);
      place = own;
    }
    // Those whose new place holds their cost already go now (after the walk: going leaves the line).
    for (const w of now) {
      if (w.timer !== undefined) this.clock.clearTimeout(w.timer);
      this.#due(w);
    }
    void this.#scripts.refundAt(line.redisKey, place.cost, place.grant);
  }

  /**
   * Reservation `w` takes `place` if it can go sooner there: the place's cost is at least its own,
   * and it goes once the place holds its cost. False, `w` unchanged, when it cannot.
   */
  #moveTo(w: Reservation, place: Place): boolean {
    if (w.cost > place.cost) return false;
    // The refill from the place's beginning is its own: a place of cost c due at t holds at least
    // c - x tokens at t - x / rate, and whatever was left at its beginning. With a penalty the
    // rate may be lower, so then only at t.
    const early = this.#penaltyFactor === undefined ? ((place.cost - w.cost) * 1000) / this.#refill : 0;
    const now = this.clock.now();
    const dueAt = Math.max(now, place.fromAt, place.dueAt - early);
    if (dueAt >= w.dueAt) return false;
    w.dueAt = dueAt;
    if (w.timer !== undefined) this.clock.clearTimeout(w.timer);
    w.timer = this.clock.setTimeout(() => this.#due(w), dueAt - now);
    return true;
  }

  /**
   * Closing refuses the reserved callers. Only the last of a key's can be given back (and only
   * while it is the key's latest): the others' places go unused.
   */
  override close(): Promise<void> {
    if (!this.closed) {
      for (const line of this.lines.map.values()) {
        const last = line.tail as Reservation | null;
        if (last) void this.#scripts.refundAt(line.redisKey, last.cost, last.grant);
      }
    }
    return super.close();
  }

  releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): Promise<void> | undefined {
    const key = ticket.key;
    if (refund) {
      // A ticket admitted at cost 0 took nothing and is no grant. One settled down to 0 still
      // is: its refund ends its claim to be the key's latest, as in memory.
      const grant = (ticket as GrantTicket).grant;
      if (grant === "") return undefined;
      return this.#scripts.refund(key, ticket.cost, grant).then(() => undefined);
    }
    if (outcome === "dropped" && this.#penaltyFactor !== undefined) return this.#scripts.penalize(key);
    return undefined;
  }

  /** Re-price the ticket at `actual`: charge the difference, or give it back while still the latest. */
  override settleTicket(ticket: BaseTicket, actual: number): Promise<void> | undefined {
    const estimated = ticket.cost;
    if (actual === estimated) return undefined;
    ticket.cost = actual;
    return this.#scripts.settle(ticket.key, actual - estimated, (ticket as GrantTicket).grant);
  }
}
