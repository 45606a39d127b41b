import { type ClassLine, nextClass, reclaimPlan } from "../algorithms/classes.js";
import { type ClassBook, classRule } from "../base/classes.js";
import { BaseStage, type BaseTicket, type RunWaiter, type WaitFor } from "../base/stage.js";
import { type WaitEntry, WaitList } from "../base/wait-list.js";
import type { Clock } from "../clock.js";
import { type DrainingError, ReclaimedError } from "../errors.js";
import type { AdmitOptions, Outcome, RunOptions, Snapshot, Ticket } from "../types.js";

/**
 * Permits counted against a limit, waiters served strictly first in, first out, so a large `cost`
 * at the head is never starved by small ones behind it. The semaphore, the bounded queue and the
 * AIMD limiter are all this, with a different rule for the limit and for a full house.
 *
 * With traffic classes (`classes`), each class has its own line, FIFO within it, and a free
 * permit goes to the head `nextClass` picks (src/algorithms/classes.ts); a class is then
 * written on its tickets and waiters as their `key`. Without classes nothing of that is read.
 * With `reclaim: "signal"` the stage also keeps its live tickets, so that a class below its
 * guarantee that waits can ask borrowed ones back through their signal (`reclaimPlan`).
 */
export abstract class PermitStage extends BaseStage {
  protected limit: number;
  protected used = 0;
  protected readonly waiters = new WaitList();
  protected readonly waitFor: WaitFor = "permit";
  /** The stage's classes, or undefined: one line for every call. */
  protected readonly book: ClassBook | undefined;
  /** One line per class, in the book's order (empty without classes). */
  readonly #lines: WaitList[] = [];
  /** What `nextClass` reads of each class (arrival as the head's `seq`), rewritten in place before each pick. */
  readonly #view: { used: number; headCost: number | undefined; headAt: number }[] = [];
  /** Live tickets by admission order, with `reclaim: "signal"` only (else undefined). */
  readonly #held: Map<BaseTicket, Held> | undefined;
  /** Per class: the cost of its tickets asked back and not yet released; what its calls in line cost; the plan. */
  readonly #asked: number[] = [];
  readonly #inLine: number[] = [];
  readonly #plan: number[] = [];

  constructor(name: string, limit: number, clock: Clock, book?: ClassBook, reclaim = false) {
    super(name, clock);
    this.limit = limit;
    this.book = book;
    if (book) {
      for (let i = 0; i < book.names.length; i++) {
        this.#lines.push(new WaitList());
        this.#view.push({ used: 0, headCost: undefined, headAt: 0 });
        this.#asked.push(0);
        this.#inLine.push(0);
        this.#plan.push(0);
      }
      this.callRule = classRule(book);
    }
    this.#held = book && reclaim ? new Map() : undefined;
  }

