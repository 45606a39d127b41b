/**
 * Reading a provider's rate-limit headers (`x-ratelimit-remaining-*`, `x-ratelimit-reset-*`) and
 * deciding how long a host should pause to leave a reserve of the provider's window for other
 * traffic. Pure: the wall clock comes in as a number.
 */

import { got, unknownOption } from "../validate.js";
import { headerValues } from "./retry-after.js";
import type { HeadersLike, RateLimitWindow, RateLimitWindowName, ReserveOptions } from "./types.js";

/** The headers of each window, in the order they are read. */
const WINDOWS: ReadonlyArray<{
  name: RateLimitWindowName;
  remaining: string;
  reset: string;
  limit: string;
}> = [
  {
    name: "requests",
    remaining: "x-ratelimit-remaining-requests",
    reset: "x-ratelimit-reset-requests",
    limit: "x-ratelimit-limit-requests",
  },
  {
    name: "tokens",
    remaining: "x-ratelimit-remaining-tokens",
    reset: "x-ratelimit-reset-tokens",
    limit: "x-ratelimit-limit-tokens",
  },
  {
    name: "general",
    remaining: "x-ratelimit-remaining",
    reset: "x-ratelimit-reset",
    limit: "x-ratelimit-limit",
  },
  { name: "general", remaining: "ratelimit-remaining", reset: "ratelimit-reset", limit: "ratelimit-limit" },
];

/** Every header name this module reads, lowercase. */
export const RATE_LIMIT_HEADERS: ReadonlySet<string> = new Set(
  WINDOWS.flatMap((w) => [w.remaining, w.reset, w.limit]),
);

const NUMBER = /^\d+(?:\.\d+)?$/;
/** A Go-style duration as OpenAI sends it: `1s`, `6m0s`, `20ms`, `1m30.5s`, `1h2m3s`. */
const DURATION = /^(?:\d+(?:\.\d+)?(?:h|ms|m|s|us|µs|ns))+$/;
const DURATION_PART = /(\d+(?:\.\d+)?)(h|ms|m|s|us|µs|ns)/g;
const UNIT_MS: Readonly<Record<string, number>> = {
  h: 3_600_000,
  m: 60_000,
  s: 1_000,
  ms: 1,
  us: 0.001,
  µs: 0.001,
  ns: 0.000_001,
};
/** A bare number at least this large is a moment (epoch seconds), not a delay. */
const EPOCH_SECONDS = 1e9;
/** A bare number at least this large is a moment in epoch milliseconds. */
const EPOCH_MS = 1e12;

function ceilFinite(ms: number): number | undefined {
  return Number.isFinite(ms) && ms >= 0 ? Math.ceil(ms) : undefined;
}

/**
 * Milliseconds until a window resets, from one `x-ratelimit-reset-*` value, or `undefined` when
 * it is unreadable.
 *
 * - A duration in Go's notation, as OpenAI sends it: `1s`, `20ms`, `6m0s`, `1m30.5s`, `2h`
 *   (units `h`, `m`, `s`, `ms`, `us`, `µs`, `ns`, summed).
 * - A bare number of seconds: `30`, `0.5`.
 * - A bare number of at least 1e9 is a moment, not a delay: epoch seconds (as GitHub sends
 *   `x-ratelimit-reset`), or epoch milliseconds from 1e12; the result is the time from `now` to
 *   it, `0` once passed.
 *
 * Fractions round up to the next whole millisecond. Anything else (empty, negative, an exponent,
 * spaces inside, an unknown unit) gives `undefined`; never throws.
 *
 * @param text the header value.
 * @param now wall-clock time in epoch milliseconds, used only for the epoch forms.
 */
export function parseResetMs(text: string, now: number): number | undefined {
  const t = text.trim();
  if (NUMBER.test(t)) {
    const n = Number(t);
    if (n >= EPOCH_MS) return ceilFinite(Math.max(0, n - now));
    if (n >= EPOCH_SECONDS) return ceilFinite(Math.max(0, n * 1000 - now));
    return ceilFinite(n * 1000);
  }
  if (t.length > 64 || !DURATION.test(t)) return undefined;
  let ms = 0;
  for (const m of t.matchAll(DURATION_PART)) ms += Number(m[1]) * UNIT_MS[m[2]!]!;
  return ceilFinite(ms);
}

