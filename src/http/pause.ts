/**
 * The pause a response puts on its host: as long as its Retry-After asks, or, with a reserve,
 * until its rate-limit window resets when the window is down to the reserve.
 */
import type { Gate } from "../gate.js";
import { parseRateLimit, reservePauseMs } from "./rate-limit.js";
import type { HeadersLike, ReserveOptions } from "./types.js";

/** The longest pause one response may put on its host, unless `maxPauseMs` says otherwise: a day. */
export const DEFAULT_MAX_PAUSE_MS = 86_400_000;

/** How a wrapper pauses hosts: on which gate, for how long at most, keeping which reserve. */
export interface HostPause {
  readonly gate: Pick<Gate, "pause">;
  /** `0` turns pausing off. */
  readonly maxPauseMs: number;
  readonly reserve: ReserveOptions | undefined;
}

/**
 * How long a response asks its host to pause, cut to `maxPauseMs`: `retryAfterMs` (its
 * Retry-After, read at wall-clock `wall`), or the reserve's reset when that is later; `undefined`
 * for no pause.
 */
export function pauseMs(
  p: HostPause,
  headers: HeadersLike,
  retryAfterMs: number | undefined,
  wall: number,
): number | undefined {
  let ms = retryAfterMs;
  if (p.reserve) {
    const reset = reservePauseMs(parseRateLimit(headers, wall), p.reserve);
    if (reset !== undefined && (ms === undefined || reset > ms)) ms = reset;
  }
  if (ms === undefined || ms <= 0) return undefined;
  return Math.min(ms, p.maxPauseMs);
}

/**
 * Pause `host` on the gate for as long as the response asks (see `pauseMs`). `gate.pause` is
 * called at once; the promise resolves when it is done and never rejects: a pause that fails
 * (Redis unreachable) does not fail the call.
 */
export async function pauseHost(
  p: HostPause,
  host: string,
  headers: HeadersLike,
  retryAfterMs: number | undefined,
  wall: number,
): Promise<void> {
  const ms = pauseMs(p, headers, retryAfterMs, wall);
  if (ms === undefined) return;
  try {
    await p.gate.pause(host, ms);
  } catch {
    // The response matters more than the pause.
  }
}
