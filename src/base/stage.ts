/**
 * The base of every built-in stage: its ticket, its waiters and the paths they share (admission,
 * waiting with abort and timeout, release once, counters). Over 350 lines because those parts
 * share the stage's private state; the wait list itself is in wait-list.ts and `run` in run.ts.
 */
import { admitOptions, type Entry, fnError, tooCostly } from "../admit.js";
import { type CallRule, ONE_BUDGET } from "../call-rule.js";
import {
  admitChannel,
  type CallMessage,
  type GrantMessage,
  grantChannel,
  type ReleaseMessage,
  releaseChannel,
  waitChannel,
} from "../channels.js";
import type { Clock } from "../clock.js";
import { Drain, Drains, nothingDrained } from "../drain.js";
import { AdmitTimeoutError, ClosedError, DrainingError, InvalidOptionsError } from "../errors.js";
import { enabled, stageLogger } from "../logger.js";
import { HeldTicket } from "../ticket.js";
import type {
  AdmitOptions,
  DrainOptions,
  DrainResult,
  Logger,
  Outcome,
  RunOptions,
  Snapshot,
  Stage,
  StageKind,
  Ticket,
  TryAdmitOptions,
} from "../types.js";
import { messageOf } from "../validate.js";
import { noClasses } from "./classes.js";
import { Flow, turnTime } from "./flow.js";
import { callWith, RESOLVED } from "./run.js";
import { SignalWaits } from "./signal-waits.js";
import { WaitEntry, Waiter, type WaiterOwner, type WaitList } from "./wait-list.js";

/** A wait list of any kind of entry. */
type AnyList = WaitList<WaitEntry>;

/** How `tryStep` answers: the ticket, or undefined when refused; or, with `error`, why it failed. @internal */
export type StepDone = (ticket: Ticket | undefined, error?: unknown) => void;

/** Answer `done` with what `ticket()` gives, or with what it throws. @internal */
export function answerWith(done: StepDone, ticket: () => Ticket | undefined): void {
  let t: Ticket | undefined;
  try {
    t = ticket();
  } catch (error) {
    done(undefined, error);
    return;
  }
  done(t);
}

/** What a wait is for, which decides the snapshot counter it adds to. */
export type WaitFor = "token" | "permit" | "queue";

/** A ticket granted by a stage built on `BaseStage`. */
export class BaseTicket extends HeldTicket {
  declare readonly owner: BaseStage;
  declare readonly key: string;
  declare readonly admittedAt: number;

  constructor(owner: BaseStage, cost: number, key: string, admittedAt: number) {
    super(cost);
    this.owner = owner;
    this.key = key;
    this.admittedAt = admittedAt;
  }

  get stage(): string {
    return this.owner.name;
  }

  protected get ownerKind(): StageKind {
    return this.owner.kind;
  }

  get signal(): AbortSignal {
    return this.owner.ticketSignal(this);
  }

  protected giveBack(outcome: Outcome | undefined): Promise<void> {
    if (!this.owner.ticketDone(this, outcome !== undefined)) return RESOLVED;
    if (releaseChannel.hasSubscribers) this.owner.published(this, outcome);
    return this.owner.releaseTicket(this, outcome ?? "ignored", outcome === undefined) ?? RESOLVED;
  }

  protected override giveBackStep(outcome: Outcome | undefined, done: (error?: unknown) => void): void {
    if (!this.owner.ticketDone(this, outcome !== undefined)) {
      done();
      return;
    }
    if (releaseChannel.hasSubscribers) this.owner.published(this, outcome);
    this.owner.releaseStep(this, outcome ?? "ignored", outcome === undefined, done);
  }

  /**
   * Hands the stage's own number to `settleTicket`. Only a stage that prices by cost (a token
   * bucket) acts on it, and only such a stage changes `cost`: what a permit's release gives
   * back never moves.
   */
  protected override settleWith(value: number | Readonly<Record<string, number>>): Promise<void> {
    const n = typeof value === "number" ? value : value[this.owner.name];
    if (n === undefined) return RESOLVED;
    return this.owner.settleTicket(this, n) ?? RESOLVED;
  }
}

