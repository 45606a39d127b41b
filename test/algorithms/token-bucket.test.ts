import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  type BucketConfig,
  type BucketState,
  fullBucket,
  isIdle,
  lineTakeInPlace,
  type MutableBucketState,
  penalize,
  rateFactor,
  refund,
  take,
  tokensAt,
  waitMs,
} from "../../src/algorithms/token-bucket.js";

/** Tolerance `take` allows when it compares token counts. */
const EPSILON = 1e-9;

/** A bucket with `tokens` at `at`, never penalised. */
function bucket(tokens: number, at: number): BucketState {
  return { tokens, updatedAt: at, factor: 1, penalizedAt: at };
}

interface Row {
  /** Time point, in steps. */
  t: number;
  cost: number;
  /** Tokens held at `t`, before the take. */
  tokens: number;
  /** `waitMs` for `cost` at `t`. */
  wait: number;
  /** Whether `take` succeeds. */
  ok: boolean;
}

/**
 * Runs rows in order against one bucket: at each time point it checks the tokens held, the wait
 * for the row's cost and whether taking that cost succeeds, and carries the state forward.
 */
function runTable(c: BucketConfig, start: BucketState, step: number, rows: readonly Row[]): void {
  let s = start;
  rows.forEach((row, i) => {
    const now = row.t * step;
    const where = `row ${i} (t=${now}ms, cost=${row.cost})`;
    expect(tokensAt(s, c, now), where).toBeCloseTo(row.tokens, 9);
    expect(waitMs(s, c, row.cost, now), where).toBe(row.wait);
    const next = take(s, c, row.cost, now);
    expect(next !== undefined, where).toBe(row.ok);
    if (next) {
      expect(next.tokens, where).toBeGreaterThanOrEqual(0);
      s = next;
    }
  });
}

