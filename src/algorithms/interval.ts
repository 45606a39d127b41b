/**
 * Interval gate math: spacing between the starts of calls to one host. Functions of `now`; those
 * over a `HostState` update it in place. `lua/interval-gate-*.lua` port them, and
 * `test/redis/lua-twins.test.ts` checks the ports step for step.
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

/**
 * A host's slots, which the functions below update in place: `nextAt`, the earliest start of its
 * next call, and `pausedUntil`, the end of its latest pause.
 */
export interface HostState {
  nextAt: number;
  pausedUntil: number;
}

/**
 * A call starts at `now` (its slot has come: `nextAt <= now`): the next slot moves one `spacing`
 * past it. Returns the slot it replaced, which a refund hands back.
 */
export function claimSlot(h: HostState, now: number, spacing: number): number {
  const previous = h.nextAt;
  h.nextAt = afterStart(now, spacing);
  return previous;
}

/**
 * `pause(host, ms)` at `now`: no call starts before `now + ms`. Neither the next slot nor the
 * end of a pause ever moves earlier.
 */
export function pauseHost(h: HostState, now: number, ms: number): void {
  h.nextAt = afterPause(h.nextAt, now, ms);
  h.pausedUntil = Math.max(h.pausedUntil, now + ms);
}

/**
 * Hand back the slot a call claimed (`claimed`, having replaced `previous`) when the call was
 * never sent: only while nothing has moved the host on since (another start, a pause), and never
 * back inside a pause. Returns whether it was handed back.
 */
export function refundSlot(h: HostState, claimed: number, previous: number): boolean {
  if (h.nextAt !== claimed) return false;
  h.nextAt = Math.max(previous, h.pausedUntil);
  return true;
}
