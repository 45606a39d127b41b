/**
 * The Redis token bucket with traffic classes (described at `RedisClassBucket`). Over 350 lines
 * because a key's lines per class, the grants its callers are told and the asking again that is
 * also the process's sign of life share one line state per key; the class rule is
 * src/algorithms/bucket-classes.ts, and its twin in Redis lua/token-bucket-classes.lua.
 */
import { randomBytes } from "node:crypto";
import { type BucketShares, bucketShares } from "../algorithms/bucket-classes.js";
import { type ClassBook, classBook, classRule } from "../base/classes.js";
import { KeyedLineStage, TimedLine } from "../base/line-stage.js";
import { BaseTicket } from "../base/stage.js";
import { type WaitEntry, Waiter, type WaitList } from "../base/wait-list.js";
import { bothRules, bucketRule, UNKEYED } from "../call-rule.js";
import type { ClockTimer } from "../clock.js";
import { DEFAULTS } from "../defaults.js";
import type { TokenBucketOptions } from "../options.js";
import type { AdmitOptions, ClassSnapshot, Outcome, Snapshot, StageKind, Ticket } from "../types.js";
import { parseOptions, tokenBucketSchema } from "../validate.js";
import type { RedisContext } from "./context.js";
import type { Late } from "./gate-call.js";
import { stageKey } from "./keys.js";
import { askSoftlyAgain, askWanted, maybeSent, type RedisLink } from "./link.js";
import { LATE_MS } from "./token-bucket.js";

/** A ticket of a class, with its grant (its member), so a refund can tell whether it is the latest. */
class ClassTicket extends BaseTicket {
  cls = -1;
  grant = "";
}

/** A caller in its class's line in Redis, under the member `id`. */
class ClassWaiter extends Waiter {
  id = "";
  cls = 0;
  /** An ask of it is out. */
  busy = false;
  /** Ask again once the one out is back. */
  again = false;
  /** That ask's `softMs` (see `askWanted`): undefined when it is one of its own schedule. */
  againSoftMs: number | undefined = undefined;
  /** Has asked Redis before, so it may have been granted meanwhile. */
  asked = false;
  /** Granted (by an ask, or by a message while an ask was out). */
  granted = false;
  /** Its slow poll: a sign of life, and a grant message lost. */
  poll: ClockTimer | undefined = undefined;
}

/** This process's callers of one key, all classes, in arrival order, and the key's Redis keys. */
class KeyLine extends TimedLine {
  /** When the line asks Redis next (the stage's clock), while `timer` is set. */
  tickAt = Number.POSITIVE_INFINITY;
  constructor(readonly redisKeys: readonly string[]) {
    super();
  }
}

/** The reply of `token-bucket-classes`: see there. */
type Reply = [status: number, waitMs: number, grants: string[], now: number, tick: number];

/**
 * `redis(...).tokenBucket(name, { classes })`: a token bucket whose refill and capacity are
 * divided among traffic classes, fleet-wide. Each key's callers stand in one line per class in
 * Redis, first in, first out across processes, and every script call grants, at that instant of
 * server time, each head the class rule lets go (`lua/token-bucket-classes.lua`, the twin of
 * src/algorithms/bucket-classes.ts): grants to callers of other processes go out by pub/sub.
 * Nothing is reserved ahead, so a class that comes back is served by the rule as it stands then.
 * The process whose caller stands first asks again when the reply says the decision may change
 * (the bucket holds the next head's cost, a class becomes owed, a ceiling clears), with one of
 * its callers; a call from another process that finds it first tells it so with a hint. Each
 * caller also asks on a slow poll, which is its process's sign of life and covers a lost message.
 * docs/classes.md says what differs from memory.
 */
export class RedisClassBucket extends KeyedLineStage<KeyLine> {
  readonly kind: StageKind = "tokenBucket";
  protected override readonly waitsInLine = false;
  override readonly backend = "redis";
  readonly #link: RedisLink;
  readonly #ctx: RedisContext;
  readonly #capacity: number;
  readonly #refill: number;
  readonly #keyed: boolean;
  readonly #book: ClassBook;
  readonly #shares: BucketShares;
  readonly #penalty: string | undefined;
  /** ARGV[1..6] of every call after `now`, as sent. */
  readonly #fixed: readonly string[];
  readonly #procs: string;
  readonly #channel: string;
  /** Names this stage's members and its grant channel (random, so they never collide). */
  readonly #token = randomBytes(8).toString("hex");
  #members = 0;
  readonly #byId = new Map<string, ClassWaiter>();
  #subscribed: Promise<void> | undefined;
  #listening = false;

