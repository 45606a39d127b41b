/**
 * Token bucket math. Functions of the state and `now` (milliseconds); no timers, no I/O. Each
 * change comes twice: `take`, `refund`, `settle` and `penalize` return a new state and leave theirs
 * alone; `takeInPlace`, `refundInPlace`, `settleInPlace` and `penalizeInPlace` update a state the
 * caller owns, allocating nothing (the memory stage's hot path). The Lua scripts
 * `lua/token-bucket-*.lua` port them; `test/algorithms/token-bucket.test.ts` checks the math, and
 * `test/redis/scripts.test.ts` and `test/redis/lua-twins.test.ts` check the ports step for step.
 *
 * A penalty (after a `dropped` outcome) multiplies the refill rate by `factor`, which then climbs
 * back linearly to 1 over `recoveryMs`. Refill integrates that rate exactly.
 */

export interface BucketState {
  /**
   * Tokens at `updatedAt`, at most `capacity`. Below zero only as a debt: a settle that charges a
   * call more than it was admitted at takes the difference at once, even past zero (see
   * `settle`). Refill pays a debt back like any shortfall, and until it has, no take succeeds.
   * A take or a refund never makes tokens negative.
   */
  readonly tokens: number;
  /** When `tokens` was computed. */
  readonly updatedAt: number;
  /** Rate multiplier right after the last penalty (1 when never penalised). */
  readonly factor: number;
  /** When the last penalty was applied. */
  readonly penalizedAt: number;
}

/** A bucket state its owner lets the `*InPlace` functions update. */
export interface MutableBucketState {
  tokens: number;
  updatedAt: number;
  factor: number;
  penalizedAt: number;
}

export interface BucketConfig {
  readonly capacity: number;
  readonly refillPerSecond: number;
  /** Milliseconds a penalised rate takes to climb back to full. */
  readonly recoveryMs: number;
}

/** A full, unpenalised bucket at `now`. */
export function fullBucket(capacity: number, now: number): BucketState {
  return { tokens: capacity, updatedAt: now, factor: 1, penalizedAt: now };
}

/** Rate multiplier at `now`: `factor` recovering linearly to 1 over `recoveryMs`. */
export function rateFactor(s: BucketState, c: BucketConfig, now: number): number {
  const x = now - s.penalizedAt;
  if (x <= 0) return s.factor;
  if (x >= c.recoveryMs) return 1;
  return s.factor + ((1 - s.factor) * x) / c.recoveryMs;
}

/** ∫ rateFactor dt from the last penalty to `penalizedAt + x` (x >= 0), in milliseconds. */
function factorIntegral(f0: number, recoveryMs: number, x: number): number {
  if (x <= 0) return 0;
  if (f0 >= 1) return x;
  if (x >= recoveryMs) return (recoveryMs * (1 + f0)) / 2 + (x - recoveryMs);
  return f0 * x + ((1 - f0) * x * x) / (2 * recoveryMs);
}

/**
 * Tokens held at `now`, refilled since `updatedAt` and capped at `capacity`. A clock that went
 * backwards refills nothing. A debt of -Infinity tokens (settles of Number.MAX_VALUE) refilled by
 * +Infinity (a refill of Number.MAX_VALUE per second) sums to NaN, which counts as full, as in
 * the Lua port, so no NaN ever reaches a decision.
 */
export function tokensAt(s: BucketState, c: BucketConfig, now: number): number {
  if (now <= s.updatedAt) return s.tokens;
  let effectiveMs: number;
  if (s.factor >= 1) {
    effectiveMs = now - s.updatedAt;
  } else {
    const from = Math.max(0, s.updatedAt - s.penalizedAt);
    effectiveMs =
      factorIntegral(s.factor, c.recoveryMs, now - s.penalizedAt) -
      factorIntegral(s.factor, c.recoveryMs, from);
  }
  const tokens = s.tokens + (effectiveMs * c.refillPerSecond) / 1000;
  if (tokens < c.capacity) return tokens;
  return c.capacity;
}

