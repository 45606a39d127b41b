import { randomBytes } from "node:crypto";
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
import type { Late } from "./gate-call.js";
import { stageKey } from "./keys.js";
import { maybeSent, type RedisLink } from "./link.js";
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
 * A take's reply: 1 taken now; 2 reserved (go in `waitMs`, the place began `fromMs` from now); 0
 * refused (`waitMs` is above the caller's wait).
 */
type TakeReply = [taken: number, waitMs: number, fromMs?: number];

/**
 * How late (ms) a reserved caller may still take its place whatever its cost: a timer on a busy
 * machine fires a few milliseconds late, and a place lost for that goes unused. Going that late
 * can pass the cap by at most this long's refill, less the room the bucket has above the cost
 * (nothing for a bucket whose capacity holds the cost and 20 ms of refill). See `#due`.
 */
export const LATE_MS = 20;

const GRANT_PREFIX = `${randomBytes(6).toString("hex")}:`;
let grants = 0;

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
  readonly #prefix: string;
  readonly #capacity: number;
  readonly #refill: number;
  readonly #recoveryMs: number;
  readonly #initial: number;
  readonly #penaltyFactor: number | undefined;
  readonly #minFactor: number;
  readonly #keyed: boolean;
  /** ARGV[2..4] of every bucket script and the fresh key's tokens, as sent (ioredis sends `String(n)`). */
  readonly #capacityArg: string;
  readonly #refillArg: string;
  readonly #recoveryArg: string;
  readonly #initialArg: string;

  constructor(name: string, options: TokenBucketOptions, ctx: RedisContext) {
    super(name, ctx.clock, 10_000);
    const o = parseOptions(tokenBucketSchema, "tokenBucket", name, options);
    this.#link = ctx.link;
    this.#prefix = ctx.prefix;
    fusable(this, ctx.fusion);
    this.#capacity = o.capacity;
    this.#refill = o.refillPerSecond;
    this.#recoveryMs = o.penalty?.recoveryMs ?? DEFAULTS.tokenBucket.penalty.recoveryMs;
    this.#initial = o.initialTokens ?? o.capacity;
    this.#penaltyFactor = o.penalty ? (o.penalty.factor ?? DEFAULTS.tokenBucket.penalty.factor) : undefined;
    this.#minFactor = o.penalty?.minFactor ?? DEFAULTS.tokenBucket.penalty.minFactor;
    this.#keyed = o.keyed ?? false;
    this.callRule = bucketRule(this.#keyed);
    this.#capacityArg = String(this.#capacity);
    this.#refillArg = String(this.#refill);
    this.#recoveryArg = String(this.#recoveryMs);
    this.#initialArg = String(this.#initial);
    this.init(o.logger ?? ctx.logger);
  }

  /** The arguments of a take or a refund: now, the bucket's settings, `cost`, the fresh key's tokens, `grant`. */
  #args(cost: number | string, grant: string): string[] {
    return [
      this.#link.now(),
      this.#capacityArg,
      this.#refillArg,
      this.#recoveryArg,
      String(cost),
      this.#initialArg,
      grant,
    ];
  }

  /** ARGV of one `token-bucket-take`: `cost` for `grant`, waiting up to `maxWaitMs` ("0": not at all). */
  #takeArgs(cost: number | string, grant: string, maxWaitMs: string): string[] {
    const args = this.#args(cost, grant);
    args.push(maxWaitMs);
    return args;
  }

  protected isIdle(line: BucketLine): boolean {
    return line.size === 0;
  }

  /** `key`'s line, made when first asked for. */
  #line(key: string): BucketLine {
    let line = this.lines.get(key);
    if (!line) {
      const redisKey = stageKey(this.#prefix, this.name, `b:${key}`);
      line = new BucketLine(redisKey, new ScriptBatch((args) => this.#sendTakes(redisKey, args), 3));
      this.lines.set(key, line);
    }
    return line;
  }

  /** A fresh grant id: this process's random prefix and a counter. */
  #grantId(): string {
    return `${GRANT_PREFIX}${++grants}`;
  }

  /**
   * Take `cost` for one caller, or reserve it when the caller waits up to `maxWaitMs` ("-1": as
   * long as it takes), with the key's other takes of this turn of the event loop, in one script
   * call that runs them in order.
   */
  #take(line: BucketLine, cost: number, grant: string, maxWaitMs: string): Promise<TakeReply> {
    return line.takes.run(String(cost), grant, maxWaitMs).catch((error: unknown) => {
      this.#takeFailed(line, cost, grant, error);
      throw error;
    });
  }

  /**
   * A take failed: it may still run once Redis answers; the refund then undoes it (and does
   * nothing if it never ran, or if another grant came after it).
   */
  #takeFailed(line: BucketLine, cost: number, grant: string, error: unknown): void {
    if (maybeSent(error)) void this.#refundAt(line.redisKey, cost, grant);
  }

  /**
   * A take (alone, or a step of a fused gate's call) ran after it was failed for not answering in
   * time: its caller failed closed, and the refund it sent then ran first and gave back nothing.
   * The tokens it took (or the place it reserved) are given back now, while it is the key's
   * latest grant, as that refund would have. One function for every take: `keys` and `args` are
   * its own (`#takeArgs`: the cost at 4, the grant at 6).
   */
  readonly #lateTake: Late = (keys, args) => void this.#refundAt(keys[0]!, args[4]!, String(args[6]));

  /**
   * As `#lateTake`, for a turn's takes in one `token-bucket-take-many` (cost, grant, wait each,
   * from 5; three figures each in its reply, taken first). The turn's takes are one stretch of
   * the key's line: while the last that took or reserved anything is still the key's latest
   * grant, nothing was taken after any of them, so their tokens all go back in one refund of
   * their sum, as if each had been refunded in turn from the last. (Without a reply to say which
   * took, only the last take is refunded: a refund of one that took nothing would give too much.)
   */
  readonly #lateTakes: Late = (keys, args, reply) => {
    if (!Array.isArray(reply)) {
      void this.#refundAt(keys[0]!, args[args.length - 3]!, String(args[args.length - 2]));
      return;
    }
    let cost = 0;
    let grant: string | undefined;
    for (let i = 5, n = 0; i + 1 < args.length; i += 3, n++) {
      // (Taken, 1, or reserved, 2: anything else took nothing.)
      const flag = Number(reply[3 * n]);
      if (flag !== 1 && flag !== 2) continue;
      cost += Number(args[i]);
      grant = String(args[i + 1]);
    }
    if (grant !== undefined) void this.#refundAt(keys[0]!, cost, grant);
  };

  /** Send takes of `redisKey` (cost, grant, maxWaitMs each): one alone as a plain take, more in one call. */
  #sendTakes(redisKey: string, triples: string[]): Promise<unknown> {
    if (triples.length === 3) {
      return this.#link.run(
        this.name,
        "token-bucket-take",
        [redisKey],
        this.#takeArgs(triples[0]!, triples[1]!, triples[2]!),
        this.#lateTake,
      );
    }
    const args: string[] = [
      this.#link.now(),
      this.#capacityArg,
      this.#refillArg,
      this.#recoveryArg,
      this.#initialArg,
      ...triples,
    ];
    return this.#link
      .run(this.name, "token-bucket-take-many", [redisKey], args, this.#lateTakes)
      .then((replies: number[]) => {
        const each = new Array<TakeReply>(triples.length / 3);
        for (let i = 0; i < each.length; i++)
          each[i] = [replies[3 * i]!, replies[3 * i + 1]!, replies[3 * i + 2]!];
        return each;
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
    const grant = this.#grantId();
    const timeoutMs = o.timeoutMs;
    const bounded = timeoutMs !== undefined && timeoutMs !== Number.POSITIVE_INFINITY;
    const reply = await this.#take(this.#line(key), cost, grant, bounded ? String(timeoutMs) : "-1");
    const taken = Number(reply[0]);
    const waitMs = Number(reply[1]);
    if (taken === 1) {
      if (o.signal?.aborted) {
        void this.#refund(key, cost, grant);
        throw o.signal.reason;
      }
      return this.#granted(cost, key, grant);
    }
    const reserved = taken === 2;
    const elapsed = this.clock.now() - startedAt;
    if (!reserved || this.closed || o.signal?.aborted || (bounded && elapsed + waitMs > timeoutMs)) {
      // Given back only while it is the key's latest; otherwise its place goes unused.
      if (reserved) void this.#refund(key, cost, grant);
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
    const grant = this.#grantId();
    const left = w.deadline - this.clock.now();
    const maxWait = w.deadline === Number.POSITIVE_INFINITY ? "-1" : String(Math.max(0, left));
    this.#take(line, w.cost, grant, maxWait).then(
      (reply) => {
        const taken = Number(reply[0]);
        if (!w.list) {
          // It left while the take was out: what was taken goes back (while the latest).
          if (taken !== 0) void this.#refund(w.key, w.cost, grant);
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
      void this.#refund(key, cost, grant);
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
    const grant = this.#grantId();
    return this.#take(this.#line(key), cost, grant, "0").then(([taken]) =>
      Number(taken) === 1 ? this.#granted(cost, key, grant) : undefined,
    );
  }

  protected override tryStepChecked(o: AdmitOptions, done: StepDone): void {
    const cost = o.cost ?? 1;
    if (cost === 0) {
      super.tryStepChecked(o, done);
      return;
    }
    const key = this.#keyed ? o.key! : UNKEYED;
    const grant = this.#grantId();
    const line = this.#line(key);
    this.#link.step(
      this.name,
      "token-bucket-take",
      line.keys,
      this.#takeArgs(cost, grant, "0"),
      (reply: TakeReply) =>
        answerWith(done, () => (Number(reply[0]) === 1 ? this.#granted(cost, key, grant) : undefined)),
      (error) => {
        this.#takeFailed(line, cost, grant, error);
        done(undefined, error);
      },
      this.#lateTake,
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
    void this.#refundAt(line.redisKey, place.cost, place.grant);
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
        if (last) void this.#refundAt(line.redisKey, last.cost, last.grant);
      }
    }
    return super.close();
  }

  /** Give `cost` back for `grant` (a grant or a reservation), which Redis does only for the key's latest. */
  #refund(key: string, cost: number, grant: string): Promise<unknown> {
    return this.#refundAt(stageKey(this.#prefix, this.name, `b:${key}`), cost, grant);
  }

  #refundAt(redisKey: string, cost: number | string, grant: string): Promise<unknown> {
    return this.#link
      .run(this.name, "token-bucket-refund", [redisKey], this.#args(cost, grant))
      .catch((error) => this.log.warn({ err: error }, "refund failed"));
  }

  releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): Promise<void> | undefined {
    const key = ticket.key;
    if (refund) {
      // A ticket admitted at cost 0 took nothing and is no grant. One settled down to 0 still
      // is: its refund ends its claim to be the key's latest, as in memory.
      const grant = (ticket as GrantTicket).grant;
      if (grant === "") return undefined;
      return this.#refund(key, ticket.cost, grant).then(() => undefined);
    }
    if (outcome === "dropped" && this.#penaltyFactor !== undefined) {
      return this.#link
        .run(
          this.name,
          "token-bucket-penalize",
          [stageKey(this.#prefix, this.name, `b:${key}`)],
          [
            this.#link.now(),
            this.#capacity,
            this.#refill,
            this.#recoveryMs,
            this.#penaltyFactor,
            this.#minFactor,
            this.#initial,
          ],
        )
        .then(
          (factor) => this.log.warn({ key, rateFactor: Number(factor) / 1000 }, "key penalised after drop"),
          (error) => this.log.warn({ err: error, key }, "penalty failed"),
        );
    }
    return undefined;
  }

  /** Re-price the ticket at `actual`: charge the difference, or give it back while still the latest. */
  override settleTicket(ticket: BaseTicket, actual: number): Promise<void> | undefined {
    const estimated = ticket.cost;
    if (actual === estimated) return undefined;
    ticket.cost = actual;
    const key = ticket.key;
    return this.#link
      .run(
        this.name,
        "token-bucket-settle",
        [stageKey(this.#prefix, this.name, `b:${key}`)],
        [
          this.#link.now(),
          this.#capacity,
          this.#refill,
          this.#recoveryMs,
          actual - estimated,
          this.#initial,
          (ticket as GrantTicket).grant,
        ],
      )
      .then(() => undefined);
  }
}