describe("token bucket math", () => {
  describe("a table of time points", () => {
    it("spends a burst, then refills one token per step up to capacity", () => {
      // capacity 3, 10 tokens/s: one token per 100 ms step.
      const c: BucketConfig = { capacity: 3, refillPerSecond: 10, recoveryMs: 1000 };
      runTable(c, fullBucket(3, 0), 100, [
        { t: 0, cost: 1, tokens: 3, wait: 0, ok: true },
        { t: 0, cost: 1, tokens: 2, wait: 0, ok: true },
        { t: 0, cost: 1, tokens: 1, wait: 0, ok: true },
        { t: 0, cost: 1, tokens: 0, wait: 100, ok: false },
        { t: 0.5, cost: 1, tokens: 0.5, wait: 50, ok: false },
        { t: 1, cost: 1, tokens: 1, wait: 0, ok: true },
        { t: 1, cost: 2, tokens: 0, wait: 200, ok: false },
        { t: 2.5, cost: 2, tokens: 1.5, wait: 50, ok: false },
        { t: 3, cost: 2, tokens: 2, wait: 0, ok: true },
        { t: 3, cost: 0, tokens: 0, wait: 0, ok: true },
        { t: 10, cost: 3, tokens: 3, wait: 0, ok: true }, // 7 steps refill only 3: capped
        { t: 10, cost: 3, tokens: 0, wait: 300, ok: false },
        { t: 11, cost: 3, tokens: 1, wait: 200, ok: false },
        { t: 13, cost: 3, tokens: 3, wait: 0, ok: true },
        { t: 13.5, cost: 1, tokens: 0.5, wait: 50, ok: false },
        { t: 14, cost: 1, tokens: 1, wait: 0, ok: true },
      ]);
    });

    it("refills at a fractional refillPerSecond", () => {
      // 0.5 tokens/s: one token per 2000 ms step.
      const c: BucketConfig = { capacity: 2, refillPerSecond: 0.5, recoveryMs: 1000 };
      runTable(c, bucket(0, 0), 2000, [
        { t: 0, cost: 1, tokens: 0, wait: 2000, ok: false },
        { t: 0.25, cost: 1, tokens: 0.25, wait: 1500, ok: false },
        { t: 0.75, cost: 1, tokens: 0.75, wait: 500, ok: false },
        { t: 1, cost: 1, tokens: 1, wait: 0, ok: true },
        { t: 1, cost: 2, tokens: 0, wait: 4000, ok: false },
        { t: 3, cost: 2, tokens: 2, wait: 0, ok: true },
        { t: 10, cost: 2, tokens: 2, wait: 0, ok: true },
      ]);
      // One millisecond short of the first token.
      expect(waitMs(bucket(0, 0), c, 1, 1999)).toBe(1);
      expect(take(bucket(0, 0), c, 1, 1999)).toBeUndefined();
    });

    it("rounds a wait at a rate that does not divide a second up to the next whole millisecond", () => {
      // 0.3 tokens/s: a token takes 3333.33… ms.
      const c: BucketConfig = { capacity: 1, refillPerSecond: 0.3, recoveryMs: 1000 };
      const s = bucket(0, 0);
      expect(waitMs(s, c, 1, 0)).toBe(3334);
      expect(tokensAt(s, c, 3333)).toBeLessThan(1);
      expect(take(s, c, 1, 3333)).toBeUndefined();
      expect(take(s, c, 1, 3334)).toBeDefined();
    });
  });

  describe("edges", () => {
    const c: BucketConfig = { capacity: 5, refillPerSecond: 10, recoveryMs: 1000 };

    it("refills nothing when the clock goes backwards", () => {
      const s = take(fullBucket(5, 1000), c, 5, 1000)!;
      expect(s.tokens).toBe(0);
      for (const now of [999, 500, 0, -1000]) expect(tokensAt(s, c, now)).toBe(0);
      expect(take(s, c, 1, 500)).toBeUndefined();
      // Refill resumes from the last update, not from the earlier reading.
      expect(tokensAt(s, c, 1100)).toBeCloseTo(1, 9);
    });

    it("keeps the later update time when a take or refund happens on a clock that went backwards", () => {
      const s = bucket(3, 1000);
      const taken = take(s, c, 2, 400)!;
      expect(taken).toMatchObject({ tokens: 1, updatedAt: 1000 });
      const refunded = refund(taken, c, 1, 400);
      expect(refunded).toMatchObject({ tokens: 2, updatedAt: 1000 });
      // Had updatedAt moved back to 400, this reading would refill 6 tokens instead of 1.
      expect(tokensAt(refunded, c, 1100)).toBeCloseTo(3, 9);
    });

    it("never goes negative, whatever the order of times", () => {
      fc.assert(
        fc.property(
          fc.array(
            fc.record({ now: fc.integer({ min: -1000, max: 5000 }), cost: fc.integer({ min: 0, max: 5 }) }),
            {
              maxLength: 30,
            },
          ),
          (steps) => {
            let s = fullBucket(5, 0);
            for (const { now, cost } of steps) {
              s = take(s, c, cost, now) ?? s;
              expect(s.tokens).toBeGreaterThanOrEqual(0);
              expect(tokensAt(s, c, now)).toBeGreaterThanOrEqual(0);
              expect(tokensAt(s, c, now)).toBeLessThanOrEqual(c.capacity);
            }
          },
        ),
        { numRuns: 200 },
      );
    });

    it("takes a cost equal to capacity from a full bucket and leaves it empty", () => {
      const s = take(fullBucket(5, 0), c, 5, 0);
      expect(s).toMatchObject({ tokens: 0, updatedAt: 0 });
      expect(waitMs(s!, c, 5, 0)).toBe(500);
      expect(take(s!, c, 5, 499)).toBeUndefined();
      expect(take(s!, c, 5, 500)).toMatchObject({ tokens: 0, updatedAt: 500 });
    });

    it("waits for ever (Infinity) for a cost above capacity, and never takes it", () => {
      const full = fullBucket(5, 0);
      expect(waitMs(full, c, 6, 0)).toBe(Number.POSITIVE_INFINITY);
      expect(waitMs(full, c, 6, 1e12)).toBe(Number.POSITIVE_INFINITY);
      expect(take(full, c, 6, 1e12)).toBeUndefined();
    });

    it("gives refunded tokens back, but never more than capacity", () => {
      const s = bucket(1, 0);
      expect(refund(s, c, 2, 0).tokens).toBe(3);
      expect(refund(s, c, 4, 0).tokens).toBe(5);
      expect(refund(s, c, 100, 0).tokens).toBe(5);
      expect(refund(fullBucket(5, 0), c, 1, 0).tokens).toBe(5);
      // Refill up to the refund time counts before the cap: 1 + 3 (300 ms) + 2 > 5.
      expect(refund(s, c, 2, 300)).toMatchObject({ tokens: 5, updatedAt: 300 });
    });

    it("calls a full, unpenalised bucket idle, and nothing else", () => {
      expect(isIdle(fullBucket(5, 0), c, 0)).toBe(true);
      const drained = take(fullBucket(5, 0), c, 1, 0)!;
      expect(isIdle(drained, c, 0)).toBe(false);
      expect(isIdle(drained, c, 99)).toBe(false);
      expect(isIdle(drained, c, 100)).toBe(true);
      const penalised = penalize(fullBucket(5, 0), c, 0.5, 0.1, 0);
      expect(penalised.tokens).toBe(5);
      expect(isIdle(penalised, c, 0)).toBe(false);
      expect(isIdle(penalised, c, 999)).toBe(false);
      expect(isIdle(penalised, c, 1000)).toBe(true);
    });
  });

  describe("penalty", () => {
    // 10 tokens/s (0.01 per ms), recovering over 1000 ms; capacity high enough not to cap.
    const c: BucketConfig = { capacity: 100, refillPerSecond: 10, recoveryMs: 1000 };
    const empty = take(fullBucket(100, 0), c, 100, 0)!;
    const halved = penalize(empty, c, 0.5, 0.1, 0);

    /**
     * Hand-computed: with factor 0.5 at t = 0 the rate multiplier is 0.5 + 0.5·x/1000, whose
     * integral from 0 to x (x <= 1000) is 0.5·x + x²/4000 effective ms; after 1000 ms it is
     * 750 + (x - 1000). Tokens are that times 0.01.
     */
    function expectedTokens(x: number): number {
      const effective = x <= 1000 ? 0.5 * x + (x * x) / 4000 : 750 + (x - 1000);
      return effective * 0.01;
    }

    it("multiplies the rate by the factor and keeps the tokens already held", () => {
      expect(halved).toEqual({ tokens: 0, updatedAt: 0, factor: 0.5, penalizedAt: 0 });
      const held = penalize(bucket(40, 0), c, 0.5, 0.1, 0);
      expect(held.tokens).toBe(40);
    });

    it("recovers the rate multiplier linearly to 1 over recoveryMs", () => {
      const rows: Array<[number, number]> = [
        [-100, 0.5],
        [0, 0.5],
        [250, 0.625],
        [500, 0.75],
        [750, 0.875],
        [999, 0.9995],
        [1000, 1],
        [5000, 1],
      ];
      for (const [now, factor] of rows)
        expect(rateFactor(halved, c, now), `at ${now}ms`).toBeCloseTo(factor, 12);
    });

    it("integrates the penalised rate exactly", () => {
      const rows: Array<[number, number]> = [
        [0, 0],
        [100, 0.525], // 50 + 2.5 effective ms
        [500, 3.125], // 250 + 62.5
        [1000, 7.5], // 500 + 250
        [1500, 12.5], // 750 + 500
        [3000, 27.5],
      ];
      for (const [now, tokens] of rows) {
        expect(tokensAt(halved, c, now), `at ${now}ms`).toBeCloseTo(tokens, 9);
        expect(expectedTokens(now)).toBeCloseTo(tokens, 9);
      }
    });

    it("integrates only from the last update when that falls inside the recovery", () => {
      // Spend what accrued by 500 ms, then read at 1000 and 2000 ms.
      const s = take(halved, c, tokensAt(halved, c, 500), 500)!;
      expect(s).toMatchObject({ tokens: 0, updatedAt: 500, factor: 0.5, penalizedAt: 0 });
      expect(tokensAt(s, c, 1000)).toBeCloseTo(expectedTokens(1000) - expectedTokens(500), 9); // 4.375
      expect(tokensAt(s, c, 2000)).toBeCloseTo(expectedTokens(2000) - expectedTokens(500), 9); // 14.375
    });

    it("compounds a second penalty on the current (partly recovered) rate, never below minFactor", () => {
      const again = penalize(halved, c, 0.5, 0.1, 500);
      expect(again.factor).toBeCloseTo(0.375, 12); // 0.75 at 500 ms, halved
      expect(again).toMatchObject({ penalizedAt: 500, updatedAt: 500 });
      expect(again.tokens).toBeCloseTo(3.125, 9);
      let s = halved;
      for (let i = 0; i < 10; i++) s = penalize(s, c, 0.5, 0.1, 0);
      expect(s.factor).toBe(0.1);
      expect(penalize(halved, c, 0.5, 0.4, 0).factor).toBe(0.4);
    });

    it("computes the wait under a penalty from the integral", () => {
      // cost 3: 0.5x + x²/4000 = 300 → x = (√8.8e6 − 2000)/2 ≈ 483.24
      // cost 5: 0.5x + x²/4000 = 500 → x = (√1.2e7 − 2000)/2 ≈ 732.05
      // cost 8: 800 effective ms > 750 → 1000 + 50
      const rows: Array<[number, number]> = [
        [0, 0],
        [3, 484],
        [5, 733],
        [7.5, 1000],
        [8, 1050],
      ];
      for (const [cost, wait] of rows) expect(waitMs(halved, c, cost, 0), `cost ${cost}`).toBe(wait);
      // At 300 ms, 1.725 tokens are there (0.5·300 + 300²/4000 = 172.5 effective ms), and the
      // cost-3 point is still at ≈ 483.24 ms from the penalty.
      expect(waitMs(halved, c, 3, 300)).toBe(184);
      expect(waitMs(halved, c, 3, 483)).toBe(1);
      expect(waitMs(halved, c, 3, 484)).toBe(0);
    });

    it("returns a wait after which the cost fits, and one millisecond short of which it does not", () => {
      const config = fc.record({
        capacity: fc.integer({ min: 1, max: 50 }),
        refillPerSecond: fc.constantFrom(0.3, 0.5, 1, 2.5, 10, 100),
        recoveryMs: fc.integer({ min: 1, max: 20_000 }),
      });
      const scenario = config.chain((cfg) =>
        fc.record({
          cfg: fc.constant(cfg),
          tokens: fc.integer({ min: 0, max: cfg.capacity }),
          factor: fc.constantFrom(0.05, 0.1, 0.25, 0.5, 0.9, 1),
          penalizedAgo: fc.integer({ min: 0, max: 25_000 }),
          sinceUpdate: fc.integer({ min: 0, max: 25_000 }),
          cost: fc.integer({ min: 1, max: cfg.capacity }),
        }),
      );
      fc.assert(
        fc.property(scenario, ({ cfg, tokens, factor, penalizedAgo, sinceUpdate, cost }) => {
          const s: BucketState = { tokens, updatedAt: penalizedAgo, factor, penalizedAt: 0 };
          const now = penalizedAgo + sinceUpdate;
          const w = waitMs(s, cfg, cost, now);
          expect(Number.isInteger(w)).toBe(true);
          expect(w).toBeGreaterThanOrEqual(0);
          expect(tokensAt(s, cfg, now + w) + EPSILON).toBeGreaterThanOrEqual(cost);
          expect(take(s, cfg, cost, now + w)).toBeDefined();
          if (w > 0) expect(tokensAt(s, cfg, now + w - 1)).toBeLessThan(cost);
        }),
        { numRuns: 500 },
      );
    });
  });
});

