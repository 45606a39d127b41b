import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { claimSlot, type HostState, pauseHost, refundSlot } from "../../src/algorithms/interval.js";
import {
  type BucketConfig,
  type BucketState,
  type MutableBucketState,
  penalize,
  penalizeInPlace,
  refund,
  refundInPlace,
  settle,
  settleInPlace,
  take,
  takeInPlace,
  tokensAt,
  waitMs,
} from "../../src/algorithms/token-bucket.js";

const c: BucketConfig = { capacity: 10, refillPerSecond: 2, recoveryMs: 1000 };
const at = (tokens: number, updatedAt = 0, factor = 1, penalizedAt = 0): BucketState => ({
  tokens,
  updatedAt,
  factor,
  penalizedAt,
});

describe("token bucket settle", () => {
  it("charges a higher actual cost at once, into debt below zero", () => {
    expect(settle(at(3), c, 5, false, 0)).toEqual(at(-2));
    expect(settle(at(3), c, 5, true, 0)).toEqual(at(-2));
  });

  it("makes later takes wait the debt out", () => {
    const s = settle(at(0), c, 4, false, 0)!;
    expect(take(s, c, 1, 0)).toBeUndefined();
    // -4 tokens plus 1 to take at 2 per second: 2.5 s.
    expect(waitMs(s, c, 1, 0)).toBe(2500);
    expect(take(s, c, 1, 2500)).toEqual(at(0, 2500));
  });

  it("gives a lower actual cost back only to the latest grant, never above capacity", () => {
    expect(settle(at(3), c, -2, true, 0)).toEqual(at(5));
    expect(settle(at(3), c, -2, false, 0)).toBeUndefined();
    expect(settle(at(9), c, -5, true, 0)).toEqual(at(10));
  });

  it("refills up to now first, and keeps the later update time on a clock that went back", () => {
    expect(settle(at(1, 0), c, 1, false, 1000)).toEqual(at(2, 1000));
    expect(settle(at(1, 1000), c, 1, false, 500)).toEqual(at(0, 1000));
  });
});

describe("in-place and returning forms agree", () => {
  const state = fc.record({
    tokens: fc.double({ min: -20, max: 10, noNaN: true }),
    updatedAt: fc.integer({ min: 0, max: 5000 }),
    factor: fc.constantFrom(1, 0.5, 0.25, 0.1),
    penalizedAt: fc.integer({ min: 0, max: 5000 }),
  });
  const now = fc.integer({ min: 0, max: 10_000 });

  it("take, refund, settle and penalize", () => {
    fc.assert(
      fc.property(state, now, fc.integer({ min: -5, max: 5 }), fc.boolean(), (s, t, n, latest) => {
        const copy = (): MutableBucketState => ({ ...s });
        const m = copy();
        const took = takeInPlace(m, c, Math.abs(n), t);
        expect(took ? m : undefined).toEqual(take(s, c, Math.abs(n), t));
        if (!took) expect(m).toEqual(s);
        const r = copy();
        refundInPlace(r, c, Math.abs(n), t);
        expect(r).toEqual(refund(s, c, Math.abs(n), t));
        expect(r.tokens).toBeLessThanOrEqual(c.capacity);
        const d = copy();
        const settled = settleInPlace(d, c, n, latest, t);
        expect(settled ? d : undefined).toEqual(settle(s, c, n, latest, t));
        if (settled)
          expect(d.tokens).toBe(n > 0 ? tokensAt(s, c, t) - n : Math.min(10, tokensAt(s, c, t) - n));
        const p = copy();
        const f = penalizeInPlace(p, c, 0.5, 0.1, t);
        expect(p).toEqual(penalize(s, c, 0.5, 0.1, t));
        expect(f).toBe(p.factor);
      }),
    );
  });
});

describe("interval host state", () => {
  it("claims a slot one spacing past the start and returns the one it replaced", () => {
    const h: HostState = { nextAt: 100, pausedUntil: Number.NEGATIVE_INFINITY };
    expect(claimSlot(h, 150, 40)).toBe(100);
    expect(h.nextAt).toBe(190);
  });

  it("pauses without ever moving the slot or the pause earlier", () => {
    const h: HostState = { nextAt: 500, pausedUntil: 0 };
    pauseHost(h, 100, 200);
    expect(h).toEqual({ nextAt: 500, pausedUntil: 300 });
    pauseHost(h, 100, 1000);
    expect(h).toEqual({ nextAt: 1100, pausedUntil: 1100 });
    pauseHost(h, 200, 10);
    expect(h).toEqual({ nextAt: 1100, pausedUntil: 1100 });
  });

  it("hands a slot back only while it is still the latest, and never inside a pause", () => {
    const h: HostState = { nextAt: 100, pausedUntil: Number.NEGATIVE_INFINITY };
    const previous = claimSlot(h, 100, 50);
    expect(refundSlot(h, 150, previous)).toBe(true);
    expect(h.nextAt).toBe(100);
    const again = claimSlot(h, 100, 50);
    claimSlot(h, 150, 50);
    expect(refundSlot(h, 150, again)).toBe(false);
    expect(h.nextAt).toBe(200);
    const last = claimSlot(h, 200, 50);
    pauseHost(h, 200, 30);
    expect(refundSlot(h, 250, last)).toBe(true);
    expect(h.nextAt).toBe(230);
  });
});

describe("token bucket edges", () => {
  it("takes a cost the bucket holds but for float error, leaving exactly zero, never a sliver of debt", () => {
    const s: MutableBucketState = { ...at(3 - 1e-10, 500) };
    expect(takeInPlace(s, c, 3, 500)).toBe(true);
    expect(s.tokens).toBe(0);
  });

  it("gives nothing back for a settle of the same cost on a grant that is not the latest", () => {
    const s: MutableBucketState = { ...at(4, 500) };
    expect(settleInPlace(s, c, 0, false, 500)).toBe(false);
    expect(s).toEqual(at(4, 500));
    expect(settleInPlace(s, c, 0, true, 500)).toBe(true);
    expect(s.tokens).toBe(4);
  });
});
