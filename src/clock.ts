/** An opaque handle returned by `Clock.setTimeout`. */
export type ClockTimer = unknown;

/**
 * Time as the stages see it. Nothing in floodgate reads the system time or sets a timer except
 * through a `Clock`, so tests can inject `FakeClock` from `floodgate/testing`.
 */
export interface Clock {
  /** Milliseconds on a monotonic scale; only differences matter. */
  now(): number;
  /** Call `callback` after `ms` milliseconds. */
  setTimeout(callback: () => void, ms: number): ClockTimer;
  /** Cancel a timer; unknown or fired timers are ignored. */
  clearTimeout(timer: ClockTimer): void;
  /**
   * Optional: told about asynchronous work a stage started (a Redis call), so a fake clock can
   * wait for it to settle before it moves time on. The system clock has none.
   */
  track?(work: Promise<unknown>): void;
}

/** Node fires timers longer than this after 1 ms; longer waits are chained. */
const MAX_DELAY = 2 ** 31 - 1;

/** A timer longer than Node allows, made of shorter ones. */
class LongTimer {
  #handle: ReturnType<typeof setTimeout> | undefined;
  #unref = false;
  constructor(callback: () => void, ms: number) {
    this.#arm(callback, ms);
  }
  #arm(callback: () => void, ms: number): void {
    const step = Math.min(ms, MAX_DELAY);
    this.#handle = globalThis.setTimeout(() => {
      if (ms > step) this.#arm(callback, ms - step);
      else callback();
    }, step);
    if (this.#unref) this.#handle.unref?.();
  }
  unref(): this {
    this.#unref = true;
    this.#handle?.unref?.();
    return this;
  }
  clear(): void {
    if (this.#handle !== undefined) globalThis.clearTimeout(this.#handle);
    this.#handle = undefined;
  }
}

/**
 * The real clock. It looks the global timers up on every call rather than once at import, so a
 * test that installs fake timers after importing floodgate still controls it.
 */
export const systemClock: Clock = {
  now: () => globalThis.performance.now(),
  setTimeout: (callback, ms) =>
    ms > MAX_DELAY ? new LongTimer(callback, ms) : globalThis.setTimeout(callback, ms),
  clearTimeout: (timer) => {
    if (timer instanceof LongTimer) timer.clear();
    else globalThis.clearTimeout(timer as ReturnType<typeof setTimeout>);
  },
};

/** Let a timer not keep the process alive, when the clock's timers support it. */
export function unrefTimer(timer: ClockTimer): ClockTimer {
  const t = timer as { unref?: () => unknown } | undefined;
  if (t && typeof t.unref === "function") t.unref();
  return timer;
}
