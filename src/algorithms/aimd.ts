/**
 * AIMD (additive increase, multiplicative decrease) limit math, after Netflix's
 * concurrency-limits `AIMDLimit`. Pure: takes a state and a sample, returns the next state.
 */

export interface AimdState {
  /** Current limit, an integer in [min, max]. */
  readonly limit: number;
  /** Increments on every decrease; a sample admitted under an older epoch cannot decrease again. */
  readonly epoch: number;
}

export interface AimdConfig {
  readonly min: number;
  readonly max: number;
  /** Multiplier applied on a drop, in [0.5, 1). */
  readonly backoffRatio: number;
}

export interface AimdSample {
  /** The call was dropped (429, 503, timeout) or ran slower than `slowCallMs`. */
  readonly dropped: boolean;
  /** Calls in flight when the sample arrived, this one included. */
  readonly inFlight: number;
  /** The epoch when the call was admitted. */
  readonly epoch: number;
}

/**
 * The next state after one sample.
 * - A drop from a call admitted in the current epoch: `limit = max(min, floor(limit * ratio))`,
 *   and the epoch moves on, so the other drops of the same burst do not cut again.
 * - A success while at least half the limit is in use: `limit + 1`, capped at `max`.
 * - Anything else leaves the state unchanged (the same object is returned).
 */
export function aimdStep(s: AimdState, c: AimdConfig, sample: AimdSample): AimdState {
  if (sample.dropped) {
    if (sample.epoch !== s.epoch) return s;
    const limit = Math.max(c.min, Math.min(c.max, Math.floor(s.limit * c.backoffRatio)));
    return { limit, epoch: s.epoch + 1 };
  }
  if (sample.inFlight * 2 >= s.limit && s.limit < c.max) return { limit: s.limit + 1, epoch: s.epoch };
  return s;
}
