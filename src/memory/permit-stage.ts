import { type ClassLine, nextClass } from "../algorithms/classes.js";
import { type ClassBook, classRule } from "../base/classes.js";
import { BaseStage, type BaseTicket, type RunWaiter, type WaitFor } from "../base/stage.js";
import { WaitList } from "../base/wait-list.js";
import type { Clock } from "../clock.js";
import type { AdmitOptions, Outcome, RunOptions, Snapshot, Ticket } from "../types.js";

/**
 * Permits counted against a limit, waiters served strictly first in, first out, so a large `cost`
 * at the head is never starved by small ones behind it. The semaphore, the bounded queue and the
 * AIMD limiter are all this, with a different rule for the limit and for a full house.
 *
 * With traffic classes (`classes`), each class has its own line, FIFO within it, and a free
 * permit goes to the head `nextClass` picks (src/algorithms/classes.ts); a class is then
 * written on its tickets and waiters as their `key`. Without classes nothing of that is read.
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

  constructor(name: string, limit: number, clock: Clock, book?: ClassBook) {
    super(name, clock);
    this.limit = limit;
    this.book = book;
    if (book) {
      for (let i = 0; i < book.names.length; i++) {
        this.#lines.push(new WaitList());
        this.#view.push({ used: 0, headCost: undefined, headAt: 0 });
      }
      this.callRule = classRule(book);
    }
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
    return this.issue(cost, this.book!.names[cls]!, undefined, this.waitFor);
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const cost = o.cost ?? 1;
    const cls = this.classOf(o, cost);
    if (this.fitsNow(cost, cls)) return Promise.resolve(this.take(cost, cls));
    return this.shedding() ?? this.wait(this.lineOf(cls), cost, this.keyOf(cls), o);
  }

  /** What a waiter or ticket of class `cls` carries as its key: the class's name. */
  protected keyOf(cls: number): string {
    return cls < 0 ? "" : this.book!.names[cls]!;
  }

  override admitNow(o: AdmitOptions, cost: number): BaseTicket | undefined {
    if (this.closed || !Number.isInteger(cost) || cost < 0 || cost > this.maxCost || o.signal?.aborted) {
      return undefined;
    }
    const cls = this.classOf(o, cost);
    return this.fitsNow(cost, cls) ? this.take(cost, cls) : undefined;
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
      o.signal?.aborted
    ) {
      return undefined;
    }
    const cls = this.classOf(o, cost);
    if (this.fitsNow(cost, cls)) return undefined;
    w.enqueuedAt = this.clock.now();
    w.key = this.keyOf(cls);
    return this.lineUp(this.lineOf(cls), w, o.signal, timeoutMs);
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
    const cls = this.classOf(o, cost);
    if (this.fitsNow(cost, cls)) return this.callTicket(this.take(cost, cls), fn, o.classify);
    return this.shedding() ?? this.waitToRun(this.lineOf(cls), cost, this.keyOf(cls), o, fn);
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const cost = o.cost ?? 1;
    const cls = this.classOf(o, cost);
    return Promise.resolve(this.fitsNow(cost, cls) ? this.take(cost, cls) : undefined);
  }

  releaseTicket(ticket: BaseTicket, _outcome: Outcome, _refund: boolean): void {
    this.used -= ticket.cost;
    this.book?.giveBack(ticket.key, ticket.cost);
    this.drain();
  }

  /** Grant waiters from the head while they fit (with classes: in the order `nextClass` picks). */
  protected drain(): void {
    if (this.book) {
      for (let cls = this.#pick(); cls >= 0; cls = this.#pick()) {
        const w = this.#lines[cls]!.head!;
        this.used += w.cost;
        this.book.take(cls, w.cost);
        this.grant(w, this.waitFor);
      }
      return;
    }
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
