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

/**
 * The real clock. It looks the global timers up on every call rather than once at import, so a
 * test that installs fake timers after importing floodgate still controls it.
 */
export const systemClock: Clock = {
  now: () => globalThis.performance.now(),
  setTimeout: (callback, ms) => globalThis.setTimeout(callback, ms),
  clearTimeout: (timer) => globalThis.clearTimeout(timer as ReturnType<typeof setTimeout>),
};

/** Let a timer not keep the process alive, when the clock's timers support it. */
export function unrefTimer(timer: ClockTimer): ClockTimer {
  const t = timer as { unref?: () => unknown } | undefined;
  if (t && typeof t.unref === "function") t.unref();
  return timer;
}
