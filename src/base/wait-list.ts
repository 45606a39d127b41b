import type { ClockTimer } from "../clock.js";
import type { Ticket } from "../types.js";

/** Receives a waiter's abort (as an `EventListener` object, so no closure per waiter). */
export interface WaiterOwner {
  abortWaiter(waiter: Waiter): void;
}

/** One caller waiting for admission. Lives in exactly one `WaitList` until granted or gone. */
export class Waiter {
  prev: Waiter | null = null;
  next: Waiter | null = null;
  list: WaitList | null = null;
  resolve!: (ticket: Ticket) => void;
  reject!: (error: unknown) => void;
  signal: AbortSignal | undefined = undefined;
  timer: ClockTimer | undefined = undefined;
  readonly promise: Promise<Ticket>;

  constructor(
    readonly owner: WaiterOwner,
    readonly cost: number,
    readonly key: string,
    readonly enqueuedAt: number,
  ) {
    this.promise = new Promise<Ticket>((resolve, reject) => {
      this.resolve = resolve;
      this.reject = reject;
    });
  }

  /** The abort listener. */
  handleEvent(): void {
    this.owner.abortWaiter(this);
  }
}

/** A FIFO of waiters with O(1) removal from anywhere, so an aborted waiter leaves at once. */
export class WaitList {
  head: Waiter | null = null;
  tail: Waiter | null = null;
  size = 0;

  push(w: Waiter): void {
    w.list = this;
    w.prev = this.tail;
    w.next = null;
    if (this.tail) this.tail.next = w;
    else this.head = w;
    this.tail = w;
    this.size++;
  }

  remove(w: Waiter): void {
    if (w.list !== this) return;
    if (w.prev) w.prev.next = w.next;
    else this.head = w.next;
    if (w.next) w.next.prev = w.prev;
    else this.tail = w.prev;
    w.prev = w.next = null;
    w.list = null;
    this.size--;
  }
}
