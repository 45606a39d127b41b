/**
 * Defaults of the stage options, one table read by the memory and the Redis stages alike, so
 * both backends fill an option left out with the same number. `src/options.ts` documents each.
 */
export const DEFAULTS = {
  /** Lease of a permit held on Redis (semaphore, queue, AIMD limiter), ms. */
  leaseMs: 30_000,
  tokenBucket: {
    penalty: {
      /** Rate multiplier a drop applies. */
      factor: 0.5,
      /** Lowest rate multiplier compounded penalties reach. */
      minFactor: 0.1,
      /** Milliseconds a penalised rate takes to climb back to full. */
      recoveryMs: 30_000,
    },
  },
  aimd: {
    /** Lowest limit. */
    min: 1,
    /** Multiplier of the limit on a drop. */
    backoffRatio: 0.9,
  },
  intervalGate: {
    /** Random extra spacing on top of `minIntervalMs`, ms. */
    jitterMs: 0,
  },
} as const;