describe("a take from a bucket kept as of the end of its line (lineTakeInPlace)", () => {
  const c: BucketConfig = { capacity: 4, refillPerSecond: 2, recoveryMs: 10_000 };
  const at = (tokens: number, updatedAt: number): MutableBucketState => ({
    tokens,
    updatedAt,
    factor: 1,
    penalizedAt: 0,
  });

  it("takes at once when nobody is reserved and the tokens are there", () => {
    const s = at(3, 0);
    expect(lineTakeInPlace(s, c, 2, 1000, -1)).toEqual({ taken: 1, waitMs: 0 });
    expect(s).toEqual(at(2, 1000)); // 3 + 2 refilled, capped at 4, minus 2
  });

  it("takes tokens short of the cost by no more than float error at once", () => {
    const s = at(1 - EPSILON, 0);
    expect(lineTakeInPlace(s, c, 1, 0, -1)).toEqual({ taken: 1, waitMs: 0 });
    expect(s.tokens).toBe(0);
  });

  it("reserves a caller whose tokens are short for when they are there, taken as of then", () => {
    const s = at(0, 0);
    expect(lineTakeInPlace(s, c, 1, 0, -1)).toEqual({ taken: 2, waitMs: 500, fromMs: 0 });
    expect(s).toEqual(at(0, 500));
    // The next goes after it: the line's end is its start.
    expect(lineTakeInPlace(s, c, 3, 100, -1)).toEqual({ taken: 2, waitMs: 1900, fromMs: 400 });
    expect(s).toEqual(at(0, 2000));
  });

  it("reserves a caller behind the line even when the tokens are there at its end", () => {
    const s = at(2, 1000);
    expect(lineTakeInPlace(s, c, 1, 400, -1)).toEqual({ taken: 2, waitMs: 600, fromMs: 600 });
    expect(s).toEqual(at(1, 1000));
  });

  it("reserves nothing when the wait is longer than maxWaitMs, and reserves at exactly maxWaitMs", () => {
    const s = at(0, 0);
    expect(lineTakeInPlace(s, c, 2, 0, 999)).toEqual({ taken: 0, waitMs: 1000 });
    expect(s).toEqual(at(0, 0));
    expect(lineTakeInPlace(s, c, 2, 0, 1000)).toEqual({ taken: 2, waitMs: 1000, fromMs: 0 });
    // maxWaitMs 0 takes only what is there now.
    expect(lineTakeInPlace(at(1, 0), c, 1, 0, 0)).toEqual({ taken: 1, waitMs: 0 });
    expect(lineTakeInPlace(at(0.5, 0), c, 1, 0, 0)).toEqual({ taken: 0, waitMs: 250 });
  });

  it("waits whole milliseconds, at least 1, and a place begins no earlier than now (never -0)", () => {
    const fast: BucketConfig = { capacity: 1, refillPerSecond: 1e15, recoveryMs: 1 };
    const s = at(0, 10.5);
    const r = lineTakeInPlace(s, fast, 1, 10.5, -1);
    expect(r).toEqual({ taken: 2, waitMs: 1, fromMs: 0 });
    expect(Object.is((r as { fromMs: number }).fromMs, 0)).toBe(true);
    expect(s.updatedAt).toBe(11.5);
    // Behind a place that ends at a fraction of a millisecond: whole milliseconds from now.
    expect(lineTakeInPlace(s, fast, 1, 10.25, -1)).toEqual({ taken: 2, waitMs: 3, fromMs: 2 });
  });

  it("lets the refill up to a place's time be capped at capacity, as the bucket would", () => {
    const s = at(-10, 0); // a debt: the caller waits it out, then its tokens
    expect(lineTakeInPlace(s, c, 4, 0, -1)).toEqual({ taken: 2, waitMs: 7000, fromMs: 0 });
    expect(s).toEqual(at(0, 7000));
  });

  it("waits longer on a penalised bucket", () => {
    const s: MutableBucketState = { tokens: 0, updatedAt: 0, factor: 0.5, penalizedAt: 0 };
    const r = lineTakeInPlace(s, c, 1, 0, -1);
    expect(r.taken).toBe(2);
    expect(r.waitMs).toBeGreaterThan(500);
    expect(s.tokens).toBeGreaterThanOrEqual(0);
  });
});
