import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  type BucketClassLine,
  type BucketPick,
  bucketShares,
  chargeClass,
  classMaxCost,
  creditClass,
  guaranteeAt,
  ledgerIsFull,
  newLedger,
  nextBucketClass,
} from "../../src/algorithms/bucket-classes.js";
import type { ClassConfig } from "../../src/algorithms/classes.js";
import {
  type BucketConfig,
  fullBucket,
  type MutableBucketState,
  takeInPlace,
  tokensAt,
} from "../../src/algorithms/token-bucket.js";

const cls = (share: number, o: Partial<ClassConfig> = {}): ClassConfig => ({
  share,
  priority: 0,
  maxShare: 1,
  lendable: 1,
  ...o,
});

/** 100 tokens a second, 20 at most; interactive 80 (priority 1), bulk 20. */
const CONFIG: BucketConfig = { capacity: 20, refillPerSecond: 100, recoveryMs: 10_000 };
const TWO = [cls(80, { priority: 1 }), cls(20)];

/** Demand of one class: a call of `cost` always waiting from `from` to `to` (ms). */
interface Demand {
  cost: number;
  from?: number;
  to?: number;
}

/**
 * Run one bucket with classes for `ms`, every class with demand always having a head waiting
 * (a new one arriving as soon as the last is granted), stepping time by the wait each pick
 * returns. Returns the tokens each class got, and the admission times of each.
 */
function simulate(config: BucketConfig, classes: ClassConfig[], demand: (Demand | undefined)[], ms: number) {
  const shares = bucketShares(config, classes);
  const ledger = newLedger(shares, 0);
  const bucket: MutableBucketState = { ...fullBucket(config.capacity, 0) };
  const got = classes.map(() => 0);
  const times: number[][] = classes.map(() => []);
  let seq = 0;
  const lines: BucketClassLine[] = classes.map(() => ({ headCost: undefined, headAt: 0, headSince: 0 }));
  const out: BucketPick = { cls: -1, waitMs: 0 };
  let now = 0;
  const refresh = () => {
    demand.forEach((d, i) => {
      const wants = d !== undefined && now >= (d.from ?? 0) && now < (d.to ?? Number.POSITIVE_INFINITY);
      if (!wants) lines[i]!.headCost = undefined;
      else if (lines[i]!.headCost === undefined) {
        lines[i]!.headCost = d.cost;
        lines[i]!.headAt = ++seq;
        lines[i]!.headSince = now;
      }
    });
  };
  const edges = demand.flatMap((d) => (d ? [d.from ?? 0, d.to ?? Number.POSITIVE_INFINITY] : []));
  while (now < ms) {
    refresh();
    nextBucketClass(lines, ledger, shares, classes, bucket, config, now, out);
    if (out.cls >= 0) {
      const i = out.cls;
      const cost = lines[i]!.headCost!;
      expect(takeInPlace(bucket, config, cost, now), `take at ${now}`).toBe(true);
      chargeClass(ledger, shares, config, i, cost, now, lines[i]!.headSince);
      got[i]! += cost;
      times[i]!.push(now);
      lines[i]!.headCost = undefined;
      continue;
    }
    const next = Math.min(now + out.waitMs, ...edges.filter((e) => e > now), ms);
    now = next;
  }
  return { got, times, shares };
}

describe("bucketShares", () => {
  it("divides the refill and the capacity by share, with ceilings never below a share and kept tokens", () => {
    const s = bucketShares(CONFIG, [cls(3, { lendable: 0.5 }), cls(1, { maxShare: 0.1 })]);
    expect(s.rate).toEqual([75, 25]);
    expect(s.capacity).toEqual([15, 5]);
    expect(s.ceiling).toEqual([1, 0.25]);
    // Whole tokens: a quarter of 20 is 5 (more than a tenth's 2).
    expect(s.ceilingCapacity).toEqual([20, 5]);
    expect(s.kept).toEqual([7.5, 0]);
    expect(s.debt).toBe(20);
  });

  it("gives the largest cost a class can ever be admitted with: its ceiling's capacity", () => {
    const s = bucketShares(CONFIG, [cls(3), cls(1, { maxShare: 0.5 })]);
    expect(classMaxCost(s, 0)).toBe(20);
    expect(classMaxCost(s, 1)).toBe(10);
  });
});