  constructor(name: string, options: TokenBucketOptions, ctx: RedisContext) {
    super(name, ctx.clock, 10_000);
    const o = parseOptions(tokenBucketSchema, "tokenBucket", name, options);
    this.#link = ctx.link;
    this.#ctx = ctx;
    this.#capacity = o.capacity;
    this.#refill = o.refillPerSecond;
    this.#keyed = o.keyed ?? false;
    const recoveryMs = o.penalty?.recoveryMs ?? DEFAULTS.tokenBucket.penalty.recoveryMs;
    this.#book = classBook("tokenBucket", name, o, o.capacity, o.capacity)!;
    this.#shares = bucketShares(
      { capacity: o.capacity, refillPerSecond: o.refillPerSecond, recoveryMs },
      this.#book.configs,
    );
    const s = this.#shares;
    const spec = this.#book.configs
      .map((c, i) =>
        [s.rate[i], s.capacity[i], s.ceiling[i], s.ceilingCapacity[i], s.kept[i], c.priority].join(","),
      )
      .join(";");
    this.#fixed = [
      String(o.capacity),
      String(o.refillPerSecond),
      String(recoveryMs),
      String(o.initialTokens ?? o.capacity),
      spec,
    ];
    if (o.penalty) {
      const factor = o.penalty.factor ?? DEFAULTS.tokenBucket.penalty.factor;
      this.#penalty = `${factor}:${o.penalty.minFactor ?? DEFAULTS.tokenBucket.penalty.minFactor}`;
    }
    this.#procs = stageKey(ctx.prefix, name, "cprocs");
    this.#channel = stageKey(ctx.prefix, name, "cwake");
    this.callRule = bothRules(bucketRule(this.#keyed), classRule(this.#book));
    this.init(o.logger ?? ctx.logger);
  }

  /** The names of the stage's classes. */
  override get classes(): readonly string[] {
    return this.#book.names;
  }

  /** The class of a call that names none, when set. */
  get defaultClass(): string | undefined {
    return this.#book.defaultClass;
  }

  /**
   * The largest cost one call can ever be admitted with: a larger one is refused at once with
   * `InvalidOptionsError`, and a Gate refuses it before it takes any stage.
   */
  override get maxCost(): number {
    return this.#capacity;
  }

  protected override newTicket(cost: number, key: string, now: number): BaseTicket {
    return new ClassTicket(this, cost, key, now);
  }

  protected override newWaiter(cost: number, key: string, now: number): Waiter {
    return new ClassWaiter(this, cost, key, now);
  }

  protected isIdle(line: KeyLine): boolean {
    return line.size === 0;
  }

  #line(key: string): KeyLine {
    let line = this.lines.get(key);
    if (!line) {
      const part = (p: string) => stageKey(this.#ctx.prefix, this.name, `${p}:${key}`);
      line = new KeyLine([part("cb"), part("cq"), part("cs"), part("cg"), this.#procs]);
      this.lines.set(key, line);
    }
    return line;
  }

  /** A member `<token>-<n>~<class>:<cost>`: unique, naming this process's grant channel, its class and cost. */
  #memberId(cost: number, cls: number): string {
    return `${this.#token}-${++this.#members}~${cls}:${cost}`;
  }

  /** Run `op` of the script on `key`'s bucket for `member`, with its argument. */
  #run(key: string, op: string, member: string, arg: string): Promise<Reply> {
    const args = [this.#link.now(), ...this.#fixed, op, member, arg];
    args.push(String(this.#ctx.livenessMs), this.#channel, String(LATE_MS), key);
    return this.#link.run(this.name, "token-bucket-classes", this.#line(key).redisKeys, args, this.#ranLate);
  }

  /**
   * A call the client ran after its caller failed closed (see `Late`): a try or an ask that
   * granted its member gives the tokens back while that grant is the key's latest, as the
   * caller's own refund would have; an ask that put its member in line (or saw it granted since)
   * takes it out, which gives back such a grant too. One function for every call: `args` are the
   * call's (its op at 6, its member at 7, its key last), and the member names its cost.
   */
  readonly #ranLate: Late = (_keys, args, reply) => {
    const op = args[6];
    if (op !== "wait" && op !== "try") return;
    const member = String(args[7]);
    const key = String(args[args.length - 1]);
    if (Array.isArray(reply) && Number(reply[0]) === 1) {
      void this.#giveBack(key, "refund", member, member.slice(member.lastIndexOf(":") + 1));
    } else if (op === "wait") void this.#giveBack(key, "leave", member, "");
  };

  /** A ticket of class `cls` that takes nothing (a cost of 0): it goes at once, the bucket untouched. */
  #free(key: string, cls: number): Ticket {
    const ticket = this.issue(0, key, undefined, "token") as ClassTicket;
    ticket.cls = cls;
    this.#book.take(cls, 0);
    return ticket;
  }

  /** A ticket for `member`, granted at once (no wait). */
  #issued(key: string, cost: number, cls: number, member: string): Ticket {
    const ticket = this.issue(cost, key, undefined, "token") as ClassTicket;
    ticket.cls = cls;
    ticket.grant = member;
    this.#book.take(cls, cost);
    return ticket;
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const cost = o.cost ?? 1;
    const key = this.#keyed ? o.key! : UNKEYED;
    const cls = this.#book.indexOf(o, cost);
    if (cost === 0) return Promise.resolve(this.#free(key, cls));
    if (o.timeoutMs === 0 && !o.signal?.aborted) {
      // One try: it goes now or times out, as in memory.
      return this.#tryOnce(key, cost, cls).then((ticket) => {
        if (ticket) return ticket;
        this.timedOut++;
        this.log.warn({ key, cost, timeoutMs: 0 }, "admission timed out");
        throw this.timeoutError(0);
      });
    }
    const w = this.lineUpWaiter(this.#line(key), cost, key, o);
    if (w instanceof Promise) return w;
    const waiter = w as ClassWaiter;
    waiter.cls = cls;
    waiter.id = this.#memberId(cost, cls);
    this.#byId.set(waiter.id, waiter);
    this.#ask(waiter);
    return waiter.promise;
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const cost = o.cost ?? 1;
    const key = this.#keyed ? o.key! : UNKEYED;
    const cls = this.#book.indexOf(o, cost);
    if (cost === 0) return Promise.resolve(this.#free(key, cls));
    return this.#tryOnce(key, cost, cls);
  }

  async #tryOnce(key: string, cost: number, cls: number): Promise<Ticket | undefined> {
    const member = this.#memberId(cost, cls);
    const sentAt = this.clock.now();
    let reply: Reply;
    try {
      reply = await this.#run(key, "try", member, "");
    } catch (error) {
      // The try may still run once Redis answers: the refund undoes it (when it is the latest).
      if (maybeSent(error)) void this.#giveBack(key, "refund", member, String(cost));
      throw error;
    }
    this.#link.sawServerTime(Number(reply[3]), sentAt);
    this.#grants(reply[2], sentAt);
    this.#next(key, reply);
    if (Number(reply[0]) !== 1) return undefined;
    if (this.closed) {
      void this.#giveBack(key, "refund", member, String(cost));
      throw this.closedSignal.reason;
    }
    return this.#issued(key, cost, cls, member);
  }

  /**
   * Ask Redis for `w`: it goes, or waits in its class's line until granted. `softMs`: an ask of
   * its process's choosing, failed for that long so far (see the permit stages' `#attempt`).
   */
  #ask(w: ClassWaiter, softMs?: number): void {
    if (w.busy) {
      w.againSoftMs = askWanted(w.again, w.againSoftMs, softMs);
      w.again = true;
      return;
    }
    w.busy = true;
    w.again = false;
    this.#clearPoll(w);
    const again = w.asked;
    w.asked = true;
    const id = w.id;
    const key = w.key;
    const sentAt = this.clock.now();
    this.#run(key, "wait", id, again ? "1" : "").then(
      (reply) => {
        w.busy = false;
        this.#link.sawServerTime(Number(reply[3]), sentAt);
        const status = Number(reply[0]);
        if (!w.list) {
          // It left while the call was out (and left the line then: see afterWaiterGone): give
          // back what the ask granted it, or leave once more, should the ask have run after that
          // leave. One granted by a message meanwhile keeps its ticket: this reply only found
          // that grant.
          if (w.granted) {
            this.#grants(reply[2], sentAt);
            return;
          }
          if (status === 1) void this.#giveBack(key, "refund", id, String(w.cost));
          else void this.#giveBack(key, "leave", id, "");
          this.#grants(reply[2], sentAt);
          return;
        }
        if (status === 1) {
          this.#grantWaiter(w);
          this.#grants(reply[2], sentAt);
          this.#next(key, reply);
          return;
        }
        this.#grants(reply[2], sentAt);
        this.#next(key, reply);
        if (!w.list) return;
        if (status === -1) {
          // Dropped while its process was silent, or its grant came too late: it lines up again
          // as a new member, at the back, so no member is granted twice.
          this.#byId.delete(id);
          w.id = this.#memberId(w.cost, w.cls);
          this.#byId.set(w.id, w);
          w.asked = false;
          this.#ask(w);
          return;
        }
        this.markWaiting(w);
        if (w.again) {
          this.#ask(w, w.againSoftMs);
          return;
        }
        if (!this.#listening) {
          // A grant published before this process listened is lost: ask again once it listens,
          // an ask of the process's choosing (soft: see `#ask`).
          this.#listen().then(
            () => w.list && this.#ask(w, 0),
            () => this.#sleep(w),
          );
          return;
        }
        this.#sleep(w);
      },
      (error: unknown) => {
        w.busy = false;
        const again = (softMs: number) => w.list !== undefined && this.#ask(w, softMs);
        if (w.list && askSoftlyAgain(this.clock, error, softMs, this.#ctx.pollMs, again)) return;
        this.#byId.delete(id);
        // The call may still run once Redis answers: leave the line (a grant comes back).
        if (maybeSent(error)) void this.#giveBack(key, "leave", id, "");
        if (!w.list) return;
        this.log.warn({ err: error, key }, "Redis unavailable; admission failed closed");
        this.failWaiter(w, error);
      },
    );
  }

  #listen(): Promise<void> {
    this.#subscribed ??= this.#link
      .listen(
        `${this.#channel}:${this.#token}`,
        (message) => this.#onGrant(message, undefined),
        // Heard again after the pub/sub connection was lost: a grant sent meanwhile was lost, so
        // each waiter of this process asks again now rather than sleep until its poll.
        () => {
          for (const w of [...this.#byId.values()]) if (w.list) this.#ask(w, 0);
        },
      )
      .then(
        () => {
          this.#listening = true;
        },
        (error: unknown) => {
          this.#subscribed = undefined;
          this.log.warn({ err: error }, "could not subscribe for grants; waiters poll");
          throw error;
        },
      );
    return this.#subscribed;
  }

  /** Its slow poll: a sign of life of this process, and a grant whose message was lost. */
  #sleep(w: ClassWaiter): void {
    const ms = this.#ctx.pollMs * (0.5 + this.#ctx.random());
    w.poll = this.clock.setTimeout(() => {
      w.poll = undefined;
      if (w.list) this.#ask(w);
    }, ms);
  }

  #clearPoll(w: ClassWaiter): void {
    if (w.poll !== undefined) {
      this.clock.clearTimeout(w.poll);
      w.poll = undefined;
    }
  }

  /**
   * After `reply`: the key's line asks again in its `waitMs` when the reply says this process is
   * the one to (see `#schedule`).
   */
  #next(key: string, reply: Reply): void {
    if (Number(reply[4]) === 1) this.#schedule(key, Number(reply[1]));
  }

  /** The key's line asks again in `waitMs` (-1: nobody waits), unless it will sooner. */
  #schedule(key: string, waitMs: number): void {
    if (!(waitMs >= 0)) return;
    const line = this.lines.get(key);
    if (!line || line.size === 0) return;
    const at = this.clock.now() + waitMs;
    if (line.timer !== undefined) {
      if (line.tickAt <= at) return;
      this.clock.clearTimeout(line.timer);
    }
    line.tickAt = at;
    line.timer = this.clock.setTimeout(() => {
      line.timer = undefined;
      line.tickAt = Number.POSITIVE_INFINITY;
      const head = line.head as ClassWaiter | null;
      if (head) this.#ask(head);
    }, waitMs);
  }

  /** Grants in a reply (`sentAt`: when its call went) or a message (`sentAt` undefined). */
  #grants(grants: unknown, sentAt: number | undefined): void {
    if (!Array.isArray(grants)) return;
    for (const message of grants) this.#onGrant(message, sentAt);
  }

  /**
   * A grant "<member>|<at>" (server ms). Its caller goes unless it comes later than a grant may
   * be taken (see `LATE_MS`), judged with the most the server's clock can be ahead of this
   * process's; then it asks Redis, which judges by its own clock. A member not waiting here is
   * ignored (one that left gives its grant back with its leave).
   */
  #onGrant(message: unknown, sentAt: number | undefined): void {
    if (typeof message !== "string") return;
    const bar = message.indexOf("|");
    if (message.startsWith("~")) {
      // A hint: this process's head stands first at that key; its line asks again then.
      if (bar > 0) this.#schedule(message.slice(bar + 1), Number(message.slice(1, bar)));
      return;
    }
    const w = bar < 0 ? undefined : this.#byId.get(message.slice(0, bar));
    if (!w?.list) return;
    const at = Number(message.slice(bar + 1));
    const ahead = sentAt === undefined ? this.#link.serverAhead : at - sentAt;
    const late = ahead === undefined ? Number.NaN : this.clock.now() - (at - ahead);
    if (!(late <= this.#lateMs(w.cost))) {
      this.#ask(w);
      return;
    }
    this.#grantWaiter(w);
  }

  /** How late a grant of `cost` may still be taken: as a reservation of the bucket without classes. */
  #lateMs(cost: number): number {
    return Math.max(LATE_MS, ((this.#capacity - cost) * 1000) / this.#refill);
  }

  #grantWaiter(w: ClassWaiter): void {
    w.granted = true;
    this.#byId.delete(w.id);
    this.#clearPoll(w);
    const ticket = this.grant(w, "token") as ClassTicket;
    ticket.cls = w.cls;
    ticket.grant = w.id;
    this.#book.take(w.cls, w.cost);
  }

  /** Run `op` (leave, refund, settle, penalize) in the background; its grants go out. */
  #giveBack(key: string, op: string, member: string, arg: string): Promise<Reply | undefined> {
    const sentAt = this.clock.now();
    return this.#run(key, op, member, arg).then(
      (reply) => {
        this.#grants(reply[2], sentAt);
        this.#next(key, reply);
        return reply;
      },
      (error: unknown) => {
        this.log.warn({ err: error, key }, `${op} failed`);
        return undefined;
      },
    );
  }

  protected afterWaiterGone(_list: WaitList, waiter: WaitEntry): void {
    const w = waiter as ClassWaiter;
    this.#clearPoll(w);
    this.#byId.delete(w.id);
    // It leaves the line now, on the connection of any ask still out, so after it in Redis: a
    // refund or refill in between must not grant the tokens to a caller that is gone, nor this
    // process's next try find them taken until that ask's reply is read. (That reply gives back
    // again what the ask itself granted, or leaves again, in case the ask ran after all.)
    void this.#giveBack(w.key, "leave", w.id, "");
  }

  releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): Promise<void> | undefined {
    const t = ticket as ClassTicket;
    if (t.cls >= 0) this.#book.giveBackAt(t.cls, t.cost);
    if (t.grant === "") return undefined;
    if (refund) return this.#giveBack(t.key, "refund", t.grant, String(t.cost)).then(() => undefined);
    if (outcome === "dropped" && this.#penalty !== undefined) {
      return this.#giveBack(t.key, "penalize", t.grant, this.#penalty).then((reply) => {
        if (reply)
          this.log.warn({ key: t.key, rateFactor: Number(reply[0]) / 1000 }, "key penalised after drop");
      });
    }
    return undefined;
  }

  /** Re-price the ticket at `actual`: charge the difference, or give it back while still the latest. */
  override settleTicket(ticket: BaseTicket, actual: number): Promise<void> | undefined {
    const t = ticket as ClassTicket;
    const estimated = t.cost;
    if (actual === estimated) return undefined;
    t.cost = actual;
    this.#book.reprice(t.cls, actual - estimated);
    if (t.grant === "") return undefined;
    return this.#giveBack(t.key, "settle", t.grant, String(actual - estimated)).then(() => undefined);
  }

  protected override onClose(): void {
    for (const w of this.#byId.values()) {
      this.#clearPoll(w);
      if (!w.busy) void this.#giveBack(w.key, "leave", w.id, "");
    }
    this.#byId.clear();
    super.onClose();
  }

  /**
   * Figures of this process, as in memory; each class's guarantee and ceiling are its share of
   * the refill (tokens per second), `kept` tokens, and what this process's calls of it hold and
   * wait for.
   */
  override snapshot(): Snapshot {
    const snap = super.snapshot();
    const book = this.#book;
    const shares = this.#shares;
    const waiting = book.names.map(() => 0);
    for (const line of this.lines.map.values()) {
      for (let w = line.head as ClassWaiter | null; w; w = w.next as ClassWaiter | null) waiting[w.cls]!++;
    }
    const classes: Record<string, ClassSnapshot> = {};
    book.names.forEach((name, i) => {
      classes[name] = {
        guarantee: shares.rate[i]!,
        ceiling: this.#refill * shares.ceiling[i]!,
        kept: shares.kept[i]!,
        priority: book.configs[i]!.priority,
        inFlight: book.calls[i]!,
        held: book.used[i]!,
        waiting: waiting[i]!,
        admitted: book.admitted[i]!,
      };
    });
    snap.classes = classes;
    return snap;
  }
}
