import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { afterPause, afterStart, delayMs, spacingMs } from "../../src/algorithms/interval.js";

describe("interval math", () => {
  it("spaces calls by minIntervalMs plus jitterMs times random", () => {
    const rows: Array<{ min: number; jitter: number; random: number; spacing: number }> = [
      { min: 100, jitter: 0, random: 0.7, spacing: 100 },
      { min: 100, jitter: 50, random: 0, spacing: 100 },
      { min: 100, jitter: 50, random: 0.5, spacing: 125 },
      { min: 100, jitter: 50, random: 0.2, spacing: 110 },
      { min: 0, jitter: 50, random: 0.5, spacing: 25 },
      { min: 0, jitter: 0, random: 0.5, spacing: 0 },
      { min: 2.5, jitter: 1, random: 0.5, spacing: 3 },
    ];
    for (const { min, jitter, random, spacing } of rows) {
      expect(spacingMs(min, jitter, random), `min ${min}, jitter ${jitter}, random ${random}`).toBeCloseTo(
        spacing,
        12,
      );
    }
  });

  it("treats a random outside [0, 1) as 0, so spacing never drops below minIntervalMs", () => {
    for (const random of [1, 1.5, -0.1, -1, Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY]) {
      expect(spacingMs(100, 50, random), `random ${random}`).toBe(100);
    }
  });

  it("keeps spacing within [minIntervalMs, minIntervalMs + jitterMs] for any random", () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 0, max: 100_000 }),
        fc.integer({ min: 0, max: 100_000 }),
        fc.oneof(fc.double({ min: 0, max: 1, maxExcluded: true, noNaN: true }), fc.double()),
        (min, jitter, random) => {
          const s = spacingMs(min, jitter, random);
          expect(s).toBeGreaterThanOrEqual(min);
          expect(s).toBeLessThanOrEqual(min + jitter);
        },
      ),
      { numRuns: 500 },
    );
  });

  it("counts the delay down to the next slot, then stays at 0", () => {
    // Next slot at 300 ms; time points every 100 ms.
    const rows: Array<[number, number]> = [
      [0, 300],
      [100, 200],
      [250, 50],
      [299, 1],
      [300, 0],
      [400, 0],
      [10_000, 0],
    ];
    for (const [now, delay] of rows) expect(delayMs(300, now), `at ${now}ms`).toBe(delay);
  });

  it("moves the next slot one spacing past the start", () => {
    expect(afterStart(0, 100)).toBe(100);
    expect(afterStart(1234, 0)).toBe(1234);
    expect(afterStart(1000, spacingMs(100, 40, 0.25))).toBe(1110);
  });

  describe("pause", () => {
    it("holds the host back for ms from now", () => {
      expect(afterPause(0, 100, 500)).toBe(600);
      expect(afterPause(150, 100, 500)).toBe(600);
    });

    it("never shortens the current spacing or an earlier pause", () => {
      // Next slot at 1000 ms; a pause that ends sooner changes nothing.
      const rows: Array<{ now: number; ms: number; next: number }> = [
        { now: 0, ms: 0, next: 1000 },
        { now: 0, ms: 999, next: 1000 },
        { now: 0, ms: 1000, next: 1000 },
        { now: 0, ms: 1001, next: 1001 },
        { now: 500, ms: 100, next: 1000 },
        { now: 500, ms: 600, next: 1100 },
      ];
      for (const { now, ms, next } of rows)
        expect(afterPause(1000, now, ms), `pause ${ms}ms at ${now}ms`).toBe(next);
    });

    it("makes a later slot than both the old one and now + ms, for any inputs", () => {
      fc.assert(
        fc.property(
          fc.integer({ min: 0, max: 1e9 }),
          fc.integer({ min: 0, max: 1e9 }),
          fc.integer({ min: 0, max: 1e6 }),
          (nextAt, now, ms) => {
            const next = afterPause(nextAt, now, ms);
            expect(next).toBeGreaterThanOrEqual(nextAt);
            expect(next).toBeGreaterThanOrEqual(now + ms);
            expect(next === nextAt || next === now + ms).toBe(true);
            expect(delayMs(next, now)).toBeGreaterThanOrEqual(ms);
          },
        ),
      );
    });

    it("adds to a delay a start has already set", () => {
      // A call starts at 0 with 100 ms spacing, then a pause of 250 ms arrives at 50 ms.
      const next = afterPause(afterStart(0, spacingMs(100, 0, 0)), 50, 250);
      expect(next).toBe(300);
      expect(delayMs(next, 50)).toBe(250);
      expect(delayMs(next, 200)).toBe(100);
    });
  });
});
