import { type Clock, type ClockTimer, unrefTimer } from "../clock.js";

/**
 * Per-key state with eviction: a sweep every `sweepMs` deletes the keys `isIdle` calls
 * indistinguishable from fresh ones, so a million distinct keys seen once do not stay in memory.
 * The sweep timer runs only while keys exist and never keeps the process alive.
 */
export class KeyedStates<S> {
  readonly map = new Map<string, S>();
  #timer: ClockTimer | undefined;
  #closed = false;

  constructor(
    private readonly clock: Clock,
    private readonly sweepMs: number,
    private readonly isIdle: (state: S, now: number) => boolean,
  ) {}

  get(key: string): S | undefined {
    return this.map.get(key);
  }

  set(key: string, state: S): void {
    this.map.set(key, state);
    if (this.#timer === undefined && !this.#closed) this.#schedule();
  }

  get size(): number {
    return this.map.size;
  }

  /** Delete every idle key now; returns how many were deleted. */
  sweep(): number {
    const now = this.clock.now();
    let deleted = 0;
    for (const [key, state] of this.map) {
      if (this.isIdle(state, now)) {
        this.map.delete(key);
        deleted++;
      }
    }
    return deleted;
  }

  #schedule(): void {
    this.#timer = unrefTimer(
      this.clock.setTimeout(() => {
        this.#timer = undefined;
        this.sweep();
        if (this.map.size > 0 && !this.#closed) this.#schedule();
      }, this.sweepMs),
    );
  }

  close(): void {
    this.#closed = true;
    if (this.#timer !== undefined) this.clock.clearTimeout(this.#timer);
    this.#timer = undefined;
  }
}