/**
 * A waiting call that goes on by itself once its wait is over: the entry holds what to do next
 * (call a function, admit the next stages of a gate), so no ticket promise and no suspended
 * function is kept per waiting call. `start` and `fail` run in the waiting caller's context.
 */
export abstract class RunWaiter<T> extends WaitEntry {
  resolve!: (w: RunWaiter<T>) => void;
  ticket: BaseTicket | undefined = undefined;
  error: unknown = undefined;

  deliver(ticket: Ticket): void {
    this.ticket = ticket as BaseTicket;
    this.resolve(this);
  }

  refuse(error: unknown): void {
    this.error = error;
    this.resolve(this);
  }

  /** The wait is over with `ticket`: go on; the result settles the caller's promise. */
  abstract start(ticket: BaseTicket): T | PromiseLike<T>;

  /** The wait ended with `error`: clean up, then throw (or reject with) it. */
  abstract fail(error: unknown): T | PromiseLike<T>;
}

/** A waiting `stage.run` call. */
class CallWaiter<T> extends RunWaiter<T> {
  // The owner's type narrowed, not redefined: see HeldTicket's constructor.
  declare readonly owner: BaseStage;

  constructor(
    owner: BaseStage,
    cost: number,
    key: string,
    enqueuedAt: number,
    readonly fn: (ticket: Ticket) => T | PromiseLike<T>,
    readonly classify: RunOptions<T>["classify"],
  ) {
    super(owner, cost, key, enqueuedAt);
  }

  start(ticket: BaseTicket): Promise<T> {
    return this.owner.callTicket(ticket, this.fn, this.classify);
  }

  fail(error: unknown): never {
    throw error;
  }
}

/** The resolve function of the promise `capture` was last handed to (no closure per waiter). */
let captured: ((value: never) => void) | undefined;
function capture(resolve: (value: never) => void): void {
  captured = resolve;
}

/** Runs in the waiting caller's context once its wait is over. */
function startCall<T>(w: RunWaiter<T>): T | PromiseLike<T> {
  return w.ticket === undefined ? w.fail(w.error) : w.start(w.ticket);
}

/** Told by a stage that it may now admit more, or (`closed`) that it has closed. */
export type StageWatcher = (stage: BaseStage, closed: boolean) => void;

/**
 * What every stage of both backends shares: counters, the local waiting machinery (FIFO lists,
 * abort, timeout, close), logging. Subclasses decide when a waiter can go and what a release
 * gives back; a Redis stage asks Redis, an in-memory one looks at its own numbers.
 */
export abstract class BaseStage implements Stage, WaiterOwner {
  abstract readonly kind: StageKind;
  readonly holds: "call" | "wait" = "call";
  /** Which backend built the stage, for logs and snapshots. */
  readonly backend: string = "memory";
  protected readonly clock: Clock;
  protected log!: Logger;
  protected closed = false;
  #closeController: AbortController | undefined;

  inFlight = 0;
  protected waiting = 0;
  protected admitted = 0;
  protected shed = 0;
  protected timedOut = 0;
  protected aborted = 0;
  protected tokenWaitMs = 0;
  protected permitWaitMs = 0;
  protected queueWaitMs = 0;
  /** Leases that ran out before their ticket was released; see `Snapshot.leasesLost`. */
  protected leasesLost = 0;

  constructor(
    readonly name: string,
    clock: Clock,
  ) {
    this.clock = clock;
    this.flow = new Flow(clock.now());
  }

  /** Little's law over the last window: see `Snapshot.flow`. */
  protected readonly flow: Flow;

  /** The clock's time, or the one a fused gate read from it for all its stages at once (`turn`). */
  protected time(): number {
    return turnTime(this.clock);
  }

  /** Call at the end of the subclass constructor, once `kind` is set. */
  protected init(logger: Logger | undefined): void {
    this.log = stageLogger(logger, this.name, this.kind, this.backend);
    this.#debug = enabled(this.log, "debug");
  }

  /** Whether grants are logged (debug), read once when the stage is built. */
  #debug = false;
  /** Waiters lined up so far: each one's `seq`. */
  #arrivals = 0;
  /** Its waiters' abort listeners: one per caller's signal (see `SignalWaits`). */
  readonly #signalWaits = new SignalWaits();