describe("the ledger", () => {
  it("refills each guarantee at its class's rate up to its capacity, and never back in time", () => {
    const s = bucketShares(CONFIG, TWO);
    const l = newLedger(s, 1000);
    chargeClass(l, s, CONFIG, 1, 4, 1000);
    expect(guaranteeAt(l, s, 1, 1000)).toBe(0);
    expect(guaranteeAt(l, s, 1, 1100)).toBeCloseTo(2);
    expect(guaranteeAt(l, s, 1, 5000)).toBe(4);
    expect(guaranteeAt(l, s, 1, 900)).toBe(0);
  });

  it("never goes below zero, whatever a class borrowed, and takes back up to its capacity", () => {
    const s = bucketShares(CONFIG, TWO);
    const l = newLedger(s, 0);
    for (let k = 0; k < 10; k++) chargeClass(l, s, CONFIG, 1, 5, 0);
    expect(guaranteeAt(l, s, 1, 0)).toBe(0);
    // Owed again (a head of 1) after 1 ÷ 20 s.
    expect(guaranteeAt(l, s, 1, 50, 1)).toBeCloseTo(1);
    creditClass(l, s, CONFIG, 1, 3, 0);
    expect(guaranteeAt(l, s, 1, 0)).toBe(3);
    creditClass(l, s, CONFIG, 1, 100, 0);
    expect(guaranteeAt(l, s, 1, 0)).toBe(4);
  });

  it("refills nothing for a clock that went back, and never moves a class's time back", () => {
    const s = bucketShares(CONFIG, TWO);
    const l = newLedger(s, 0);
    chargeClass(l, s, CONFIG, 1, 4, 1000);
    chargeClass(l, s, CONFIG, 1, 0, 500);
    expect(guaranteeAt(l, s, 1, 500)).toBe(0);
    // Had the charge at 500 moved the class's time back, 1000 would read 10 tokens refilled.
    expect(guaranteeAt(l, s, 1, 1000)).toBe(0);
    expect(guaranteeAt(l, s, 1, 1050)).toBeCloseTo(1);
  });

  it("credits up to its capacity, or its capacity plus the head's cost while one waits; the ceiling up to its own", () => {
    const s = bucketShares(CONFIG, [cls(3), cls(1, { maxShare: 0.5 })]);
    const l = newLedger(s, 0);
    creditClass(l, s, CONFIG, 1, 3, 0, 2);
    expect(guaranteeAt(l, s, 1, 0, 2)).toBe(7);
    chargeClass(l, s, CONFIG, 1, 10, 0);
    expect(guaranteeAt(l, s, 1, 0)).toBe(0);
    creditClass(l, s, CONFIG, 1, 4, 0);
    // The ceiling (10 tokens) was charged 10 and got 4 back: a head of 5 is skipped, one of 4 is not.
    const lines: BucketClassLine[] = [
      { headCost: undefined, headAt: 0, headSince: 0 },
      { headCost: 5, headAt: 1, headSince: 0 },
    ];
    const out: BucketPick = { cls: -1, waitMs: 0 };
    const bucket = fullBucket(20, 0);
    nextBucketClass(lines, l, s, [cls(3), cls(1, { maxShare: 0.5 })], bucket, CONFIG, 0, out);
    expect(out).toEqual({ cls: -1, waitMs: 20 });
    lines[1]!.headCost = 4;
    nextBucketClass(lines, l, s, [cls(3), cls(1, { maxShare: 0.5 })], bucket, CONFIG, 0, out);
    expect(out.cls).toBe(1);
    creditClass(l, s, CONFIG, 1, 100, 0);
    expect(ledgerIsFull(l, s, CONFIG, 0)).toBe(true);
  });

  it("is full again, like a fresh one, once every class has refilled", () => {
    const s = bucketShares(CONFIG, [cls(1), cls(1, { maxShare: 0.5 })]);
    const l = newLedger(s, 0);
    expect(ledgerIsFull(l, s, CONFIG, 0)).toBe(true);
    chargeClass(l, s, CONFIG, 1, 10, 0);
    expect(ledgerIsFull(l, s, CONFIG, 100)).toBe(false);
    // Guarantee: 10 at 50/s is 200 ms; ceiling: 10 at 50/s, 200 ms too.
    expect(ledgerIsFull(l, s, CONFIG, 199)).toBe(false);
    expect(ledgerIsFull(l, s, CONFIG, 200)).toBe(true);
    // A guarantee short by a hair, or a ceiling, each keeps it from being full.
    const g = newLedger(s, 0);
    chargeClass(g, s, CONFIG, 0, 1, 0);
    // One token at 50/s: 20 ms.
    expect(ledgerIsFull(g, s, CONFIG, 19)).toBe(false);
    expect(ledgerIsFull(g, s, CONFIG, 20)).toBe(true);
    const c = newLedger(s, 0);
    chargeClass(c, s, CONFIG, 1, 1, 0);
    creditClass(c, s, CONFIG, 1, 1, 0);
    expect(ledgerIsFull(c, s, CONFIG, 0)).toBe(true);
    c.ceiling[1] = 9;
    expect(ledgerIsFull(c, s, CONFIG, 0)).toBe(false);
  });
});