/** Tolerance for float error when comparing token counts. */
const EPSILON = 1e-9;
/** The longest wait a Redis script answers (2^53 - 1 ms, the largest integer it sends intact). */
const LONGEST_MS = 9007199254740991;

/**
 * Milliseconds from `now` until the bucket holds `cost` tokens (0 when it already does), rounded
 * up to a whole millisecond: at least 1 while tokens are short, however fast the refill, so a
 * waiter woken after it never finds them short again at the same instant. `Infinity` when `cost`
 * exceeds `capacity`.
 */
export function waitMs(s: BucketState, c: BucketConfig, cost: number, now: number): number {
  if (cost > c.capacity) return Number.POSITIVE_INFINITY;
  const tokens = tokensAt(s, c, now);
  const need = cost - tokens;
  if (need <= EPSILON) return 0;
  const needMs = (need * 1000) / c.refillPerSecond; // effective (full-rate) milliseconds required
  const t = Math.max(now, s.updatedAt);
  const x = t - s.penalizedAt;
  if (s.factor >= 1 || x >= c.recoveryMs) return Math.max(1, Math.ceil(needMs - EPSILON));
  // Effective milliseconds available before the rate is back to full.
  const f0 = s.factor;
  const r = c.recoveryMs;
  const at = Math.max(0, x);
  const before = factorIntegral(f0, r, r) - factorIntegral(f0, r, at);
  if (needMs > before) return Math.max(1, Math.ceil(r - at + (needMs - before) - EPSILON));
  // Solve f0*y + (1-f0)*y^2/(2r) = target for y = time since penalty.
  const target = factorIntegral(f0, r, at) + needMs;
  const a = (1 - f0) / (2 * r);
  const y = (-f0 + Math.sqrt(f0 * f0 + 4 * a * target)) / (2 * a);
  return Math.max(1, Math.ceil(y - at - EPSILON));
}

/**
 * Take `cost` tokens from `s` at `now`, in place: true when there were enough (within float
 * error; what is left is never below zero), false when not, and `s` is then left as it was.
 */
export function takeInPlace(s: MutableBucketState, c: BucketConfig, cost: number, now: number): boolean {
  const tokens = tokensAt(s, c, now);
  if (tokens + EPSILON < cost) return false;
  s.tokens = Math.max(0, tokens - cost);
  s.updatedAt = Math.max(s.updatedAt, now);
  return true;
}

/** The state after taking `cost` tokens at `now`, or `undefined` when there are not enough. */
export function take(s: BucketState, c: BucketConfig, cost: number, now: number): BucketState | undefined {
  const next: MutableBucketState = { ...s };
  return takeInPlace(next, c, cost, now) ? next : undefined;
}

/** What `lineTake` decided: taken now, reserved (go in `waitMs`), or refused (the wait is above `maxWaitMs`). */
export type LineTake =
  | { taken: 1; waitMs: 0 }
  | { taken: 2; waitMs: number; fromMs: number }
  | { taken: 0; waitMs: number };

/**
 * A take from a bucket kept as of the end of its line, as the Redis token bucket keeps it
 * (token-bucket-take): `updatedAt` is when the last reserved caller goes, ahead of `now` while
 * anyone is reserved, and `tokens` what is left then. A caller is taken now only when nobody is
 * reserved and its tokens are there. Otherwise it is reserved after the last, once the refill
 * from then has brought its tokens (taken as of that time, whole milliseconds from `now`, at
 * least 1), unless that is more than `maxWaitMs` (-1: no bound); then `s` is left as it was.
 * `fromMs`: when its place began (the caller before it goes, or now), whole ms from `now`.
 */