  /** Aborts when the stage closes; every ticket's `signal`. */
  get closedSignal(): AbortSignal {
    if (!this.#closeController) {
      this.#closeController = new AbortController();
      if (this.closed) this.#closeController.abort(new ClosedError(this.name));
    }
    return this.#closeController.signal;
  }

  admit(options?: AdmitOptions): Promise<Ticket> {
    let o: AdmitOptions;
    try {
      o = this.check(options, "admit");
    } catch (error) {
      return Promise.reject(error);
    }
    return this.admitChecked(o);
  }

  /** The stage's own admission, for options `check` has passed (not closed, not aborted, cost in bounds). */
  protected abstract admitChecked(o: AdmitOptions): Promise<Ticket>;
  tryAdmit(options?: TryAdmitOptions): Promise<Ticket | undefined> {
    try {
      return this.tryAdmitChecked(this.check(options, "tryAdmit"));
    } catch (error) {
      return Promise.reject(error);
    }
  }

  /** The stage's own `tryAdmit`, for options `check` has passed; it may throw (then it rejects). */
  protected abstract tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined>;

  /**
   * `tryAdmit` for a fused Redis gate, told to `done` rather than by a promise: at once when the
   * stage decides by itself (bad options, a cost of 0, callers of its own ahead), else when the
   * step it gathers into the gate's call is answered. `done` is called once. `name` is the fused
   * call's name for this try, unique to it: a stage whose step takes a name of its own (a lease,
   * a grant) takes this one when it can, so that a turn's calls differ in one name alone
   * (src/redis/gate-call.ts). @internal
   */
  tryStep(options: TryAdmitOptions | undefined, done: StepDone, name?: string): void {
    let o: AdmitOptions;
    try {
      o = this.check(options, "tryAdmit");
    } catch (error) {
      done(undefined, error);
      return;
    }
    this.tryStepChecked(o, done, name);
  }

  /**
   * The stage's own `tryStep`, for options `check` has passed; it must not throw. By default its
   * `tryAdmit`, whose promise tells `done`; a Redis stage gathers its step with no promise made.
   */
  protected tryStepChecked(o: AdmitOptions, done: StepDone, _name?: string): void {
    let admitted: Promise<Ticket | undefined>;
    try {
      admitted = this.tryAdmitChecked(o);
    } catch (error) {
      done(undefined, error);
      return;
    }
    admitted.then(
      (ticket) => done(ticket),
      (error: unknown) => done(undefined, error),
    );
  }
  abstract snapshot(): Snapshot;

  /**
   * See `Stage.admitNow`. Memory stages have it; `run` uses it too, to call `fn` without a
   * promise in between.
   */
  admitNow?(o: AdmitOptions, cost: number): BaseTicket | undefined;

  /**
   * For a `Gate` whose call must wait here: line `w` up (its `cost` set, for `timeoutMs`, which
   * the gate works out from its deadline) as `admit` would, and return the promise that settles
   * as `w` goes on. `undefined`, with nothing changed, when `admit` would not simply wait (a
   * closed stage, a bad cost, an aborted signal, `timeoutMs: 0`, a queue that sheds); the gate
   * then calls `admit`. Memory permit stages have it.
   */
  waitInGate?<T>(w: RunWaiter<T>, o: AdmitOptions, timeoutMs: number | undefined): Promise<T> | undefined;

  /**
   * For a fused memory Gate: 0 when `admitNow(o, cost)` would admit at this instant; else the
   * whole ms until it could (>= 1), or -1 when the call waits for permits to be freed. NaN for
   * options `admitNow` would not take (see `checkOptions`). Changes nothing that a call could
   * see. Throws `ClosedError` once the stage is closed. Memory stages that can be fused have it.
   * @internal
   */
  fuseProbe?(o: AdmitOptions, cost: number): number;

  /**
   * Throw what `admit` would reject `options` with (a bad option, a closed stage, an aborted
   * signal), or nothing.
   * @internal
   */
  checkOptions(options: AdmitOptions): void {
    this.check(options, "admit");
  }

  /** Fused gates told when the stage may now admit more (permits freed) or has closed. */
  #watchers: Set<StageWatcher> | undefined;

