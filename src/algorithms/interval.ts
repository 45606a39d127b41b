/**
 * Interval gate math: spacing between the starts of calls to one host. Pure functions of `now`.
 */

/** Spacing after a call: `minIntervalMs` plus `jitterMs * random` with `random` in [0, 1). */
export function spacingMs(minIntervalMs: number, jitterMs: number, random: number): number {
  const r = random >= 0 && random < 1 ? random : 0;
  return minIntervalMs + jitterMs * r;
}

/** Milliseconds from `now` until a call may start, given the host's next free slot. */
export function delayMs(nextAt: number, now: number): number {
  return nextAt > now ? nextAt - now : 0;
}

/** Next free slot after a call starts at `now` with the given spacing. */
export function afterStart(now: number, spacing: number): number {
  return now + spacing;
}

/** Next free slot after `pause(host, ms)` at `now`: never earlier than it was. */
export function afterPause(nextAt: number, now: number, ms: number): number {
  return Math.max(nextAt, now + ms);
}