describe("nextBucketClass", () => {
  const pick = (
    lines: BucketClassLine[],
    classes: ClassConfig[],
    tokens: number,
    setUp: (l: ReturnType<typeof newLedger>, s: ReturnType<typeof bucketShares>) => void = () => {},
  ) => {
    const s = bucketShares(CONFIG, classes);
    const l = newLedger(s, 0);
    setUp(l, s);
    return nextBucketClass(lines, l, s, classes, { ...fullBucket(20, 0), tokens }, CONFIG, 0, {
      cls: -1,
      waitMs: 0,
    });
  };
  const line = (headCost: number | undefined, headAt = 0): BucketClassLine => ({
    headCost,
    headAt,
    headSince: 0,
  });

  it.each([
    // [what, interactive head, bulk head, bucket tokens, set-up, class, wait ms]
    ["nobody waits", undefined, undefined, 20, undefined, -1, Number.POSITIVE_INFINITY],
    ["bulk alone, tokens there", undefined, 1, 20, undefined, 1, 0],
    ["bulk alone, the bucket empty: one token at 100/s", undefined, 1, 0, undefined, -1, 10],
    ["both owed: the earlier head", 1, 1, 5, "bulk first", 1, 0],
    ["interactive owed, bulk borrowed: interactive, whoever came first", 1, 1, 5, "bulk borrowed", 0, 0],
    ["an owed head that does not fit blocks the borrower behind it", 5, 1, 3, "bulk borrowed", -1, 20],
  ] as const)("%s", (_what, i, b, tokens, setUp, expected, wait) => {
    const lines = [line(i, setUp === "bulk first" ? 2 : 1), line(b, setUp === "bulk first" ? 1 : 2)];
    const p = pick(lines, TWO, tokens, (l) => {
      // Bulk has drawn its whole guarantee (borrowing): its ledger is empty.
      if (setUp === "bulk borrowed") l.guarantee[1] = 0;
    });
    expect(p.cls).toBe(expected);
    expect(p.waitMs).toBe(wait);
  });

  it("orders heads the same whichever class is declared first", () => {
    // Both owed: the earlier head, here the first class's.
    expect(pick([line(1, 1), line(1, 2)], TWO, 5).cls).toBe(0);
    // Both borrowing, the higher priority declared second: it goes first.
    const lowFirst = [cls(20), cls(80, { priority: 1 })];
    const borrowing = (l: ReturnType<typeof newLedger>) => {
      l.guarantee[0] = 0;
      l.guarantee[1] = 0;
    };
    expect(pick([line(1, 1), line(1, 2)], lowFirst, 5, borrowing).cls).toBe(1);
    // Same priority, both borrowing: the earlier head.
    const same = [cls(20), cls(80)];
    expect(pick([line(1, 2), line(1, 1)], same, 5, borrowing).cls).toBe(1);
    expect(pick([line(1, 1), line(1, 2)], same, 5, borrowing).cls).toBe(0);
    // An owed class declared second goes before a borrower declared first.
    expect(
      pick([line(1, 1), line(1, 2)], same, 5, (l) => {
        l.guarantee[0] = 0;
      }).cls,
    ).toBe(1);
  });

  it("a borrower does not leave room for the kept part of its own guarantee", () => {
    // Bulk keeps half of its 4 (2) but is borrowing, with 1 left in its ledger; interactive idle
    // and lending all: bulk's head of 2 needs 2 tokens, not 2 + its own 1.
    const classes = [cls(80), cls(20, { lendable: 0.5 })];
    const bulkHasOne = (l: ReturnType<typeof newLedger>) => {
      l.guarantee[1] = 1;
    };
    expect(pick([line(undefined), line(2)], classes, 2, bulkHasOne).cls).toBe(1);
  });

  it("among borrowers the higher priority goes first, whoever came first", () => {
    const p = pick([line(1, 2), line(1, 1)], TWO, 5, (l) => {
      l.guarantee[0] = 0;
      l.guarantee[1] = 0;
    });
    expect(p.cls).toBe(0);
  });

  it("a borrower leaves what an idle class keeps (lendable below 1), an owed head does not look at it", () => {
    const classes = [cls(80, { lendable: 0.5 }), cls(20)];
    // Interactive keeps 8 of its 16; bulk has borrowed, so it needs 1 + 8 tokens.
    const borrowed = (l: ReturnType<typeof newLedger>) => {
      l.guarantee[1] = 0;
    };
    expect(pick([line(undefined), line(1)], classes, 8, borrowed)).toEqual({ cls: -1, waitMs: 10 });
    expect(pick([line(undefined), line(1)], classes, 9, borrowed).cls).toBe(1);
    // Bulk owed (nothing drawn): it goes with 1 token.
    expect(pick([line(undefined), line(1)], classes, 1).cls).toBe(1);
  });

  it("skips a head past its ceiling, and says when it can go", () => {
    const classes = [cls(1), cls(1, { maxShare: 0.5 })];
    const p = pick([line(undefined), line(2)], classes, 20, (l, s) => chargeClass(l, s, CONFIG, 1, 10, 0));
    // Ceiling ledger 0 of 10, refilled at 50/s: 2 tokens in 40 ms.
    expect(p).toEqual({ cls: -1, waitMs: 40 });
    const q = pick([line(1, 2), line(2, 1)], classes, 20, (l, s) => chargeClass(l, s, CONFIG, 1, 10, 0));
    expect(q.cls).toBe(0);
  });

  it("counts a head costing more than its class's capacity as owed once the waiting class's ledger has refilled to its cost", () => {
    // Bulk's capacity is 4: fresh, a head of 6 is not owed yet, so interactive's head goes first.
    expect(pick([line(1, 1), line(6, 0)], TWO, 20).cls).toBe(0);
    // Alone it borrows.
    expect(pick([line(undefined), line(6)], TWO, 20).cls).toBe(1);
    // While it waits, its ledger refills past its capacity, up to 4 + 6: owed after 100 ms at 20/s.
    const s = bucketShares(CONFIG, TWO);
    const l = newLedger(s, 0);
    const out: BucketPick = { cls: -1, waitMs: 0 };
    const lines = [line(1, 1), line(6, 0)];
    const bucket = { ...fullBucket(20, 0), tokens: 20 };
    expect(nextBucketClass(lines, l, s, TWO, bucket, CONFIG, 99, out).cls).toBe(0);
    expect(nextBucketClass(lines, l, s, TWO, bucket, CONFIG, 100, out).cls).toBe(1);
  });

  it("never says to wait past a moment when some head could go (random lines and ledgers)", () => {
    fc.assert(
      fc.property(
        fc.array(
          fc.record({
            share: fc.integer({ min: 1, max: 10 }),
            priority: fc.integer({ min: -1, max: 1 }),
            maxShare: fc.constantFrom(0.25, 0.5, 1),
            lendable: fc.constantFrom(0, 0.5, 1),
            head: fc.option(fc.integer({ min: 1, max: 5 }), { nil: undefined }),
            drawn: fc.integer({ min: 0, max: 40 }),
          }),
          { minLength: 1, maxLength: 4 },
        ),
        fc.integer({ min: 0, max: 20 }),
        (rows, tokens) => {
          const classes = rows.map((r) => cls(r.share, r));
          const s = bucketShares(CONFIG, classes);
          const l = newLedger(s, 0);
          rows.forEach((r, i) => {
            if (r.head !== undefined && r.head > classMaxCost(s, i)) r.head = undefined;
            chargeClass(l, s, CONFIG, i, r.drawn, 0);
          });
          const lines = rows.map((r, i) => ({ headCost: r.head, headAt: i, headSince: 0 }));
          const bucket = { ...fullBucket(20, 0), tokens };
          const out: BucketPick = { cls: -1, waitMs: 0 };
          nextBucketClass(lines, l, s, classes, bucket, CONFIG, 0, out);
          if (out.cls >= 0) {
            expect(tokensAt(bucket, CONFIG, 0) + 1e-9).toBeGreaterThanOrEqual(lines[out.cls]!.headCost!);
            return;
          }
          if (lines.every((x) => x.headCost === undefined)) {
            expect(out.waitMs).toBe(Number.POSITIVE_INFINITY);
            return;
          }
          expect(out.waitMs).toBeGreaterThanOrEqual(1);
          expect(Number.isFinite(out.waitMs)).toBe(true);
          const probe: BucketPick = { cls: -1, waitMs: 0 };
          for (let t = 1; t < Math.min(out.waitMs, 400); t++) {
            expect(nextBucketClass(lines, l, s, classes, bucket, CONFIG, t, probe).cls, `at ${t}`).toBe(-1);
          }
        },
      ),
      { numRuns: 300 },
    );
  });
});