  /**
   * Tell `fn` whenever the stage may admit more than before (memory permit stages: permits
   * freed with nobody in their own line) and once when it closes, until `unwatch`.
   * @internal
   */
  watch(fn: StageWatcher): void {
    this.#watchers ??= new Set();
    this.#watchers.add(fn);
  }

  /** Stop telling `fn`. @internal */
  unwatch(fn: StageWatcher): void {
    this.#watchers?.delete(fn);
  }

  /** Tell the watchers (see `watch`). */
  protected notifyWatchers(closed = false): void {
    const watchers = this.#watchers;
    if (watchers === undefined || watchers.size === 0) return;
    for (const fn of [...watchers]) fn(this, closed);
  }

  /**
   * Admit, call `fn` with the ticket, release it with the call's outcome (the one recorded on the
   * ticket, else `classify`'s) and settle as `fn` does. When the stage admits at once, `fn` is
   * called before `run` returns; otherwise once the wait is over, in the caller's context.
   */
  run<T>(fn: (ticket: Ticket) => T | PromiseLike<T>, options?: RunOptions<T>): Promise<T> {
    const notFn = fnError(this.kind, this.name, fn);
    if (notFn) return Promise.reject(notFn);
    let o: RunOptions<T>;
    try {
      o = this.check(options) as RunOptions<T>;
    } catch (error) {
      return Promise.reject(error);
    }
    const classify = o.classify;
    const now = this.admitNow?.(o, o.cost ?? 1);
    if (now !== undefined) return callWith(now, fn, classify, this.log);
    return this.admit(o).then((ticket) => callWith(ticket as BaseTicket, fn, classify, this.log));
  }

