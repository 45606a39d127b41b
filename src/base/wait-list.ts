import type { ClockTimer } from "../clock.js";
import type { Ticket } from "../types.js";

/** Receives a waiter's abort (as an `EventListener` object, so no closure per waiter). */
export interface WaiterOwner {
  abortWaiter(waiter: WaitEntry): void;
}

/**
 * One caller's place in a `WaitList`, granted or sent away by its stage. What the caller gets
 * on either is up to the subclass: a `Waiter` resolves a promise of the ticket.
 */
export abstract class WaitEntry {
  prev: WaitEntry | null = null;
  next: WaitEntry | null = null;
  list: WaitList<any> | null = null;
  signal: AbortSignal | undefined = undefined;
  timer: ClockTimer | undefined = undefined;
  /** Its place in the order of arrival at its stage, across all the stage's lines. */
  seq = 0;
  /** Whether it was published as waiting (`floodgate:wait`): its grant is then one too. */
  waited = false;

  constructor(
    readonly owner: WaiterOwner,
    readonly cost: number,
    public key: string,
    /** When the wait began, on the stage's clock (a gate's waiter gets it from the stage). */
    public enqueuedAt: number,
  ) {}

  /** The wait is over: here is the ticket. Called once, after the entry left its list. */
  abstract deliver(ticket: Ticket): void;

  /** The wait ended without a ticket (abort, timeout, close, a backend error). */
  abstract refuse(error: unknown): void;

  /** The abort listener. */
  handleEvent(): void {
    this.owner.abortWaiter(this);
  }
}

/** The resolving functions of the promise `capture` was last handed to (no closure per waiter). */
let capturedResolve: ((ticket: Ticket) => void) | undefined;
let capturedReject: ((error: unknown) => void) | undefined;
function capture(resolve: (ticket: Ticket) => void, reject: (error: unknown) => void): void {
  capturedResolve = resolve;
  capturedReject = reject;
}

/** One caller waiting for admission, on a promise of its ticket. */
export class Waiter extends WaitEntry {
  resolve!: (ticket: Ticket) => void;
  reject!: (error: unknown) => void;
  readonly promise: Promise<Ticket>;

  constructor(owner: WaiterOwner, cost: number, key: string, enqueuedAt: number) {
    super(owner, cost, key, enqueuedAt);
    this.promise = new Promise<Ticket>(capture);
    this.resolve = capturedResolve!;
    this.reject = capturedReject!;
    capturedResolve = capturedReject = undefined;
  }

  deliver(ticket: Ticket): void {
    this.resolve(ticket);
  }

  refuse(error: unknown): void {
    this.reject(error);
  }
}

/** A FIFO of waiters with O(1) removal from anywhere, so an aborted waiter leaves at once. */
export class WaitList<W extends WaitEntry = Waiter> {
  head: W | null = null;
  tail: W | null = null;
  size = 0;

  push(w: W): void {
    w.list = this;
    w.prev = this.tail;
    w.next = null;
    if (this.tail) this.tail.next = w;
    else this.head = w;
    this.tail = w;
    this.size++;
  }

  remove(w: W): void {
    if (w.list !== this) return;
    if (w.prev) w.prev.next = w.next;
    else this.head = w.next as W | null;
    if (w.next) w.next.prev = w.prev;
    else this.tail = w.prev as W | null;
    w.prev = w.next = null;
    w.list = null;
    this.size--;
  }
}
