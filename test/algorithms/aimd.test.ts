import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { type AimdConfig, type AimdSample, type AimdState, aimdStep } from "../../src/algorithms/aimd.js";

const drop = (epoch: number, inFlight = 1): AimdSample => ({ dropped: true, inFlight, epoch });
const success = (inFlight: number, epoch = 0): AimdSample => ({ dropped: false, inFlight, epoch });

interface Row {
  name: string;
  config: AimdConfig;
  state: AimdState;
  sample: AimdSample;
  /** The next state, or "same" when the very same object must come back. */
  next: AimdState | "same";
}

const c: AimdConfig = { min: 2, max: 20, backoffRatio: 0.5 };

describe("AIMD step", () => {
  const rows: Row[] = [
    {
      name: "halves on a drop",
      config: c,
      state: { limit: 10, epoch: 0 },
      sample: drop(0),
      next: { limit: 5, epoch: 1 },
    },
    {
      name: "floors the product on a drop",
      config: c,
      state: { limit: 9, epoch: 3 },
      sample: drop(3),
      next: { limit: 4, epoch: 4 },
    },
    {
      name: "floors with a ratio of 0.9",
      config: { ...c, backoffRatio: 0.9 },
      state: { limit: 5, epoch: 0 },
      sample: drop(0),
      next: { limit: 4, epoch: 1 },
    },
    {
      name: "floors with a ratio of 0.75",
      config: { ...c, backoffRatio: 0.75 },
      state: { limit: 7, epoch: 0 },
      sample: drop(0),
      next: { limit: 5, epoch: 1 },
    },
    {
      name: "clamps a drop to min",
      config: c,
      state: { limit: 3, epoch: 0 },
      sample: drop(0),
      next: { limit: 2, epoch: 1 },
    },
    {
      name: "stays at min on a drop at min, and still starts a new epoch",
      config: c,
      state: { limit: 2, epoch: 0 },
      sample: drop(0),
      next: { limit: 2, epoch: 1 },
    },
    {
      name: "clamps a drop from above max to max",
      config: { ...c, backoffRatio: 0.9 },
      state: { limit: 30, epoch: 0 },
      sample: drop(0),
      next: { limit: 20, epoch: 1 },
    },
    {
      name: "ignores a drop from an older epoch",
      config: c,
      state: { limit: 10, epoch: 2 },
      sample: drop(1),
      next: "same",
    },
    {
      name: "adds one on a success with exactly half the limit in flight",
      config: c,
      state: { limit: 10, epoch: 1 },
      sample: success(5),
      next: { limit: 11, epoch: 1 },
    },
    {
      name: "adds one on a success with an odd limit and just over half in flight",
      config: c,
      state: { limit: 9, epoch: 0 },
      sample: success(5),
      next: { limit: 10, epoch: 0 },
    },
    {
      name: "adds one on a success with more than the limit in flight",
      config: c,
      state: { limit: 4, epoch: 0 },
      sample: success(6),
      next: { limit: 5, epoch: 0 },
    },
    {
      name: "keeps the limit on a success with less than half in flight",
      config: c,
      state: { limit: 10, epoch: 0 },
      sample: success(4),
      next: "same",
    },
    {
      name: "keeps the limit on a success with an odd limit and just under half in flight",
      config: c,
      state: { limit: 9, epoch: 0 },
      sample: success(4),
      next: "same",
    },
    {
      name: "keeps the limit on a success at max",
      config: c,
      state: { limit: 20, epoch: 0 },
      sample: success(20),
      next: "same",
    },
    {
      name: "does not push a limit above max higher on a success",
      config: c,
      state: { limit: 25, epoch: 0 },
      sample: success(25),
      next: "same",
    },
    {
      name: "ignores the epoch of a success",
      config: c,
      state: { limit: 10, epoch: 7 },
      sample: success(10, 0),
      next: { limit: 11, epoch: 7 },
    },
  ];

  it.each(rows)("$name", ({ config, state, sample, next }) => {
    const result = aimdStep(state, config, sample);
    if (next === "same") expect(result).toBe(state);
    else expect(result).toEqual(next);
  });

  it("decreases at most once per epoch: the other drops of a burst change nothing", () => {
    let s: AimdState = { limit: 16, epoch: 0 };
    const cut = aimdStep(s, c, drop(0, 16));
    expect(cut).toEqual({ limit: 8, epoch: 1 });
    s = cut;
    for (let i = 0; i < 5; i++) {
      const after = aimdStep(s, c, drop(0, 16 - i));
      expect(after).toBe(s);
    }
    // A call admitted after the cut can cut again.
    expect(aimdStep(s, c, drop(1))).toEqual({ limit: 4, epoch: 2 });
  });

  it("climbs by one per qualifying success and then holds at max", () => {
    const config: AimdConfig = { min: 1, max: 5, backoffRatio: 0.5 };
    let s: AimdState = { limit: 2, epoch: 0 };
    const limits: number[] = [];
    for (let i = 0; i < 6; i++) {
      s = aimdStep(s, config, success(s.limit));
      limits.push(s.limit);
    }
    expect(limits).toEqual([3, 4, 5, 5, 5, 5]);
  });

  it("keeps the limit in [min, max] and the epoch monotone under any samples", () => {
    const config = fc
      .record({
        min: fc.integer({ min: 1, max: 50 }),
        span: fc.integer({ min: 0, max: 50 }),
        ratio: fc.double({ min: 0.5, max: 1, maxExcluded: true, noNaN: true }),
      })
      .map(({ min, span, ratio }): AimdConfig => ({ min, max: min + span, backoffRatio: ratio }));
    const samples = fc.array(
      fc.record({ dropped: fc.boolean(), inFlight: fc.integer({ min: 0, max: 120 }), stale: fc.boolean() }),
      { maxLength: 60 },
    );
    fc.assert(
      fc.property(config, samples, (cfg, list) => {
        let s: AimdState = { limit: cfg.min, epoch: 0 };
        for (const { dropped, inFlight, stale } of list) {
          const epoch = stale ? s.epoch - 1 : s.epoch;
          const next = aimdStep(s, cfg, { dropped, inFlight, epoch });
          expect(Number.isInteger(next.limit)).toBe(true);
          expect(next.limit).toBeGreaterThanOrEqual(cfg.min);
          expect(next.limit).toBeLessThanOrEqual(cfg.max);
          expect(next.epoch).toBeGreaterThanOrEqual(s.epoch);
          if (dropped) {
            expect(next.limit).toBeLessThanOrEqual(s.limit);
            if (stale) expect(next).toBe(s);
            else expect(next.epoch).toBe(s.epoch + 1);
          } else {
            expect(next.epoch).toBe(s.epoch);
            expect(next.limit - s.limit).toBe(inFlight * 2 >= s.limit && s.limit < cfg.max ? 1 : 0);
            if (next.limit === s.limit) expect(next).toBe(s);
          }
          s = next;
        }
      }),
      { numRuns: 300 },
    );
  });
});
