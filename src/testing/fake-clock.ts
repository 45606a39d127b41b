import { setImmediate as realSetImmediate } from "node:timers";
import type { Clock, ClockTimer } from "../clock.js";

interface FakeTimer {
  at: number;
  seq: number;
  callback: () => void;
  cancelled: boolean;
}

/** Let every pending promise callback run: one macrotask turn drains the microtask queue. */
function settle(): Promise<void> {
  return new Promise((resolve) => realSetImmediate(resolve));
}

/**
 * A clock that moves only when told. `advance(ms)` runs every timer that falls due, in order of
 * due time (then of creation), sets `now()` to each timer's due time while it runs, and lets
 * promises settle between timers, so code awaiting an admission has run before the next timer.
 *
 * ```ts
 * const clock = new FakeClock();
 * const bucket = memory({ clock }).tokenBucket("api", { capacity: 1, refillPerSecond: 1 });
 * await bucket.admit();
 * const next = bucket.admit();
 * await clock.advance(1000); // `next` is now granted
 * ```
 */
export class FakeClock implements Clock {
  #now: number;
  #seq = 0;
  #heap: FakeTimer[] = [];
  #work = new Set<Promise<unknown>>();

  constructor(start = 0) {
    this.#now = start;
  }

  now(): number {
    return this.#now;
  }

  setTimeout(callback: () => void, ms: number): ClockTimer {
    const delay = Number.isFinite(ms) && ms > 0 ? ms : 0;
    const timer: FakeTimer = { at: this.#now + delay, seq: this.#seq++, callback, cancelled: false };
    this.#push(timer);
    return timer;
  }

  clearTimeout(timer: ClockTimer): void {
    if (timer && typeof timer === "object" && "cancelled" in timer) (timer as FakeTimer).cancelled = true;
  }

  /** Timers scheduled and not yet fired or cancelled. */
  get pendingTimers(): number {
    let n = 0;
    for (const t of this.#heap) if (!t.cancelled) n++;
    return n;
  }

  /** Due time of the next pending timer, or `undefined`. */
  nextTimerAt(): number | undefined {
    this.#dropCancelled();
    return this.#heap[0]?.at;
  }

  /**
   * Stages call this with asynchronous work they start (a Redis round trip); `flush` and
   * `advance` wait for it, so a test under the fake clock sees the result of I/O before time moves.
   */
  track(work: Promise<unknown>): void {
    const tracked: Promise<unknown> = work.then(
      (): void => void this.#work.delete(tracked),
      (): void => void this.#work.delete(tracked),
    );
    this.#work.add(tracked);
  }

  /** Let pending promises and tracked work settle without moving time. */
  async flush(): Promise<void> {
    await settle();
    await settle();
    for (let rounds = 0; this.#work.size > 0 && rounds < 10_000; rounds++) {
      await Promise.all([...this.#work]);
      await settle();
      await settle();
    }
  }

  /** Move time forward by `ms`, running every timer that falls due on the way. */
  async advance(ms: number): Promise<void> {
    if (!(ms >= 0)) throw new RangeError(`FakeClock.advance: ms must be >= 0 (got ${ms})`);
    await this.advanceTo(this.#now + ms);
  }

  /** Move time forward to `time`, running every timer that falls due on the way. */
  async advanceTo(time: number): Promise<void> {
    await this.flush();
    for (;;) {
      this.#dropCancelled();
      const next = this.#heap[0];
      if (!next || next.at > time) break;
      this.#pop();
      if (next.at > this.#now) this.#now = next.at;
      next.callback();
      await this.flush();
    }
    if (time > this.#now) this.#now = time;
    await this.flush();
  }

  /** Run timers until none is left (at most `limit` of them, to stop runaway loops). */
  async runAll(limit = 100_000): Promise<void> {
    await this.flush();
    for (let i = 0; i < limit; i++) {
      const at = this.nextTimerAt();
      if (at === undefined) return;
      await this.advanceTo(at);
    }
    throw new Error(`FakeClock.runAll: more than ${limit} timers; a timer keeps rescheduling itself`);
  }

  #dropCancelled(): void {
    while (this.#heap.length > 0 && this.#heap[0]!.cancelled) this.#pop();
  }

  #less(a: FakeTimer, b: FakeTimer): boolean {
    return a.at < b.at || (a.at === b.at && a.seq < b.seq);
  }

  #push(timer: FakeTimer): void {
    const heap = this.#heap;
    heap.push(timer);
    let i = heap.length - 1;
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if (!this.#less(heap[i]!, heap[parent]!)) break;
      [heap[i], heap[parent]] = [heap[parent]!, heap[i]!];
      i = parent;
    }
  }

  #pop(): FakeTimer | undefined {
    const heap = this.#heap;
    const top = heap[0];
    const last = heap.pop();
    if (heap.length > 0 && last) {
      heap[0] = last;
      let i = 0;
      for (;;) {
        const l = 2 * i + 1;
        const r = l + 1;
        let m = i;
        if (l < heap.length && this.#less(heap[l]!, heap[m]!)) m = l;
        if (r < heap.length && this.#less(heap[r]!, heap[m]!)) m = r;
        if (m === i) break;
        [heap[i], heap[m]] = [heap[m]!, heap[i]!];
        i = m;
      }
    }
    return top;
  }
}