/** A count header (`remaining`, `limit`): the first non-negative number of its first value. */
function countOf(headers: HeadersLike, name: string): number | undefined {
  for (const raw of headerValues(headers, name)) {
    // `Headers.get` joins a repeated header with ", "; some send `50;w=60` with a window.
    const first = raw.split(",")[0]!.split(";")[0]!.trim();
    if (NUMBER.test(first)) {
      const n = Number(first);
      return Number.isFinite(n) ? n : undefined;
    }
  }
  return undefined;
}

function resetOf(headers: HeadersLike, name: string, now: number): number | undefined {
  for (const raw of headerValues(headers, name)) {
    for (const part of raw.split(",")) {
      const ms = parseResetMs(part, now);
      if (ms !== undefined) return ms;
    }
  }
  return undefined;
}

/**
 * The windows a response reports: one per `*-remaining*` header that holds a non-negative number,
 * with its matching limit and reset when those are readable. Reads
 * `x-ratelimit-{remaining,reset,limit}-requests`, `…-tokens`, `x-ratelimit-{remaining,reset,limit}`
 * and `ratelimit-{remaining,reset,limit}`. Never throws for any header content.
 *
 * @param headers a fetch `Headers` or a plain record of header values.
 * @param now wall-clock time in epoch milliseconds, for resets given as a moment.
 */
export function parseRateLimit(headers: HeadersLike | null | undefined, now: number): RateLimitWindow[] {
  if (headers === null || typeof headers !== "object") return [];
  const windows: RateLimitWindow[] = [];
  for (const w of WINDOWS) {
    const remaining = countOf(headers, w.remaining);
    if (remaining === undefined) continue;
    windows.push({
      name: w.name,
      limit: countOf(headers, w.limit),
      remaining,
      resetMs: resetOf(headers, w.reset, now),
    });
  }
  return windows;
}

/** The reserve to keep in `window`, or `undefined` for none. */
function reserveOf(window: RateLimitWindow, reserve: ReserveOptions): number | undefined {
  if (reserve.share !== undefined) {
    return window.limit === undefined ? undefined : reserve.share * window.limit;
  }
  const r = reserve.remaining;
  let n: unknown = r;
  if (typeof r === "function") {
    try {
      n = r({ ...window });
    } catch {
      return undefined;
    }
  }
  return typeof n === "number" && Number.isFinite(n) && n >= 0 ? n : undefined;
}

/**
 * How long a host should pause so that the traffic behind this gate leaves the reserve of each
 * window to others: the longest reset among the windows whose `remaining` is at or below the
 * reserve, or `undefined` when none is (or when such a window gives no readable reset).
 */
export function reservePauseMs(
  windows: readonly RateLimitWindow[],
  reserve: ReserveOptions,
): number | undefined {
  let ms: number | undefined;
  for (const w of windows) {
    if (w.resetMs === undefined || w.resetMs <= 0) continue;
    const keep = reserveOf(w, reserve);
    if (keep === undefined || w.remaining > keep) continue;
    ms = ms === undefined ? w.resetMs : Math.max(ms, w.resetMs);
  }
  return ms;
}

/**
 * Check a `reserve` option; returns it, or throws through `fail(field, message)`.
 * @internal
 */
export function checkReserve(
  value: unknown,
  field: string,
  fail: (field: string, message: string) => never,
): ReserveOptions {
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    fail(field, `${field} must be an object { share } or { remaining }, ${got(value)}`);
  }
  for (const k of Object.keys(value)) {
    if (k !== "share" && k !== "remaining") {
      fail(`${field}.${k}`, unknownOption(field, k, ["share", "remaining"], field));
    }
  }
  const r = value as ReserveOptions;
  if ((r.share === undefined) === (r.remaining === undefined)) {
    fail(field, `${field} needs exactly one of share and remaining`);
  }
  if (r.share !== undefined && !(typeof r.share === "number" && r.share >= 0 && r.share <= 1)) {
    fail(`${field}.share`, `${field}.share must be a number from 0 to 1, ${got(r.share)}`);
  }
  if (
    r.remaining !== undefined &&
    typeof r.remaining !== "function" &&
    !(typeof r.remaining === "number" && Number.isFinite(r.remaining) && r.remaining >= 0)
  ) {
    fail(
      `${field}.remaining`,
      `${field}.remaining must be a finite number >= 0 or a function, ${got(r.remaining)}`,
    );
  }
  return r;
}
