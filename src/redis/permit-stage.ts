/**
 * The Redis permit stage: the acquire, grant and release protocol that the semaphore, the bounded
 * queue and the AIMD limiter share. Over 350 lines because its parts (the waiter line, the grant
 * messages, the lease hand-over) share one line and one lease keeper and are read together; the
 * lease renewal lives in lease.ts, the connection in link.ts, the batching in batch.ts.
 */
import { randomBytes } from "node:crypto";
import { type ClassBook, classRule, classSpec } from "../base/classes.js";
import { answerWith, BaseStage, type BaseTicket, type StepDone, type WaitFor } from "../base/stage.js";
import { Waiter, WaitList } from "../base/wait-list.js";
import { leaseLostChannel, shedChannel } from "../channels.js";
import type { ClockTimer } from "../clock.js";
import {
  type DrainingError,
  isFloodgateError,
  LeaseLostError,
  ReclaimedError,
  ShedError,
} from "../errors.js";
import { fusable } from "../fuse.js";
import type { AdmitOptions, Logger, Outcome, Snapshot, Ticket } from "../types.js";
import { ScriptBatch } from "./batch.js";
import type { RedisContext } from "./context.js";
import type { GateHead, Late } from "./gate-call.js";
import { stageKey } from "./keys.js";
import { LeaseKeeper, LeaseTicket } from "./lease.js";
import { askAgainWhileAway, askSoftlyAgain, askWanted, maybeSent, type RedisLink } from "./link.js";

/**
 * How many arguments `semaphore-acquire` takes before the pairs of a turn's other members
 * (`#acquireArgs`): the first member is at 1, its "again" flag at 9.
 */
const ACQUIRE_ARGS = 14;

/**
 * A grant message whose grant ends sooner than this (as judged here) is not taken on its word:
 * the waiter claims it in Redis first, so no ticket goes out whose first renewal could not land.
 */
const CLAIM_MARGIN_MS = 50;

/** A waiter with the id it is queued under in Redis. */
class RedisWaiter extends Waiter {
  id = "";
  busy = false;
  /** Asked for again while its ask was out: it asks once more when that ask is answered. */
  again = false;
  /** That ask's `softMs` (see `askWanted`): undefined when it is one of its own schedule. */
  againSoftMs: number | undefined = undefined;
  /** Has asked Redis before, so a release may have granted it already. */
  asked = false;
  /** Granted (by its own acquire or on someone's release). */
  granted = false;
  retry: ClockTimer | undefined = undefined;
  /** Its traffic class (index in the stage's book), or -1 on a stage without classes. */
  cls = -1;
}

/** Reply of `semaphore-acquire`. */
type AcquireReply = [
  granted: number,
  fenceOrWaitMs: number,
  used: number,
  limit: number,
  epoch: number,
  grants: string[],
  quarantineMs: number,
  now: number,
  /** On a stage with classes: the classes another process built it with, when they differ; else "". */
  elsewhere?: string,
  /** Admitted by a release of a fused gate: when the lease ends (server ms) until renewed (`now` is then not a time). */
  ends?: number,
];

/** Settings that make a permit stage a semaphore, a bounded queue or an AIMD limiter. */
export interface PermitSettings {
  /** Fixed limit, or undefined for the adaptive limit kept in Redis. */
  limit: number | undefined;
  initial: number;
  maxCost: number;
  leaseMs: number;
  /** A full house: wait in line, or refuse at once. */
  whenFull: "block" | "shed";
  logger: Logger | undefined;
  /** With classes: ask borrowed leases back for a waiting class below its guarantee (reclaim "signal"). */
  reclaim: boolean;
}

/**
 * Permits shared through Redis by every process that names the same stage. Leases live in a
 * sorted set scored by expiry and are reaped inside the acquire script, so a dead holder's
 * permits come back by themselves; a running holder renews its lease before it ends (see
 * `LeaseKeeper`).
 * Waiters line up in Redis in arrival order across processes. A release grants the freed permits
 * to the head of the line in its own script and tells each waiter's process through pub/sub (or
 * in its reply, for waiters of the releasing process); a timer at the nearest lease expiry covers
 * crashed holders, and a slow jittered poll covers a lost message (its acquire claims the grant).
 * A grant is judged by its end in the server's time before it becomes a ticket, and a ticket by
 * its lease's end on this process's clock whenever its signal is read, so a process that was
 * frozen never acts on a grant or a lease that ran out meanwhile. Waiters stay in line only while
 * their process gives a sign of life (`livenessMs`) and can be heard (someone listens on its
 * grant channel); a grant not claimed within `claimMs` comes back.
 *
 * With traffic classes, each member carries its class and the scripts keep a line per class and
 * what each class holds, and choose whom a free permit goes to by the same rule as in memory
 * (`floodgate_classes` in lua/prelude.lua, the twin of src/algorithms/classes.ts); a
 * class is written on its waiters and tickets as their `key`, as in memory.
 */
