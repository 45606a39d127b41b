/**
 * Token bucket math. Pure functions of the state and `now` (milliseconds); no timers, no I/O.
 * `lua/token-bucket-take.lua` ports them, and `test/algorithms/token-bucket.test.ts` checks both.
 *
 * A penalty (after a `dropped` outcome) multiplies the refill rate by `factor`, which then climbs
 * back linearly to 1 over `recoveryMs`. Refill integrates that rate exactly.
 */

export interface BucketState {
  /** Tokens at `updatedAt`; negative never, at most `capacity`. */
  readonly tokens: number;
  /** When `tokens` was computed. */
  readonly updatedAt: number;
  /** Rate multiplier right after the last penalty (1 when never penalised). */
  readonly factor: number;
  /** When the last penalty was applied. */
  readonly penalizedAt: number;
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
  if (s.factor >= 1) return 1;
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

/** The state after taking `cost` tokens at `now`, or `undefined` when there are not enough. */
export function take(s: BucketState, c: BucketConfig, cost: number, now: number): BucketState | undefined {
  const tokens = tokensAt(s, c, now);
  if (tokens + EPSILON < cost) return undefined;
  return { ...s, tokens: Math.max(0, tokens - cost), updatedAt: Math.max(now, s.updatedAt) };
}

/** The state after giving `cost` unused tokens back at `now` (never above `capacity`). */
export function refund(s: BucketState, c: BucketConfig, cost: number, now: number): BucketState {
  const tokens = Math.min(c.capacity, tokensAt(s, c, now) + cost);
  return { ...s, tokens, updatedAt: Math.max(now, s.updatedAt) };
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
  const t = Math.max(now, s.updatedAt);
  const tokens = tokensAt(s, c, t);
  const next = Math.max(minFactor, Math.min(1, rateFactor(s, c, t) * factor));
  return { tokens, updatedAt: t, factor: next, penalizedAt: t };
}

/** True when the bucket at `now` is indistinguishable from a fresh one: full and unpenalised. */
export function isIdle(s: BucketState, c: BucketConfig, now: number): boolean {
  return rateFactor(s, c, now) >= 1 && tokensAt(s, c, now) >= c.capacity;
}