export function lineTakeInPlace(
  s: MutableBucketState,
  c: BucketConfig,
  cost: number,
  now: number,
  maxWaitMs: number,
): LineTake {
  const from = Math.max(now, s.updatedAt);
  const tokens = tokensAt(s, c, from);
  if (from === now && tokens + EPSILON >= cost) {
    s.tokens = Math.max(0, tokens - cost);
    s.updatedAt = now;
    return { taken: 1, waitMs: 0 };
  }
  const wait = Math.min(Math.max(1, Math.ceil(from + waitMs(s, c, cost, from) - now - EPSILON)), LONGEST_MS);
  if (maxWaitMs >= 0 && wait > maxWaitMs) return { taken: 0, waitMs: wait };
  const at = now + wait;
  s.tokens = Math.max(0, tokensAt(s, c, at) - cost);
  s.updatedAt = at;
  return { taken: 2, waitMs: wait, fromMs: Math.max(0, Math.ceil(from - now - EPSILON)) };
}

/** Give `cost` unused tokens back to `s` at `now`, in place (never above `capacity`). */
export function refundInPlace(s: MutableBucketState, c: BucketConfig, cost: number, now: number): void {
  s.tokens = Math.min(c.capacity, tokensAt(s, c, now) + cost);
  s.updatedAt = Math.max(s.updatedAt, now);
}

/** The state after giving `cost` unused tokens back at `now` (never above `capacity`). */
export function refund(s: BucketState, c: BucketConfig, cost: number, now: number): BucketState {
  const next: MutableBucketState = { ...s };
  refundInPlace(next, c, cost, now);
  return next;
}

/**
 * Settle a call admitted at an estimated cost that turned out to cost `delta` more, in place.
 * - `delta > 0`: the difference is charged at once, whatever the bucket holds: the tokens may go
 *   below zero, a debt that refill pays back before any take succeeds again. This is the only
 *   way a bucket goes into debt.
 * - `delta <= 0`: `-delta` tokens come back (never above `capacity`), but only when the call is
 *   still the bucket's `latest` grant; after another grant the refill the cap threw away cannot be
 *   told apart, so nothing comes back, lest the bucket end up fuller than if the right cost had
 *   been asked.
 * Returns false, `s` left as it was, only when nothing came back for not being the latest.
 */
export function settleInPlace(
  s: MutableBucketState,
  c: BucketConfig,
  delta: number,
  latest: boolean,
  now: number,
): boolean {
  const tokens = tokensAt(s, c, now);
  if (delta > 0) {
    s.tokens = tokens - delta;
  } else if (latest) {
    s.tokens = Math.min(c.capacity, tokens - delta);
  } else {
    return false;
  }
  s.updatedAt = Math.max(s.updatedAt, now);
  return true;
}

/** The state after `settleInPlace`, or `undefined` when nothing changed. */
export function settle(
  s: BucketState,
  c: BucketConfig,
  delta: number,
  latest: boolean,
  now: number,
): BucketState | undefined {
  const next: MutableBucketState = { ...s };
  return settleInPlace(next, c, delta, latest, now) ? next : undefined;
}

/**
 * Penalise `s` at `now`, in place: the current rate multiplier times `factor`, never below
 * `minFactor`. Tokens already in the bucket stay. Returns the new multiplier.
 */
export function penalizeInPlace(
  s: MutableBucketState,
  c: BucketConfig,
  factor: number,
  minFactor: number,
  now: number,
): number {
  const t = Math.max(now, s.updatedAt);
  const tokens = tokensAt(s, c, t);
  const next = Math.max(minFactor, Math.min(1, rateFactor(s, c, t) * factor));
  s.tokens = tokens;
  s.updatedAt = t;
  s.factor = next;
  s.penalizedAt = t;
  return next;
}

/**
 * The state after a penalty at `now`: the current rate multiplier times `factor`, never below
 * `minFactor`. Tokens already in the bucket stay.
 */
export function penalize(
  s: BucketState,
  c: BucketConfig,
  factor: number,
  minFactor: number,
  now: number,
): BucketState {
  const next: MutableBucketState = { ...s };
  penalizeInPlace(next, c, factor, minFactor, now);
  return next;
}

/** True when the bucket at `now` is indistinguishable from a fresh one: full and unpenalised. */
export function isIdle(s: BucketState, c: BucketConfig, now: number): boolean {
  return rateFactor(s, c, now) >= 1 && tokensAt(s, c, now) >= c.capacity;
}