export abstract class RedisPermitStage extends BaseStage {
  protected override readonly waitsInLine = false;
  override readonly backend = "redis";
  protected readonly waiters = new WaitList();
  protected readonly waitFor: WaitFor = "permit";
  protected readonly link: RedisLink;
  protected readonly settings: PermitSettings;
  protected readonly keys: readonly string[];
  /** Base of the grant channels: a grant goes to `${channel}:${token}` of its waiter's process. */
  protected readonly channel: string;
  /**
   * Names this stage's members and its grant channel: random, so members never collide across
   * processes, and grants reach only the process whose waiter they are for.
   */
  readonly #token = randomBytes(8).toString("hex");
  #members = 0;
  protected limit: number;
  readonly #ctx: RedisContext;
  readonly #waits = this.#acquireBatch("wait");
  readonly #tries = this.#acquireBatch("try");
  readonly #byId = new Map<string, RedisWaiter>();
  #subscribed: Promise<void> | undefined;
  /** Highest fencing token seen: a sequence below it in Redis means Redis lost its data. */
  #lastFence = 0;
  #quarantined = false;
  /** The other classes last reported by an acquire (see `#saw`), so each is warned about once. */
  #elsewhere = "";
  #listening = false;
  /** Renews this stage's leases and gives its process's sign of life. */
  readonly #leases: LeaseKeeper;
  /** Tickets not yet released whose signal was handed out: closing the stage aborts them, as in memory. */
  readonly #signalled = new Set<LeaseTicket>();
  /** This process's tickets by lease, with reclaim "signal" only: a lease asked back is found here. */
  #held: Map<string, LeaseTicket> | undefined;

  /** Longest a grant made to a waiter on someone's release stays unclaimed: never past a lease. */
  protected readonly claimMs: number;

  /** The stage's classes, or undefined: one line for every call. */
  protected readonly book: ClassBook | undefined;
  /** The classes as the scripts take them (`classSpec`); "" without. */
  protected readonly classSpec: string;

  /**
   * The largest cost one call can ever be admitted with: a larger one is refused at once with
   * `InvalidOptionsError`, and a Gate refuses it before it takes any stage.
   */
  override get maxCost(): number {
    return this.settings.maxCost;
  }