describe("classes sharing a bucket over time", () => {
  it("bulk alone gets the whole bucket: its capacity, then the whole refill", () => {
    const { got } = simulate(CONFIG, TWO, [undefined, { cost: 1 }], 10_000);
    // 20 at once, then 100 a second for 10 s (the last token falls at 10 000 ms, not counted).
    expect(got[1]).toBeGreaterThanOrEqual(20 + 999);
    expect(got[1]).toBeLessThanOrEqual(20 + 1000);
  });

  it("interactive alone likewise", () => {
    const { got } = simulate(CONFIG, TWO, [{ cost: 1 }, undefined], 10_000);
    expect(got[0]).toBeGreaterThanOrEqual(1019);
  });

  it("bulk saturating, then interactive arrives: interactive's first call goes within one token's refill", () => {
    const { times } = simulate(CONFIG, TWO, [{ cost: 1, from: 5_000 }, { cost: 1 }], 6_000);
    expect(times[0]![0]! - 5_000).toBeLessThanOrEqual(10);
  });

  it("both saturating: each gets at least its share of the refill, the rest to the higher priority", () => {
    const { got } = simulate(CONFIG, TWO, [{ cost: 1 }, { cost: 1 }], 10_000);
    // Shares of 100/s: 80 and 20, over 10 s (plus the first burst).
    expect(got[0]).toBeGreaterThanOrEqual(800 - 2);
    expect(got[1]).toBeGreaterThanOrEqual(200 - 2);
    expect(got[0]! + got[1]!).toBeLessThanOrEqual(20 + 1000);
  });

  it("a class that borrowed while the other was idle keeps its share when the other comes back", () => {
    const { times } = simulate(CONFIG, TWO, [{ cost: 1, from: 5_000 }, { cost: 1 }], 10_000);
    // From 5 s on: bulk at least 20 a second, from the first 50 ms.
    const after = times[1]!.filter((t) => t >= 5_000);
    expect(after.length).toBeGreaterThanOrEqual(100 - 2);
    expect(after[0]! - 5_000).toBeLessThanOrEqual(60);
  });

  it("a low priority still gets its share under a flood of a higher one", () => {
    const classes = [cls(1, { priority: 5 }), cls(1, { priority: 0 }), cls(2, { priority: 9 })];
    const { got } = simulate(CONFIG, classes, [{ cost: 1 }, { cost: 1 }, { cost: 1 }], 10_000);
    expect(got[1]).toBeGreaterThanOrEqual(250 - 2);
    expect(got[0]).toBeGreaterThanOrEqual(250 - 2);
    expect(got[2]).toBeGreaterThanOrEqual(500 - 2);
  });

  it("a cost larger than a class's capacity still gets the class its share of the refill", () => {
    // Bulk's capacity is 4; its calls cost 10. Its share is 20 a second: 400 in 20 s.
    const { got } = simulate(CONFIG, TWO, [{ cost: 1 }, { cost: 10 }], 20_000);
    expect(got[1]).toBeGreaterThanOrEqual(400 - 10);
    expect(got[0]).toBeGreaterThanOrEqual(80 * 20 - 10);
  });

  it("with lendable 0.5, bulk alone still gets the whole refill, leaving interactive's kept tokens in the bucket", () => {
    const classes = [cls(80, { lendable: 0.5, priority: 1 }), cls(20)];
    const { got, times } = simulate(
      CONFIG,
      classes,
      [{ cost: 1, from: 5_000, to: 5_001 }, { cost: 1 }],
      10_000,
    );
    // Interactive's calls at 5 000 ms found its 8 kept tokens there, and the one refilled
    // meanwhile: they all went at once.
    expect(times[0]!.every((t) => t === 5_000)).toBe(true);
    expect(got[0]).toBeGreaterThanOrEqual(8);
    // Bulk: the bucket's 20 less the 8 interactive keeps, then the refill, less what
    // interactive took.
    expect(got[1]).toBeGreaterThanOrEqual(12 + 999 - got[0]!);
  });

  it("a class with a ceiling never passes it, and the others take the rest", () => {
    const classes = [cls(1), cls(1, { maxShare: 0.5 })];
    const { got } = simulate(CONFIG, classes, [undefined, { cost: 1 }], 10_000);
    // Ceiling: half of the refill and of the capacity.
    expect(got[1]).toBeLessThanOrEqual(10 + 500);
    expect(got[1]).toBeGreaterThanOrEqual(10 + 499);
    const both = simulate(CONFIG, classes, [{ cost: 1 }, { cost: 1 }], 10_000);
    expect(both.got[0]! + both.got[1]!).toBeGreaterThanOrEqual(20 + 999);
  });
});