  /** Keep ticket `t` of class `cls` among the live ones that may be asked back; returns it. */
  #track(t: BaseTicket, cls: number): BaseTicket {
    this.#held?.set(t, new Held(cls));
    return t;
  }

  /**
   * With `reclaim: "signal"`: when classes below their guarantee wait for more than is free and
   * already asked back, ask borrowed tickets back, as `reclaimPlan` says, the latest first.
   */
  #askBack(): void {
    const held = this.#held;
    // Nothing held, or nobody waiting (a release with an empty line): nothing to ask.
    if (!held || held.size === 0 || this.waiting === 0) return;
    const book = this.book!;
    const guarantee = book.bounds(this.limit).guarantee;
    for (let i = 0; i < this.#lines.length; i++) {
      let cost = 0;
      for (let w: WaitEntry | null = this.#lines[i]!.head; w && cost < guarantee[i]!; w = w.next)
        cost += w.cost;
      this.#inLine[i] = cost;
    }
    const plan = this.#plan;
    const free = this.limit - this.used;
    if (reclaimPlan(book.used, guarantee, this.#inLine, this.#asked, free, book.configs, plan) === 0) return;
    for (const [t, h] of [...held].reverse()) {
      if (h.asked || plan[h.cls]! <= 0) continue;
      h.asked = true;
      plan[h.cls]! -= t.cost;
      this.#asked[h.cls]! += t.cost;
      h.controller?.abort(this.#reclaimed(h.cls));
    }
  }

  #reclaimed(cls: number): ReclaimedError {
    const name = this.book!.names[cls]!;
    return new ReclaimedError(
      this.name,
      `${this.kind} "${this.name}": a class below its guarantee waits for permits class "${name}" borrowed: wrap this call up and release its ticket`,
    );
  }

  /** With `reclaim: "signal"`, each live ticket's own signal: it aborts when asked back or on close. */
  override ticketSignal(ticket: BaseTicket): AbortSignal {
    const h = this.#held?.get(ticket);
    if (!h) return this.closedSignal;
    if (!h.controller) {
      h.controller = new AbortController();
      if (this.closed) h.controller.abort(this.closedSignal.reason);
      else if (h.asked) h.controller.abort(this.#reclaimed(h.cls));
    }
    return h.controller.signal;
  }

  protected override abortTickets(reason: DrainingError): void {
    if (!this.#held) return;
    for (const h of this.#held.values()) h.controller?.abort(reason);
  }

  protected override releaseAll(): void {
    this.used = 0;
    this.book?.giveBackAll();
    this.#held?.clear();
    this.#asked.fill(0);
  }

  protected override onClose(): void {
    if (!this.#held) return;
    for (const h of this.#held.values()) h.controller?.abort(this.closedSignal.reason);
  }

  /** The names of the stage's classes, when it has them. */
  override get classes(): readonly string[] | undefined {
    return this.book?.names;
  }

  /** The class of a call that names none, when the stage has classes. */
  get defaultClass(): string | undefined {
    return this.book?.defaultClass;
  }

  /** The class a call draws on (its index in the book), or -1 on a stage without classes. */
  protected classOf(o: AdmitOptions, cost: number): number {
    return this.book === undefined ? -1 : this.book.indexOf(o, cost);
  }

  /** The line a call of class `cls` waits in. */
  protected lineOf(cls: number): WaitList {
    return cls < 0 ? this.waiters : this.#lines[cls]!;
  }

  /**
   * The class whose head goes next, or -1. With `extra` (a class with nobody in line), that
   * class is looked at as if a call of cost `extraCost` stood at its head, arrived after everyone.
   */
  #pick(extra = -1, extraCost = 0): number {
    const book = this.book!;
    const view = this.#view;
    for (let i = 0; i < view.length; i++) {
      const v = view[i]!;
      const head = this.#lines[i]!.head;
      v.used = book.used[i]!;
      v.headCost = i === extra ? extraCost : head?.cost;
      v.headAt = i === extra ? Number.POSITIVE_INFINITY : (head?.seq ?? 0);
    }
    return nextClass(view as ClassLine[], book.bounds(this.limit), book.configs, this.limit - this.used);
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
   * A cost of 0 takes nothing, so it goes at once even past callers in line (as on Redis). With
   * classes: nobody in the class's line, and the class would be picked next.
   */
  protected fitsNow(cost: number, cls = -1): boolean {
    if (cls < 0) return (this.waiters.size === 0 || cost === 0) && this.used + cost <= this.limit;
    if (cost === 0) return true;
    return this.#lines[cls]!.size === 0 && this.#pick(cls, cost) === cls;
  }

  /** Take `cost` permits now (for class `cls`) and issue their ticket. */
  protected take(cost: number, cls = -1): BaseTicket {
    this.used += cost;
    if (cls < 0) return this.issue(cost, "", undefined, this.waitFor);
    this.book!.take(cls, cost);
    return this.#track(this.issue(cost, this.book!.names[cls]!, undefined, this.waitFor), cls);
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const cost = o.cost ?? 1;
    const cls = this.classOf(o, cost);
    if (this.fitsNow(cost, cls)) return Promise.resolve(this.take(cost, cls));
    const waiting = this.shedding(cost) ?? this.wait(this.lineOf(cls), cost, this.keyOf(cls), o);
    this.#askBack();
    return waiting;
  }

  /** What a waiter or ticket of class `cls` carries as its key: the class's name. */
  protected keyOf(cls: number): string {
    return cls < 0 ? "" : this.book!.names[cls]!;
  }

  override admitNow(o: AdmitOptions, cost: number): BaseTicket | undefined {
    if (this.refusing || !Number.isInteger(cost) || cost < 0 || cost > this.maxCost || o.signal?.aborted) {
      return undefined;
    }
    const cls = this.classOf(o, cost);
    return this.fitsNow(cost, cls) ? this.take(cost, cls) : undefined;
  }

  override fuseProbe(_o: AdmitOptions, cost: number): number {
    this.throwIfRefusing();
    if (!Number.isInteger(cost) || cost < 0 || cost > this.maxCost) return Number.NaN;
    return this.fitsNow(cost) ? 0 : -1;
  }

  override waitInGate<T>(
    w: RunWaiter<T>,
    o: AdmitOptions,
    timeoutMs: number | undefined,
  ): Promise<T> | undefined {
    const cost = w.cost;
    if (
      this.refusing ||
      !this.blocks ||
      !Number.isInteger(cost) ||
      cost < 0 ||
      cost > this.maxCost ||
      timeoutMs === 0 ||
      o.signal?.aborted
    ) {
      return undefined;
    }
    const cls = this.classOf(o, cost);
    if (this.fitsNow(cost, cls)) return undefined;
    w.enqueuedAt = this.clock.now();
    w.key = this.keyOf(cls);
    const waiting = this.lineUp(this.lineOf(cls), w, o.signal, timeoutMs);
    this.#askBack();
    return waiting;
  }

  /** Whether a call that finds no room waits for it (a queue may shed instead). */
  protected get blocks(): boolean {
    return true;
  }

  /** What a call that finds no room gets instead of a place in line: a shedding queue's error. */
  protected shedding(_cost: number): Promise<never> | undefined {
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
    const cls = this.classOf(o, cost);
    if (this.fitsNow(cost, cls)) return this.callTicket(this.take(cost, cls), fn, o.classify);
    const waiting = this.shedding(cost) ?? this.waitToRun(this.lineOf(cls), cost, this.keyOf(cls), o, fn);
    this.#askBack();
    return waiting;
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const cost = o.cost ?? 1;
    const cls = this.classOf(o, cost);
    return Promise.resolve(this.fitsNow(cost, cls) ? this.take(cost, cls) : undefined);
  }

  releaseTicket(ticket: BaseTicket, _outcome: Outcome, _refund: boolean): void {
    this.used -= ticket.cost;
    this.book?.giveBack(ticket.key, ticket.cost);
    const h = this.#held?.get(ticket);
    if (h) {
      this.#held!.delete(ticket);
      if (h.asked) this.#asked[h.cls]! -= ticket.cost;
    }
    this.serveLine();
    this.#askBack();
  }

  /** Grant waiters from the head while they fit (with classes: in the order `nextClass` picks). */
  protected serveLine(): void {
    if (this.book) {
      for (let cls = this.#pick(); cls >= 0; cls = this.#pick()) {
        const w = this.#lines[cls]!.head!;
        this.used += w.cost;
        this.book.take(cls, w.cost);
        this.#track(this.grant(w, this.waitFor), cls);
      }
      return;
    }
    const list = this.waiters;
    for (let w = list.head; w && this.used + w.cost <= this.limit; w = list.head) {
      this.used += w.cost;
      this.grant(w, this.waitFor);
    }
    // Room left with nobody in line: a fused gate's call may now go.
    if (list.size === 0 && this.used < this.limit) this.notifyWatchers();
  }

  protected afterWaiterGone(): void {
    this.serveLine();
  }

  protected lists(): Iterable<WaitList> {
    return this.book ? this.#lines : [this.waiters];
  }

  /** Permits held now. */
  get held(): number {
    return this.used;
  }

  snapshot(): Snapshot {
    return this.withClasses(this.baseSnapshot(this.limit));
  }

  /** `snap` with each class's figures, on a stage with classes. */
  protected withClasses(snap: Snapshot): Snapshot {
    if (this.book) snap.classes = this.book.snapshot(this.limit, (i) => this.#lines[i]!.size);
    return snap;
  }
}

/** A live ticket of a stage with `reclaim: "signal"`: its class, its own signal, whether it was asked back. */
class Held {
  controller: AbortController | undefined = undefined;
  asked = false;
  constructor(readonly cls: number) {}
}