  constructor(name: string, settings: PermitSettings, ctx: RedisContext, book?: ClassBook) {
    super(name, ctx.clock);
    this.book = book;
    // A Gate decides its stages in one call only without classes (their lines are per class).
    if (!book) fusable(this, ctx.fusion);
    this.classSpec = book && settings.reclaim ? `!${classSpec(book.configs)}` : classSpec(book?.configs);
    if (book && settings.reclaim) this.#held = new Map();
    if (book) this.callRule = classRule(book);
    this.claimMs = Math.min(ctx.claimMs, settings.leaseMs);
    this.#ctx = ctx;
    this.link = ctx.link;
    this.settings = settings;
    this.limit = settings.limit ?? settings.initial;
    const key = (part: string) => stageKey(ctx.prefix, name, part);
    this.keys = [key("holders"), key("queue"), key("qexp"), key("meta"), key("procs")];
    this.channel = key("wake");
    this.#leases = new LeaseKeeper({
      stage: name,
      link: ctx.link,
      clock: ctx.clock,
      log: () => this.log,
      keys: [this.keys[0]!, this.keys[4]!],
      leaseMs: settings.leaseMs,
      token: this.#token,
      livenessMs: ctx.livenessMs,
      waiting: () => this.waiters.size > 0 && !this.closed,
      lost: (t, cause) => this.#lost(t, cause),
    });
  }

  /** The names of the stage's classes, when it has them. */
  override get classes(): readonly string[] | undefined {
    return this.book?.names;
  }

  /** The class of a call that names none, when the stage has classes. */
  get defaultClass(): string | undefined {
    return this.book?.defaultClass;
  }

  /**
   * A lease or waiter member, `<token>-<n>:<cost>` (`<token>-<n>~<class>:<cost>` for class
   * index `cls` on a stage with classes): unique, naming the process's grant channel, and
   * carrying its cost and class so no side table is needed.
   */
  #memberId(cost: number, cls: number): string {
    const n = ++this.#members;
    return cls < 0 ? `${this.#token}-${n}:${cost}` : `${this.#token}-${n}~${cls}:${cost}`;
  }

  /** The class index of a call (checked already by the call rule), or -1 on a stage without classes. */
  #classOf(o: AdmitOptions, cost: number): number {
    return this.book === undefined ? -1 : this.book.indexOf(o, cost);
  }

  /** What a waiter or ticket of class `cls` carries as its key: the class's name ("" without). */
  #keyOf(cls: number): string {
    return cls < 0 ? "" : this.book!.names[cls]!;
  }

  /** A ticket of class `cls` that takes nothing (a cost of 0), so needs no lease. */
  #free(cls: number): Ticket {
    const ticket = this.issue(0, this.#keyOf(cls), undefined, this.waitFor);
    if (cls >= 0) this.book!.take(cls, 0);
    return ticket;
  }

  /** ARGV[4] of acquire: the fixed limit, or "" for the one kept in Redis. */
  #limitArg(): string | number {
    return this.settings.limit ?? "";
  }

  protected override newWaiter(cost: number, key: string, now: number): Waiter {
    return new RedisWaiter(this, cost, key, now);
  }

  protected override newTicket(cost: number, key: string, now: number): BaseTicket {
    return new LeaseTicket(this, cost, key, now);
  }

  /**
   * The ticket's signal. Read after the lease has ended on this process's clock (the process was
   * frozen, its renewals did not get through), it is already aborted with `LeaseLostError`, so
   * `fetch(url, { signal: ticket.signal })` never sends a call on a lease that ran out.
   */
  override ticketSignal(ticket: BaseTicket): AbortSignal {
    const t = ticket as LeaseTicket;
    if (!t.controller) {
      t.controller = new AbortController();
      if (this.closed) t.controller.abort(this.closedSignal.reason);
      else if (!t.released) this.#signalled.add(t);
    }
    if (this.#leases.ended(t)) this.#lost(t);
    else if (t.reclaimed && !t.controller.signal.aborted) t.controller.abort(this.#reclaimedError(t));
    return t.controller.signal;
  }

  #acquire(id: string, mode: "wait" | "try", again: boolean): Promise<AcquireReply> {
    return (mode === "wait" ? this.#waits : this.#tries).run(id, again ? "1" : "");
  }

  /** Acquires of one mode; a crowd of callers goes in one script call per turn. */
  #acquireBatch(mode: "wait" | "try"): ScriptBatch {
    return new ScriptBatch((pairs) =>
      this.link.run(this.name, "semaphore-acquire", this.keys, this.#acquireArgs(mode, pairs), this.#ranLate),
    );
  }

  /**
   * An acquire (a turn's, or a step of a fused gate's call) ran after it was failed for not
   * answering in time: its callers failed closed and gave back what it would take, which was not
   * there yet. Whatever it took for each of its members (a lease, a place in line) is given back
   * now, whatever it decided (a member that holds nothing frees nothing). `args` are the
   * acquire's own (`#acquireArgs`: the first member at 1, the others' pairs from ACQUIRE_ARGS on).
   */
  readonly #ranLate: Late = (_keys, args) => {
    this.#forget(String(args[1]));
    for (let i = ACQUIRE_ARGS; i < args.length; i += 2) this.#forget(String(args[i]));
  };

  /** ARGV of `semaphore-acquire` for members and their "again" flags, `[id1, again1, id2, …]`. */
  #acquireArgs(mode: "wait" | "try", pairs: readonly string[]): (string | number)[] {
    const args: (string | number)[] = [
      this.link.now(),
      pairs[0]!,
      this.#limitArg(),
      this.settings.leaseMs,
      mode,
      this.#ctx.pollMs * 3,
      this.channel,
      this.settings.limit === undefined ? this.settings.initial : "",
      this.#lastFence,
      pairs[1]!,
      this.#ctx.livenessMs,
      this.link.listeners,
      this.claimMs,
      this.classSpec,
    ];
    // (ACQUIRE_ARGS so far.)
    for (let i = 2; i < pairs.length; i++) args.push(pairs[i]!);
    return args;
  }

  /** Releases of leases; a crowd of them goes in one script call per turn. */
  readonly #releases = new ScriptBatch((pairs) =>
    this.link.run(this.name, "semaphore-release", this.keys, this.#releaseArgs(pairs)),
  );

  /** ARGV of `semaphore-release` for leases and what each is, `[id1, what1, id2, …]`. */
  #releaseArgs(pairs: readonly string[]): (string | number)[] {
    const args: (string | number)[] = [
      this.link.now(),
      pairs[0]!,
      this.#limitArg(),
      this.channel,
      pairs[1]!,
      this.claimMs,
      this.link.listeners,
      this.classSpec,
    ];
    for (let i = 2; i < pairs.length; i++) args.push(pairs[i]!);
    return args;
  }

  /**
   * Note what the reply of an acquire sent at `sentAt` says about the stage: its limit, the
   * newest fence, a quarantine, and the server's time.
   */
  #saw(reply: AcquireReply, sentAt: number): void {
    this.link.sawServerTime(Number(reply[7]), sentAt);
    this.limit = Number(reply[3]);
    this.sawUsed(reply[2], sentAt);
    const quarantineMs = Number(reply[6] ?? 0);
    if (quarantineMs > 0 && !this.#quarantined) {
      this.log.warn({ quarantineMs }, "Redis lost this stage's data; no grants until held leases have ended");
    }
    this.#quarantined = quarantineMs > 0;
    const elsewhere = reply[8];
    if (typeof elsewhere === "string" && elsewhere !== "" && elsewhere !== this.#elsewhere) {
      this.#elsewhere = elsewhere;
      this.log.warn(
        { theirs: elsewhere, ours: this.classSpec },
        "another process built this stage with other classes: grants follow the classes of the process that makes them; build it with the same classes, in the same order, everywhere",
      );
    }
    if (Number(reply[0]) === 1) this.#lastFence = Math.max(this.#lastFence, Number(reply[1]));
  }

  /** Give back lease or waiter `id` in the background (a lost reply, an abandoned wait). */
  #forget(id: string, waitedMs = 0): void {
    const sentAt = this.clock.now();
    this.link
      .run(this.name, "semaphore-release", this.keys, [
        this.link.now(),
        id,
        this.#limitArg(),
        this.channel,
        "any",
        this.claimMs,
        this.link.listeners,
        this.classSpec,
      ])
      .then(
        (reply) => {
          this.sawUsed(reply[2], sentAt);
          this.granted(reply[3], sentAt);
        },
        (error) => {
          // Redis is away (a dropped connection, a pause): ask again shortly, for as long as the
          // lease could still be held, so a lost reply does not keep a permit for a whole lease.
          const again = (waited: number) => this.#forget(id, waited);
          if (
            !askAgainWhileAway(this.clock, error, waitedMs, this.#ctx.pollMs, this.settings.leaseMs, again)
          ) {
            this.log.warn({ err: error, id }, "could not give back an abandoned lease; it expires");
          }
        },
      );
  }

  /**
   * A script granted permits to the waiters at the head of the line. Those waiting in this
   * process take them now rather than when the pub/sub message arrives (which then finds
   * nothing to do).
   */
  protected granted(grants: unknown, sentAt: number): void {
    if (!Array.isArray(grants)) return;
    for (const message of grants) this.#onGrant(message, sentAt);
  }

  /**
   * A grant announced as "<member>|<fence>|<epoch>|<ends>|<at>" (server ms). It ends here at
   * `ends` less the most the server's clock can be ahead of this process's: `at` less `sentAt`
   * for a grant in the reply of a call sent at `sentAt`, the link's latest such figure for a
   * pub/sub message (`sentAt` undefined). A grant that has ended by then (this process was
   * frozen, or the message came late) gives no ticket; one that ends too soon to be renewed in
   * time is claimed in Redis first. A member not waiting here (another process's, or one that
   * left: its give-back frees the grant) is ignored.
   */
  #onGrant(message: unknown, sentAt: number | undefined): void {
    if (typeof message !== "string") return;
    if (message.startsWith("reclaim|")) {
      this.#askedBack(message.slice(8));
      return;
    }
    const bar = message.indexOf("|");
    const w = bar < 0 ? undefined : this.#byId.get(message.slice(0, bar));
    if (!w?.list) return;
    const [, fence, epoch, ends, at] = message.split("|");
    const ahead = sentAt === undefined ? this.link.serverAhead : Number(at) - sentAt;
    const validUntil = ahead === undefined ? Number.NaN : Number(ends) - ahead;
    if (!(validUntil - this.clock.now() >= CLAIM_MARGIN_MS)) {
      // Ask Redis: it claims the grant if it still stands, or says the member is gone.
      this.#attempt(w);
      return;
    }
    this.#byId.delete(w.id);
    this.#clearRetry(w);
    w.granted = true;
    this.#lastFence = Math.max(this.#lastFence, Number(fence));
    this.#lease(this.grant(w, this.waitFor), Number(fence), Number(epoch), w.id, validUntil);
  }

  /** Lease `id` was asked back for a class below its guarantee: its ticket's signal aborts. */
  #askedBack(id: string): void {
    const t = this.#held?.get(id);
    if (!t || t.reclaimed) return;
    t.reclaimed = true;
    if (t.controller && !t.controller.signal.aborted) t.controller.abort(this.#reclaimedError(t));
  }

  #reclaimedError(t: LeaseTicket): ReclaimedError {
    return new ReclaimedError(
      this.name,
      `${this.kind} "${this.name}": a class below its guarantee waits for permits class "${t.key}" borrowed: wrap this call up and release its ticket`,
    );
  }

  #lease(ticket: BaseTicket, fence: number, epoch: number, id: string, validUntil: number): Ticket {
    const t = ticket as LeaseTicket;
    if (this.#held) {
      this.#held.set(id, t);
      // A holder hears that its lease is asked back on its grant channel: it listens from its
      // first lease on, waiting or not.
      if (!this.#listening) this.#listen().catch(() => {});
    }
    t.leaseId = id;
    t.fence = fence;
    t.epoch = epoch;
    if (this.book) this.book.takeNamed(t.key, t.cost);
    this.#leased.add(t);
    this.#leases.keep(t, validUntil);
    // A waiter that got its ticket may have been the last: no sign of life is needed then.
    this.#leases.quiet();
    return t;
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const cost = o.cost ?? 1;
    const cls = this.#classOf(o, cost);
    if (cost === 0) return Promise.resolve(this.#free(cls));
    if (this.settings.whenFull === "shed" || o.timeoutMs === 0) return this.#once(cost, cls, o);
    const w = this.lineUpWaiter(this.waiters, cost, this.#keyOf(cls), o);
    if (w instanceof Promise) return w;
    const waiter = w as RedisWaiter;
    waiter.cls = cls;
    waiter.id = this.#memberId(cost, cls);
    this.#byId.set(waiter.id, waiter);
    this.#attempt(waiter);
    return waiter.promise;
  }

  /** One try, no queueing: a shed, or `timeoutMs: 0`. */
  async #once(cost: number, cls: number, o: AdmitOptions): Promise<Ticket> {
    const ticket = await this.#tryOnce(cost, cls);
    if (ticket) return ticket;
    if (this.settings.whenFull === "shed") {
      this.shed++;
      this.log.warn({ maxSize: this.limit }, "queue full, shed");
      if (shedChannel.hasSubscribers) {
        shedChannel.publish({ stage: this.name, kind: this.kind, backend: this.backend, cost });
      }
      throw new ShedError(this.name, `${this.kind} "${this.name}": full (maxSize ${this.limit}), job shed`);
    }
    this.timedOut++;
    this.log.warn({ timeoutMs: o.timeoutMs }, "admission timed out");
    throw this.timeoutError(0);
  }

  async #tryOnce(cost: number, cls: number): Promise<Ticket | undefined> {
    const id = this.#memberId(cost, cls);
    let reply: AcquireReply;
    const sentAt = this.clock.now();
    try {
      reply = await this.#acquire(id, "try", false);
    } catch (error) {
      this.#tryFailed(id, error);
      throw error;
    }
    return this.#tried(reply, id, cost, cls, sentAt);
  }

  /** A try's acquire of `id` failed: one that may have run gives back what it took. */
  #tryFailed(id: string, error: unknown): void {
    if (isFloodgateError(error, "BACKEND_UNAVAILABLE") && maybeSent(error)) this.#forget(id);
  }

  /** The ticket a try's acquire of `id`, sent at `sentAt`, gave (undefined: refused); may throw. */
  #tried(reply: AcquireReply, id: string, cost: number, cls: number, sentAt: number): Ticket | undefined {
    this.#saw(reply, sentAt);
    this.granted(reply[5], sentAt);
    if (Number(reply[0]) !== 1) return undefined;
    if (this.closed) {
      this.#forget(id);
      throw this.closedSignal.reason;
    }
    // Admitted by a release of its fused gate (lua/gate.lua, grants): the lease ends at `ends`
    // (server ms) until renewed; judged as a grant message is, with what is known of the server's
    // clock. One that ends too soon to renew is given back, and the gate asks again.
    const ends = reply[9];
    let validUntil = sentAt + this.settings.leaseMs;
    if (ends !== undefined) {
      const ahead = this.link.serverAhead;
      validUntil = ahead === undefined ? Number.NaN : Number(ends) - ahead;
      if (!(validUntil - this.clock.now() >= CLAIM_MARGIN_MS)) {
        this.#forget(id);
        return undefined;
      }
    }
    const ticket = this.issue(cost, this.#keyOf(cls), undefined, this.waitFor);
    return this.#lease(ticket, Number(reply[1]), Number(reply[4]), id, validUntil);
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const cost = o.cost ?? 1;
    const cls = this.#classOf(o, cost);
    if (cost === 0) return Promise.resolve(this.#free(cls));
    return this.#tryOnce(cost, cls);
  }

  protected override tryStepChecked(o: AdmitOptions, done: StepDone, name?: string): void {
    const cost = o.cost ?? 1;
    if (cost === 0) {
      super.tryStepChecked(o, done);
      return;
    }
    const cls = this.#classOf(o, cost);
    // (A lease of one permit and no class takes the fused call's name, which carries no cost: a
    // member without ":<cost>" costs 1, lua/prelude.lua.)
    const id = name !== undefined && cost === 1 && cls < 0 ? name : this.#memberId(cost, cls);
    // (Read once for a fused gate's whole turn: no later than the call is sent.)
    const sentAt = this.time();
    this.link.step(
      this.name,
      "semaphore-acquire",
      this.keys,
      this.#acquireArgs("try", [id, ""]),
      (reply: AcquireReply) => answerWith(done, () => this.#tried(reply, id, cost, cls, sentAt)),
      (error) => {
        this.#tryFailed(id, error);
        done(undefined, error);
      },
      this.#ranLate,
    );
  }

  /**
   * Ask Redis for `w`'s permits; on refusal, sleep until woken, the nearest expiry, or the poll.
   * `softMs`, for an ask the waiter did not need by its own schedule (its process heard again after
   * its pub/sub connection was lost, see `#askAgain`, or just began to listen), is how long such
   * asks have failed for: Redis away again then fails nothing, as it would not have at the
   * waiter's own ask; it asks again shortly, for up to a poll, and then fails closed as that ask
   * would have.
   */
  #attempt(w: RedisWaiter, softMs?: number): void {
    if (w.busy) {
      w.againSoftMs = askWanted(w.again, w.againSoftMs, softMs);
      w.again = true;
      return;
    }
    w.busy = true;
    w.again = false;
    this.#clearRetry(w);
    const again = w.asked;
    w.asked = true;
    const id = w.id;
    const sentAt = this.clock.now();
    this.#acquire(id, "wait", again).then(
      (reply) => {
        w.busy = false;
        this.#saw(reply, sentAt);
        const granted = Number(reply[0]);
        if (!w.list) {
          // Aborted, timed out or closed while the call was out: give back the lease it got, or
          // its place in line (else it would hold up everyone behind it until it expires). A
          // waiter granted on a release meanwhile keeps its ticket; this reply only renewed it.
          if (!w.granted) this.#forget(id);
          this.granted(reply[5], sentAt);
          return;
        }
        if (granted === 1) {
          this.#byId.delete(id);
          w.granted = true;
          const ticket = this.grant(w, this.waitFor);
          this.#lease(ticket, Number(reply[1]), Number(reply[4]), id, sentAt + this.settings.leaseMs);
          this.granted(reply[5], sentAt);
          return;
        }
        this.granted(reply[5], sentAt);
        if (!w.list || w.busy) return;
        if (granted === -1) {
          // Its grant ended unclaimed, or it left the line while this process was silent: it
          // lines up again as a new member, so no member is ever granted twice.
          this.#byId.delete(id);
          w.id = this.#memberId(w.cost, w.cls);
          this.#byId.set(w.id, w);
          w.asked = false;
          return this.#attempt(w);
        }
        // In line in Redis (the acquire gave a sign of life): from now on the process must keep
        // giving them.
        this.markWaiting(w);
        this.#leases.keepAlive(sentAt);
        if (w.again) return this.#attempt(w, w.againSoftMs);
        if (!this.#listening) {
          // A grant published before this process listened is lost: ask again once it listens,
          // an ask of the process's choosing (soft: see `#attempt`).
          this.#listen().then(
            () => w.list && this.#attempt(w, 0),
            () => this.#sleep(w, Number(reply[1])),
          );
          return;
        }
        this.#sleep(w, Number(reply[1]));
      },
      (error: unknown) => {
        w.busy = false;
        // (Still in line under its id, should the acquire have run: its next ask finds its place,
        // or the grant made to it.)
        const again = (softMs: number) => w.list !== undefined && this.#attempt(w, softMs);
        if (w.list && askSoftlyAgain(this.clock, error, softMs, this.#ctx.pollMs, again)) return;
        this.#byId.delete(id);
        // The acquire may still run once Redis answers: give back whatever it would take.
        if (maybeSent(error)) this.#forget(id);
        if (!w.list) return;
        this.log.warn({ err: error }, "Redis unavailable; admission failed closed");
        this.failWaiter(w, error);
        this.#leases.quiet();
      },
    );
  }

  #listen(): Promise<void> {
    this.#subscribed ??= this.link
      .listen(
        `${this.channel}:${this.#token}`,
        (message) => this.#onGrant(message, undefined),
        () => this.#askAgain(),
      )
      .then(
        () => {
          this.#listening = true;
        },
        (error: unknown) => {
          this.#subscribed = undefined;
          this.log.warn({ err: error }, "could not subscribe for wake-ups; waiters poll");
          throw error;
        },
      );
    return this.#subscribed;
  }

  /**
   * The stage's channel is heard again after its pub/sub connection was lost: a grant sent
   * meanwhile was lost, or a release passed a waiter over while nobody listened for it. Each
   * waiter of this process asks again now, rather than sleep until its poll.
   */
  #askAgain(): void {
    for (const w of [...this.#byId.values()]) if (w.list) this.#attempt(w, 0);
  }

  /** Sleep until the nearest lease expiry (a crashed holder) or a jittered poll, whichever is first. */
  #sleep(w: RedisWaiter, expiryMs: number): void {
    const poll = this.#ctx.pollMs * (0.5 + this.#ctx.random());
    const ms = expiryMs >= 0 ? Math.min(expiryMs + 1, poll) : poll;
    w.retry = this.clock.setTimeout(() => {
      w.retry = undefined;
      if (w.list) this.#attempt(w);
    }, ms);
  }

  #clearRetry(w: RedisWaiter): void {
    if (w.retry !== undefined) {
      this.clock.clearTimeout(w.retry);
      w.retry = undefined;
    }
  }

  protected afterWaiterGone(_list: WaitList, waiter: Waiter): void {
    const w = waiter as RedisWaiter;
    this.#clearRetry(w);
    this.#byId.delete(w.id);
    // Given back now, on the connection of any acquire still out, so after it in Redis: a
    // release in between must not grant the place of a caller that is gone, nor this process's
    // next call find it held until that acquire's reply is read. (That reply gives back again,
    // in case the acquire ran after all, a resend after NOSCRIPT or a redirection.)
    this.#forget(w.id);
    this.#leases.quiet();
  }

  protected lists(): Iterable<WaitList> {
    return [this.waiters];
  }

  /** The ticket's lease ran out before its release: abort its signal, once, and count it. */
  #lost(t: LeaseTicket, cause?: unknown): void {
    if (t.lost) return;
    t.lost = true;
    this.leasesLost++;
    this.log.warn({ lease: t.leaseId, fence: t.fence }, "lease lost");
    if (leaseLostChannel.hasSubscribers) {
      leaseLostChannel.publish({
        stage: this.name,
        kind: this.kind,
        backend: this.backend,
        leaseId: t.leaseId,
      });
    }
    this.ticketSignal(t);
    t.controller!.abort(
      new LeaseLostError(
        this.name,
        `${this.kind} "${this.name}": lease ${t.leaseId} ran out before release`,
        { cause },
      ),
    );
  }

  releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): Promise<void> | undefined {
    const t = ticket as LeaseTicket;
    if (!this.#unkeep(t)) return undefined;
    const by = this.link.gatheringFor;
    return this.giveBack(t, outcome, refund).then(
      (released) => this.#gaveBack(t, released, refund, by),
      (error: unknown) => this.#giveBackFailed(t, error),
    );
  }

  override releaseStep(
    ticket: BaseTicket,
    outcome: Outcome,
    refund: boolean,
    done: (error?: unknown) => void,
  ): void {
    const t = ticket as LeaseTicket;
    if (!this.#unkeep(t)) {
      done();
      return;
    }
    const by = this.link.gatheringFor;
    this.giveBackStep(
      t,
      outcome,
      refund,
      (released) => {
        this.#gaveBack(t, released, refund, by);
        done();
      },
      (error) => {
        this.#giveBackFailed(t, error);
        done();
      },
    );
  }

  /** Stop keeping `t`'s lease here; false when it holds none in Redis (nothing to give back). */
  #unkeep(t: LeaseTicket): boolean {
    this.#leases.drop(t);
    this.#leased.delete(t);
    this.#held?.delete(t.leaseId);
    this.#signalled.delete(t);
    this.book?.giveBack(t.key, t.cost);
    return t.cost !== 0 && t.leaseId !== "";
  }

  /** `t`'s lease was given back (`released`: it was still held), through the fused gate of `by`. */
  #gaveBack(t: LeaseTicket, released: boolean, refund: boolean, by: GateHead | undefined): void {
    if (released && by !== undefined) this.#freed(by);
    if (!released && !refund) this.log.warn({ lease: t.leaseId }, "lease had run out before release");
  }

  #giveBackFailed(t: LeaseTicket, error: unknown): void {
    // Redis unavailable (not answering, or refusing the script): the give-back may not have run,
    // and goes again. Any other failure came with Redis's reply (the give-back ran): nothing to
    // try again.
    const again = isFloodgateError(error, "BACKEND_UNAVAILABLE");
    const msg = again ? "release failed; trying again while the lease lasts" : "release failed";
    this.log.warn({ err: error, lease: t.leaseId }, msg);
    if (again) this.#forget(t.leaseId);
  }

  /** Told when a release through a fused gate frees permits here (see `onFreed`): who each is. */
  readonly #freedListeners = new Map<(by: GateHead) => void, string>();

  /**
   * Call `listener` whenever a release of this process through a fused gate frees permits here,
   * with the head of that gate's script call. A fused gate's callers wait in its permit line,
   * which only a release through that gate looks at: another gate sharing the stage is told this
   * way in this process, and on `freedChannel` in the others. `from` names the listening gate as
   * lua/gate.lua names a gate that frees permits ("<wake channel>|<token>", as on the wire).
   * Returns the way to stop. @internal
   */
  onFreed(listener: (by: GateHead) => void, from: string): () => void {
    this.#freedListeners.set(listener, from);
    return () => this.#freedListeners.delete(listener);
  }

  /**
   * Whether the gate named `from` (see `onFreed`) tells this process's gates of the permits it
   * frees here itself: then what `freedChannel` says of them was told already. @internal
   */
  toldHere(from: string): boolean {
    for (const f of this.#freedListeners.values()) if (f === from) return true;
    return false;
  }

  /**
   * The channel where permits freed here are said (in any process): by this stage's scripts run
   * alone, and by a release through a fused gate while another gate's callers wait here
   * (lua/prelude.lua, floodgate_freed). A fused gate's first waiter listens there (see
   * `onFreed`). @internal
   */
  get freedChannel(): string {
    return `${this.channel}:freed`;
  }

  #freed(by: GateHead): void {
    for (const listener of this.#freedListeners.keys()) listener(by);
  }

  /** Run the release script; resolves true when the lease was still held. */
  protected async giveBack(t: LeaseTicket, _outcome: Outcome, _refund: boolean): Promise<boolean> {
    const sentAt = this.clock.now();
    return this.#released(await this.#releases.run(t.leaseId, "lease"), sentAt);
  }

  /**
   * `giveBack`, told to `released` or `failed` rather than by a promise (see `releaseStep`): its
   * script call is a step of the fused gate's call.
   */
  protected giveBackStep(
    t: LeaseTicket,
    _outcome: Outcome,
    _refund: boolean,
    released: (held: boolean) => void,
    failed: (error: unknown) => void,
  ): void {
    const sentAt = this.time();
    this.link.step(
      this.name,
      "semaphore-release",
      this.keys,
      this.#releaseArgs([t.leaseId, "lease"]),
      (reply: unknown[]) => released(this.#released(reply, sentAt)),
      failed,
    );
  }

  /** What a release's reply, sent at `sentAt`, says: true when the lease was still held. */
  #released(reply: unknown[], sentAt: number): boolean {
    this.sawUsed(reply[2], sentAt);
    this.granted(reply[3], sentAt);
    return Number(reply[0]) === 1;
  }

  protected override abortTickets(reason: DrainingError): void {
    for (const t of this.#signalled) t.controller!.abort(reason);
  }

  /** Tickets with a lease in Redis not yet released: a drain releases them when its grace runs out. */
  readonly #leased = new Set<LeaseTicket>();

  protected override async releaseAll(): Promise<void> {
    const held = [...this.#leased];
    await Promise.allSettled(held.map((t) => this.releaseTicket(t, "ignored", false)));
  }

  protected override onClose(): void {
    for (const t of this.#signalled) t.controller!.abort(this.closedSignal.reason);
    this.#signalled.clear();
    this.#leases.quiet();
    for (const w of this.#byId.values()) {
      this.#clearRetry(w);
      this.#forget(w.id);
    }
    this.#byId.clear();
  }

  /**
   * Figures of this process, as in memory; with classes, each class's too (what this process's
   * calls of it hold and wait for, against the fleet-wide guarantee at the limit last seen).
   */
  /** The permits held across the fleet, as the last reply said, and when it came. */
  #fleetUsed = Number.NaN;
  #fleetSeenAt = Number.NaN;

  /** Note the permits held across the fleet, as the reply to a call sent at `sentAt` says. */
  protected sawUsed(used: unknown, sentAt: number): void {
    const n = Number(used);
    if (!Number.isFinite(n)) return;
    this.#fleetUsed = n;
    this.#fleetSeenAt = sentAt;
  }

  protected override baseSnapshot(limit: number): Snapshot {
    const snap = super.baseSnapshot(limit);
    if (!Number.isNaN(this.#fleetSeenAt)) {
      snap.fleet = {
        inFlight: this.#fleetUsed,
        limit,
        ageMs: Math.max(0, this.clock.now() - this.#fleetSeenAt),
      };
    }
    return snap;
  }

  snapshot(): Snapshot {
    const snap = this.baseSnapshot(this.limit);
    if (this.book) {
      const waiting = this.book.names.map(() => 0);
      for (let w = this.waiters.head as RedisWaiter | null; w; w = w.next as RedisWaiter | null) {
        if (w.cls >= 0) waiting[w.cls]!++;
      }
      snap.classes = this.book.snapshot(this.limit, (i) => waiting[i]!);
    }
    return snap;
  }
}