  /** Give back what `ticket` holds. Called once per ticket; may finish asynchronously. */
  abstract releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): void | Promise<void>;

  /**
   * `releaseTicket`, told to `done` (with an error when it failed) rather than by a promise: a
   * Redis stage releasing through a fused gate gathers its step with no promise made. @internal
   */
  releaseStep(ticket: BaseTicket, outcome: Outcome, refund: boolean, done: (error?: unknown) => void): void {
    let given: void | Promise<void>;
    try {
      given = this.releaseTicket(ticket, outcome, refund);
    } catch (error) {
      done(error);
      return;
    }
    if (given === undefined) done();
    else given.then(() => done(), done);
  }

  /**
   * The call cost `actual` (checked) rather than the `ticket.cost` it was admitted with. Only
   * stages that price by cost (token buckets) act on it, and they alone set `ticket.cost` to it;
   * every other stage ignores it, so what its release gives back never changes.
   */
  settleTicket(_ticket: BaseTicket, _actual: number): void | Promise<void> {}

  /** The signal handed out as `ticket.signal`; aborts when the stage closes. */
  ticketSignal(_ticket: BaseTicket): AbortSignal {
    return this.closedSignal;
  }

  /** A waiter left its list without being granted; the ones behind it may now fit. */
  protected abstract afterWaiterGone(list: AnyList, waiter: WaitEntry): void;

  /** Every wait list the stage has, for `close()`. */
  protected abstract lists(): Iterable<AnyList>;

  /** Check admit options and the closed flag. Throws synchronously; callers turn it into a rejection. */
  protected check(options: AdmitOptions | undefined, entry: Entry = "run"): AdmitOptions {
    const o = admitOptions(this.kind, this.name, options, entry);
    if (this.closed) throw new ClosedError(this.name);
    if (this.#drains.current !== undefined) throw this.drainingError();
    // An aborted caller gets nothing, even where capacity is free.
    if (o.signal?.aborted) throw o.signal.reason;
    // A cost above what the stage can ever grant is refused at once, never waited on.
    const most = this.maxCost;
    if (most !== undefined && o.cost !== undefined && o.cost > most) {
      throw tooCostly(this.kind, this.name, o.cost, most);
    }
    if (o.class !== undefined && this.classes === undefined) throw noClasses(this.kind, this.name, o.class);
    this.callRule.check(this.name, o);
    return o;
  }

  /** The stage's traffic classes (see `Stage.classes`); none unless a stage has them. */
  get classes(): readonly string[] | undefined {
    return undefined;
  }

  /** What a call must name (a key, a host) for this stage; keyed stages set it. */
  protected callRule: CallRule = ONE_BUDGET;

  /** The call option the stage keeps separate budgets by (see `Stage.keyedBy`). */
  get keyedBy(): "key" | "host" | undefined {
    return this.callRule.keyedBy;
  }

  /**
   * The largest cost one call can ever be admitted with (see `Stage.maxCost`), or undefined for a
   * stage whose calls' cost is not bounded (an interval gate).
   */
  get maxCost(): number | undefined {
    return undefined;
  }

  /** The drain under way, once `drain` has begun. */
  readonly #drains = new Drains();

  /** Whether new calls are refused: the stage is closed or draining. */
  protected get refusing(): boolean {
    return this.closed || this.#drains.current !== undefined;
  }

  /** The error a new call gets while the stage drains. */
  protected drainingError(): DrainingError {
    return new DrainingError(this.name, `${this.kind} "${this.name}" is draining: it admits no new call`);
  }

  /** Throw what a new call gets from a stage that is closed or draining; nothing otherwise. */
  protected throwIfRefusing(): void {
    if (this.closed) throw new ClosedError(this.name);
    if (this.#drains.current !== undefined) throw this.drainingError();
  }

  /**
   * A ticket is being released: count it out of the calls in flight (and into a drain's).
   * False when the drain has released it already (nothing more to give back). @internal
   */
  ticketDone(ticket: BaseTicket, counted: boolean): boolean {
    const now = this.time();
    this.flow.advance(now, this.inFlight);
    if (!this.#drains.ticketDone(this)) return false;
    if (counted) this.flow.released(now, now - ticket.admittedAt);
    return true;
  }

  /**
   * Shut down gracefully (see `Stage.drain`): refuse new calls with `DrainingError` at once,
   * reject the waiting ones (or admit them as room frees, with `waiting: "admit"`), wait up to
   * `graceMs` for the calls in flight to release, then abort the rest through their `signal`,
   * release them (on Redis, their leases) and close. Resolves with what happened; a second call
   * gets the same promise. Rejects with `InvalidOptionsError` for bad options.
   */
  drain(options?: DrainOptions): Promise<DrainResult> {
    return this.#drains.start(this.kind, this.name, options, (graceMs, waiting) =>
      this.#drainNow(graceMs, waiting),
    );
  }

  async #drainNow(graceMs: number, waiting: "reject" | "admit"): Promise<DrainResult> {
    if (this.closed) return nothingDrained();
    const clock = this.clock;
    const start = clock.now();
    const d = new Drain(this.drainingError());
    this.#drains.current = d;
    const where = `${this.kind} "${this.name}"`;
    let rejected =
      waiting === "admit"
        ? 0
        : this.#refuseAll(new DrainingError(this.name, `${where} is draining: waiting calls are rejected`));
    this.log.warn({ graceMs, waiting, inFlight: this.inFlight }, "draining");
    await d.until(() => this.inFlight === 0 && this.waiting === 0, graceMs, clock);
    rejected += this.#refuseAll(
      new DrainingError(
        this.name,
        `${where} drained: the grace of ${graceMs} ms ran out before this call was admitted`,
      ),
    );
    const cut = new DrainingError(
      this.name,
      `${where} drained: the grace of ${graceMs} ms ran out before this call released its ticket`,
    );
    d.forcing = true;
    const aborted = this.inFlight;
    if (aborted > 0) {
      this.abortTickets(cut);
      this.#closeController ??= new AbortController();
      this.#closeController.abort(cut);
      this.#drains.releasedAll = true;
      this.inFlight = 0;
      await this.releaseAll();
    }
    await this.close();
    const result = { completed: d.completed, aborted, rejected, tookMs: clock.now() - start };
    this.log.warn(result, "drained");
    return result;
  }

  /**
   * Reject every waiting call with `error`: all are taken off their lines first, so none is
   * granted on the way; then each is refused and its line told (a Redis waiter leaves the line in
   * Redis). Returns how many.
   */
  #refuseAll(error: DrainingError): number {
    const gone: [AnyList, WaitEntry][] = [];
    for (const list of this.lists()) {
      for (let w = list.head; w; w = list.head) {
        this.unlink(w);
        gone.push([list, w]);
      }
    }
    for (const [list, w] of gone) {
      w.refuse(error);
      this.afterWaiterGone(list, w);
    }
    return gone.length;
  }

  /**
   * Abort the `signal` of tickets that have one of their own (not the stage's shared one) with
   * `reason`: a drain's grace ran out. Stages with such signals override it.
   */
  protected abortTickets(_reason: DrainingError): void {}

  /**
   * Give back what every ticket still held holds, as if each were released with `"ignored"`: a
   * drain's grace has run out (their holders' own releases then do nothing). Stages whose
   * tickets hold something (permits, leases) override it.
   */
  protected releaseAll(): void | Promise<void> {}

  /**
   * A granted ticket, counted. `waitedFrom` is when the caller started waiting, or `undefined`
   * when it did not wait. `now` is the time of the admission, when the stage has just read it to
   * decide (one clock read an admission: on a VM a read can cost a fifth of a memory take).
   */
  protected issue(
    cost: number,
    key: string,
    waitedFrom: number | undefined,
    waitFor: WaitFor,
    waited = waitedFrom !== undefined,
    now = this.time(),
  ): BaseTicket {
    const ticket = this.newTicket(cost, key, now);
    this.flow.advance(now, this.inFlight);
    this.inFlight++;
    this.admitted++;
    if (waitedFrom !== undefined && now > waitedFrom) this.addWait(waitFor, now - waitedFrom);
    if (!waited) {
      if (admitChannel.hasSubscribers) admitChannel.publish(this.callMessage(key, cost));
    } else if (grantChannel.hasSubscribers) {
      const m = this.callMessage(key, cost) as GrantMessage;
      m.waitedMs = now - waitedFrom!;
      grantChannel.publish(m);
    }
    if (this.#debug) this.log.debug({ key, cost, waitedMs: now - (waitedFrom ?? now) }, "granted");
    return ticket;
  }

  /**
   * Whether a call in the stage's own line waits (memory stages, and Redis token buckets, whose
   * callers line up once Redis has reserved their place); false where a call stands in the line
   * while Redis decides, and the stage says when it waits (`markWaiting`).
   */
  protected readonly waitsInLine: boolean = true;

  /** `w` waits: published once on `floodgate:wait`, and its grant on `floodgate:grant`. */
  protected markWaiting(w: WaitEntry): void {
    if (w.waited) return;
    w.waited = true;
    if (waitChannel.hasSubscribers) waitChannel.publish(this.callMessage(w.key, w.cost));
  }

  /** A message naming the stage and a call of `cost` under `key`, for a diagnostics channel. */
  protected callMessage(key: string, cost: number): CallMessage {
    return { stage: this.name, kind: this.kind, backend: this.backend, key, cost };
  }

  /** Publish `ticket`'s release on `floodgate:release` (there is a subscriber). @internal */
  published(ticket: BaseTicket, outcome: Outcome | undefined): void {
    const m = this.callMessage(ticket.key, ticket.cost) as ReleaseMessage;
    m.outcome = outcome ?? "refund";
    m.heldMs = this.clock.now() - ticket.admittedAt;
    releaseChannel.publish(m);
  }

  protected newTicket(cost: number, key: string, now: number): BaseTicket {
    return new BaseTicket(this, cost, key, now);
  }

  /**
   * A fused Gate's call waited `ms` because this stage refused it (it waited in no stage's line):
   * count it as this stage's own wait, for `waitFor`.
   * @internal
   */
  countWait(waitFor: WaitFor, ms: number): void {
    this.addWait(waitFor, ms);
  }

  private addWait(waitFor: WaitFor, ms: number): void {
    if (!(ms > 0)) return;
    this.flow.waited(ms);
    if (waitFor === "token") this.tokenWaitMs += ms;
    else if (waitFor === "permit") this.permitWaitMs += ms;
    else this.queueWaitMs += ms;
  }

  /**
   * Put a caller on `list` and return its promise. Wires `signal` and `timeoutMs`; `timeoutMs: 0`
   * rejects at once. `retryAfterMs` (when known) goes on the timeout error.
   */
  protected wait(list: WaitList, cost: number, key: string, o: AdmitOptions): Promise<Ticket> {
    const w = this.lineUpWaiter(list, cost, key, o);
    return w instanceof Promise ? w : w.promise;
  }

  /**
   * As `wait`, handing back the waiter now in line (its `promise` is the wait), or the rejection
   * of a wait that ends before it starts.
   */
  protected lineUpWaiter(
    list: WaitList,
    cost: number,
    key: string,
    o: AdmitOptions,
  ): Waiter | Promise<never> {
    const refused = this.refusal(cost, key, o);
    if (refused) return refused;
    const w = this.newWaiter(cost, key, this.clock.now());
    this.enter(list, w, o.signal, o.timeoutMs);
    return w;
  }

  /**
   * As `wait`, for `run`: once granted, `fn` is called with the ticket in the caller's context
   * and the ticket released after it. The entry holds the function itself: no ticket promise
   * and no suspended function per waiting call.
   */
  protected waitToRun<T>(
    list: AnyList,
    cost: number,
    key: string,
    o: RunOptions<T>,
    fn: (ticket: Ticket) => T | PromiseLike<T>,
  ): Promise<T> {
    const refused = this.refusal(cost, key, o);
    if (refused) return refused;
    const w = new CallWaiter<T>(this, cost, key, this.clock.now(), fn, o.classify);
    return this.lineUp(list, w, o.signal, o.timeoutMs);
  }

  /**
   * Put `w` on `list` (with `signal` and `timeoutMs`, which is not 0) and return the promise that
   * settles as `w` goes on once granted. The grant resolves an inner promise; the reaction
   * registered here, in the caller's context, goes on there.
   */
  protected lineUp<T>(
    list: AnyList,
    w: RunWaiter<T>,
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
  ): Promise<T> {
    const granted = new Promise<RunWaiter<T>>(capture);
    w.resolve = captured as (w: RunWaiter<T>) => void;
    captured = undefined;
    this.enter(list, w, signal, timeoutMs);
    return granted.then(startCall) as Promise<T>;
  }

  /** A wait that ends before it starts: an aborted signal, or `timeoutMs: 0`. */
  private refusal(cost: number, key: string, o: AdmitOptions): Promise<never> | undefined {
    const signal = o.signal;
    if (signal?.aborted) return Promise.reject(signal.reason);
    const timeoutMs = o.timeoutMs;
    if (timeoutMs === 0) {
      this.timedOut++;
      this.log.warn({ key, cost, timeoutMs }, "admission timed out");
      return Promise.reject(this.timeoutError(0));
    }
    return undefined;
  }

  /** Line `w` up on `list` with its abort listener and its timeout (never 0 here). */
  private enter(
    list: AnyList,
    w: WaitEntry,
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
  ): void {
    list.push(w);
    w.seq = ++this.#arrivals;
    this.waiting++;
    if (this.waitsInLine) this.markWaiting(w);
    if (signal) {
      try {
        this.#signalWaits.add(signal, w);
        w.signal = signal;
      } catch (error) {
        // A signal that cannot be listened to: the wait ends at once, as if aborted, with an
        // error naming it (the waiter is already in line, so it leaves the way an abort does).
        const invalid = new InvalidOptionsError(
          this.name,
          "signal",
          `${this.kind} "${this.name}": signal must be an AbortSignal (addEventListener threw: ${messageOf(error)})`,
        );
        queueMicrotask(() => this.dropWaiter(w, invalid));
      }
    }
    if (timeoutMs !== undefined && timeoutMs !== Number.POSITIVE_INFINITY) {
      w.timer = this.clock.setTimeout(() => this.timeoutWaiter(w, timeoutMs), timeoutMs);
    }
  }

  /** Call `fn` with a granted ticket and release it after; see `run`. */
  callTicket<T>(
    ticket: BaseTicket,
    fn: (ticket: Ticket) => T | PromiseLike<T>,
    classify: RunOptions<T>["classify"],
  ): Promise<T> {
    return callWith(ticket, fn, classify, this.log);
  }

  /** Hand `w` its ticket: unlink it, drop its listener and timer, resolve. */
  protected grant(w: WaitEntry, waitFor: WaitFor): BaseTicket {
    this.unlink(w);
    const ticket = this.issue(w.cost, w.key, w.enqueuedAt, waitFor, w.waited);
    w.deliver(ticket);
    return ticket;
  }

  /** Reject a waiter with `error` (a backend failure) and take it off its list. */
  protected failWaiter(w: WaitEntry, error: unknown): void {
    if (!w.list) return;
    this.unlink(w);
    w.refuse(error);
  }

  /** Make the waiter object; a backend may keep more per waiter. */
  protected newWaiter(cost: number, key: string, now: number): Waiter {
    return new Waiter(this, cost, key, now);
  }

  private unlink(w: WaitEntry): void {
    w.list?.remove(w);
    this.waiting--;
    this.#drains.current?.poke();
    if (w.signal) {
      const signal = w.signal;
      w.signal = undefined;
      this.#signalWaits.remove(signal, w);
    }
    if (w.timer !== undefined) {
      this.clock.clearTimeout(w.timer);
      w.timer = undefined;
    }
  }

  abortWaiter(w: WaitEntry): void {
    const list = w.list;
    if (!list) return;
    const reason = w.signal?.reason;
    this.unlink(w);
    this.aborted++;
    w.refuse(reason);
    this.afterWaiterGone(list, w);
  }

  /** Take a waiter off its list with `error`, as an abort does, without counting an abort. */
  private dropWaiter(w: WaitEntry, error: unknown): void {
    const list = w.list;
    if (!list) return;
    this.unlink(w);
    w.refuse(error);
    this.afterWaiterGone(list, w);
  }

  private timeoutWaiter(w: WaitEntry, timeoutMs: number): void {
    if (!w.list) return;
    w.timer = undefined;
    // Capacity that becomes free at this very instant still counts as in time.
    const due = this.grantDue(w.list, w.key, w);
    if (due) void due.then(() => this.expire(w, timeoutMs));
    else this.expire(w, timeoutMs);
  }

  private expire(w: WaitEntry, timeoutMs: number): void {
    const list = w.list;
    if (!list) return;
    this.unlink(w);
    this.timedOut++;
    this.log.warn({ key: w.key, cost: w.cost, timeoutMs }, "admission timed out");
    w.refuse(this.timeoutError(timeoutMs));
    this.afterWaiterGone(list, w);
  }

  /**
   * Grant whatever on `list` is due now; time-driven stages override it. A promise means the
   * answer is on its way (a Redis call); the timeout of `_waiter` (on `list`) waits for it.
   */
  protected grantDue(_list: AnyList, _key: string, _waiter?: WaitEntry): Promise<void> | undefined {
    return undefined;
  }

  /** The error of a wait that ran past `timeoutMs`; `retryAfterMs` when the stage knows it. */
  protected timeoutError(timeoutMs: number, retryAfterMs?: number): AdmitTimeoutError {
    return new AdmitTimeoutError(
      this.name,
      `${this.kind} "${this.name}": not admitted within timeoutMs (${timeoutMs})`,
      { retryAfterMs },
    );
  }

  protected baseSnapshot(limit: number): Snapshot {
    return {
      name: this.name,
      kind: this.kind,
      backend: this.backend,
      inFlight: this.inFlight,
      waiting: this.waiting,
      queueDepth: 0,
      shed: this.shed,
      admitted: this.admitted,
      timedOut: this.timedOut,
      aborted: this.aborted,
      tokenWaitMs: this.tokenWaitMs,
      permitWaitMs: this.permitWaitMs,
      queueWaitMs: this.queueWaitMs,
      leasesLost: this.leasesLost,
      limit,
      flow: this.flow.snapshot(this.clock.now(), this.inFlight, limit),
    };
  }

  close(): Promise<void> {
    if (this.closed) return RESOLVED;
    this.closed = true;
    for (const list of this.lists()) {
      for (let w = list.head; w; w = list.head) {
        this.unlink(w);
        w.refuse(new ClosedError(this.name));
      }
    }
    this.onClose();
    this.#closeController?.abort(new ClosedError(this.name));
    this.notifyWatchers(true);
    return RESOLVED;
  }

  /** Stop timers the stage owns. */
  protected onClose(): void {}

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
