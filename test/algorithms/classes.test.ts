import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  type ClassConfig,
  type ClassLine,
  guarantees,
  nextClass,
  reclaimPlan,
} from "../../src/algorithms/classes.js";

const cls = (share: number, priority = 0, maxShare = 1, lendable = 1): ClassConfig => ({
  share,
  priority,
  maxShare,
  lendable,
});
const idle = (used: number): ClassLine => ({ used, headCost: undefined, headAt: 0 });
const line = (used: number, headCost: number, headAt: number): ClassLine => ({ used, headCost, headAt });

describe("guarantees", () => {
  const rows: {
    name: string;
    limit: number;
    classes: ClassConfig[];
    guarantee: number[];
    ceiling: number[];
  }[] = [
    { name: "80 / 20 of 10", limit: 10, classes: [cls(80), cls(20)], guarantee: [8, 2], ceiling: [10, 10] },
    {
      name: "shares are weights, not fractions",
      limit: 10,
      classes: [cls(4), cls(1)],
      guarantee: [8, 2],
      ceiling: [10, 10],
    },
    {
      name: "the leftover goes to the largest remainder",
      limit: 10,
      classes: [cls(1), cls(1), cls(1)],
      guarantee: [4, 3, 3],
      ceiling: [10, 10, 10],
    },
    {
      name: "equal remainders: the earlier class",
      limit: 16,
      classes: [cls(1), cls(1), cls(1)],
      guarantee: [6, 5, 5],
      ceiling: [16, 16, 16],
    },
    {
      name: "the largest remainder wins over the earlier class",
      limit: 10,
      classes: [cls(0.33), cls(0.67)],
      guarantee: [3, 7],
      ceiling: [10, 10],
    },
    {
      name: "three leftovers on equal remainders go to the earliest three",
      limit: 7,
      classes: [cls(1), cls(1), cls(1), cls(1)],
      guarantee: [2, 2, 2, 1],
      ceiling: [7, 7, 7, 7],
    },
    {
      name: "the leftover goes to the largest fraction, not the largest class",
      limit: 5,
      classes: [cls(0.62), cls(0.38)],
      guarantee: [3, 2],
      ceiling: [5, 5],
    },
    {
      name: "at least one each",
      limit: 10,
      classes: [cls(99), cls(1)],
      guarantee: [10, 1],
      ceiling: [10, 10],
    },
    {
      name: "a limit below the number of classes: one each, overlapping",
      limit: 1,
      classes: [cls(9), cls(1)],
      guarantee: [1, 1],
      ceiling: [1, 1],
    },
    {
      name: "maxShare caps what a class may borrow, rounded down",
      limit: 10,
      classes: [cls(5, 0, 0.75), cls(5, 0, 0.5)],
      guarantee: [5, 5],
      ceiling: [7, 5],
    },
    {
      name: "a ceiling never below the guarantee",
      limit: 10,
      classes: [cls(8, 0, 0.1), cls(2)],
      guarantee: [8, 2],
      ceiling: [8, 10],
    },
    { name: "one class has it all", limit: 5, classes: [cls(1)], guarantee: [5], ceiling: [5] },
  ];
  it.each(rows)("$name", ({ limit, classes, guarantee, ceiling }) => {
    // Everything lendable (the default): nothing kept.
    expect(guarantees(limit, classes)).toEqual({ guarantee, ceiling, kept: guarantee.map(() => 0) });
  });

  it("keeps what a class does not lend, rounded up to whole permits", () => {
    const b = guarantees(10, [cls(6, 0, 1, 0.5), cls(3, 0, 1, 0), cls(1, 0, 1, 0.99)]);
    expect(b.guarantee).toEqual([6, 3, 1]);
    expect(b.kept).toEqual([3, 3, 1]);
  });

  it("sums to the limit (or the number of classes) and gives each at least one and its whole part", () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 1, max: 1000 }),
        fc.array(fc.integer({ min: 1, max: 100 }), { minLength: 1, maxLength: 6 }),
        (limit, shares) => {
          const { guarantee, ceiling } = guarantees(
            limit,
            shares.map((s) => cls(s)),
          );
          const sum = guarantee.reduce((a, b) => a + b, 0);
          const total = shares.reduce((a, b) => a + b, 0);
          if (limit >= shares.length) expect(sum).toBeGreaterThanOrEqual(limit);
          expect(sum).toBeLessThanOrEqual(limit + shares.length);
          shares.forEach((s, i) => {
            const exact = (limit * s) / total;
            expect(guarantee[i]).toBeGreaterThanOrEqual(Math.max(1, Math.floor(exact)));
            expect(guarantee[i]).toBeLessThanOrEqual(Math.max(1, Math.floor(exact) + 1));
            expect(ceiling[i]).toBe(limit);
          });
          // Without the floor of one, the guarantees sum to the limit exactly.
          if (guarantee.every((g, i) => g > 1 || Math.floor((limit * shares[i]!) / total) >= 1)) {
            expect(sum).toBe(limit);
          }
        },
      ),
    );
  });
});

it("never lowers a ceiling as the limit grows, so a cost that fits at min fits above it", () => {
  fc.assert(
    fc.property(
      fc.array(
        fc.record({
          share: fc.integer({ min: 1, max: 50 }),
          priority: fc.constant(0),
          maxShare: fc.constantFrom(0.05, 0.1, 0.3, 1),
          lendable: fc.constant(1),
        }),
        { minLength: 1, maxLength: 5 },
      ),
      fc.integer({ min: 1, max: 60 }),
      (classes, limit) => {
        const now = guarantees(limit, classes);
        const next = guarantees(limit + 1, classes);
        classes.forEach((_, i) => {
          expect(next.ceiling[i]).toBeGreaterThanOrEqual(now.ceiling[i]!);
          expect(now.ceiling[i]).toBeGreaterThanOrEqual(now.guarantee[i]!);
        });
      },
    ),
  );
});

it("keeps a ceiling at the exact portion rounded up, not at a guarantee the leftovers raised", () => {
  // 10 × 1/3 = 3.33…: guarantees 4, 3, 3; with a tiny maxShare each may hold its portion rounded up.
  const tiny = { share: 1, priority: 0, maxShare: 0.01, lendable: 1 };
  expect(guarantees(10, [tiny, tiny, tiny])).toMatchObject({ guarantee: [4, 3, 3], ceiling: [4, 4, 4] });
  // An exact portion stays exact despite float error: 10 × 0.7 / (0.1 + 0.2 + 0.7).
  expect(guarantees(10, [cls(0.1, 0, 0.01), cls(0.2, 0, 0.01), cls(0.7, 0, 0.01)]).ceiling).toEqual([
    1, 2, 7,
  ]);
});

describe("nextClass", () => {
  // Interactive (share 8, priority 1) and bulk (share 2) on a limit of 10.
  const two = [cls(8, 1), cls(2)];
  const b2 = guarantees(10, two);
  const rows: { name: string; lines: ClassLine[]; free: number; next: number; classes?: ClassConfig[] }[] = [
    { name: "nobody waits", lines: [idle(0), idle(0)], free: 10, next: -1 },
    { name: "bulk alone borrows the whole limit", lines: [idle(0), line(9, 1, 5)], free: 1, next: 1 },
    { name: "interactive alone takes it all", lines: [line(9, 1, 5), idle(0)], free: 1, next: 0 },
    {
      name: "an owed class goes before an earlier borrower",
      lines: [line(0, 1, 9), line(9, 1, 1)],
      free: 1,
      next: 0,
    },
    {
      name: "owed classes go in arrival order, whatever their priority",
      lines: [line(7, 1, 9), line(1, 1, 3)],
      free: 2,
      next: 1,
    },
    { name: "arrival order the other way", lines: [line(7, 1, 3), line(1, 1, 9)], free: 2, next: 0 },
    {
      name: "an arrival tie goes to the earlier class",
      lines: [line(7, 1, 3), line(1, 1, 3)],
      free: 2,
      next: 0,
    },
    {
      name: "borrowers go by priority before arrival",
      lines: [line(5, 1, 9), line(4, 1, 3), idle(0)],
      classes: [cls(4, 1), cls(4), cls(2)],
      free: 1,
      next: 0,
    },
    {
      name: "a later class of higher priority borrows before an earlier one",
      lines: [line(4, 1, 3), line(5, 1, 9), idle(0)],
      classes: [cls(4), cls(4, 1), cls(2)],
      free: 1,
      next: 1,
    },
    {
      name: "borrowers of one priority go by arrival",
      lines: [line(5, 1, 9), line(4, 1, 3), idle(0)],
      classes: [cls(4), cls(4), cls(2)],
      free: 1,
      next: 1,
    },
    {
      name: "the owed head that does not fit blocks a borrower that would",
      lines: [line(0, 3, 9), line(8, 1, 1)],
      free: 2,
      next: -1,
    },
    {
      name: "the first borrower that does not fit blocks a later one",
      lines: [line(4, 2, 1), line(5, 1, 2), idle(0)],
      classes: [cls(4, 1), cls(4), cls(2)],
      free: 1,
      next: -1,
    },
    { name: "fits exactly", lines: [line(8, 2, 1), idle(0)], free: 2, next: 0 },
    {
      name: "a cost above the share goes while the class holds less than its guarantee",
      lines: [line(0, 3, 9), line(7, 1, 10)],
      classes: [cls(2), cls(8)],
      free: 3,
      next: 0,
    },
    {
      name: "a class at its ceiling is skipped, not blocking",
      lines: [line(5, 1, 1), line(4, 1, 2)],
      classes: [cls(5, 1, 0.5), cls(5)],
      free: 1,
      next: 1,
    },
    {
      name: "a head that would pass its ceiling is skipped",
      lines: [line(4, 2, 1), line(4, 1, 2)],
      classes: [cls(5, 1, 0.5), cls(5)],
      free: 2,
      next: 1,
    },
    {
      name: "every waiting class at its ceiling: none",
      lines: [line(5, 1, 1), line(5, 1, 2)],
      classes: [cls(5, 0, 0.5), cls(5, 0, 0.5)],
      free: 0,
      next: -1,
    },
    {
      name: "a borrower leaves an idle class the part it does not lend",
      lines: [idle(0), line(5, 1, 1)],
      classes: [cls(8, 1, 1, 0.5), cls(2)],
      free: 5,
      next: 1,
    },
    {
      name: "a borrower that would eat into it waits",
      lines: [idle(0), line(6, 1, 1)],
      classes: [cls(8, 1, 1, 0.5), cls(2)],
      free: 4,
      next: -1,
    },
    {
      name: "what the class uses of its kept part is not kept again",
      lines: [idle(2), line(5, 1, 1)],
      classes: [cls(8, 1, 1, 0.5), cls(2)],
      free: 3,
      next: 1,
    },
    {
      name: "an owed class takes what it is owed whatever others keep",
      lines: [idle(0), idle(7), line(1, 1, 2)],
      classes: [cls(5, 0, 1, 0), cls(3), cls(2)],
      free: 2,
      next: 2,
    },
    { name: "nothing free", lines: [line(0, 1, 1), line(10, 1, 2)], free: 0, next: -1 },
  ];
  it.each(rows)("$name", ({ lines, free, next, classes }) => {
    const c = classes ?? two;
    expect(nextClass(lines, classes ? guarantees(10, c) : b2, c, free)).toBe(next);
  });

  it("grants only what fits, never a class past its ceiling, and an owed class before any borrower", () => {
    const arb = fc.record({
      limit: fc.integer({ min: 1, max: 20 }),
      classes: fc.array(
        fc.record({
          share: fc.integer({ min: 1, max: 10 }),
          priority: fc.integer({ min: 0, max: 2 }),
          maxShare: fc.constantFrom(0.25, 0.5, 1),
          lendable: fc.constantFrom(0, 0.5, 1),
        }),
        { minLength: 1, maxLength: 4 },
      ),
      seed: fc.array(fc.tuple(fc.nat(20), fc.option(fc.integer({ min: 1, max: 5 })), fc.nat(50)), {
        minLength: 4,
        maxLength: 4,
      }),
    });
    fc.assert(
      fc.property(arb, ({ limit, classes, seed }) => {
        const bounds = guarantees(limit, classes);
        const lines = classes.map((_, i) => {
          const [used, cost, at] = seed[i]!;
          return { used: Math.min(used, bounds.ceiling[i]!), headCost: cost ?? undefined, headAt: at };
        });
        const held = lines.reduce((n, l) => n + l.used, 0);
        const free = Math.max(0, limit - held);
        const next = nextClass(lines, bounds, classes, free);
        if (next === -1) return;
        const l = lines[next]!;
        expect(l.headCost).toBeLessThanOrEqual(free);
        expect(l.used + l.headCost!).toBeLessThanOrEqual(bounds.ceiling[next]!);
        if (l.used >= bounds.guarantee[next]!) {
          // A borrower leaves the others what they keep and do not use.
          let kept = 0;
          lines.forEach((o, i) => {
            if (i !== next) kept += Math.max(0, bounds.kept[i]! - o.used);
          });
          expect(l.headCost).toBeLessThanOrEqual(free - kept);
          // A borrower goes only when no class below its guarantee waits with a head within its ceiling.
          lines.forEach((o, i) => {
            if (o.headCost !== undefined && o.used + o.headCost <= bounds.ceiling[i]!) {
              expect(o.used >= bounds.guarantee[i]!).toBe(true);
            }
          });
        }
      }),
    );
  });
});

describe("reclaimPlan: what borrowed tickets are asked back", () => {
  const three = [
    { share: 2, priority: 0, maxShare: 1, lendable: 1 },
    { share: 1, priority: 2, maxShare: 1, lendable: 1 },
    { share: 1, priority: 0, maxShare: 1, lendable: 1 },
  ];
  type Row = [
    used: number[],
    guarantee: number[],
    waiting: number[],
    asked: number[],
    free: number,
    plan: number[],
  ];
  it.each<[string, Row]>([
    [
      "ties go to the later class; then by priority",
      [[0, 5, 5], [2, 4, 4], [3, 0, 0], [0, 0, 0], 0, [0, 1, 1]],
    ],
    ["a borrower gives what it borrows", [[0, 6, 4], [2, 4, 4], [3, 0, 0], [0, 0, 0], 0, [0, 2, 0]]],
    ["no more than what waits", [[0, 6, 4], [2, 4, 4], [1, 0, 0], [0, 0, 0], 0, [0, 1, 0]]],
    ["what was asked already counts", [[0, 6, 4], [2, 4, 4], [3, 0, 0], [0, 1, 0], 0, [0, 1, 0]]],
    ["what is free counts", [[0, 6, 4], [2, 4, 4], [3, 0, 0], [0, 0, 0], 1, [0, 1, 0]]],
    ["nothing while nobody waits", [[0, 6, 4], [2, 4, 4], [0, 0, 0], [0, 0, 0], 0, [0, 0, 0]]],
    ["only a class below its guarantee wants", [[2, 5, 3], [2, 4, 4], [5, 0, 1], [0, 0, 0], 0, [0, 1, 0]]],
    ["what the guarantee lacks bounds the want", [[1, 8, 0], [4, 2, 2], [10, 0, 0], [0, 0, 0], 0, [0, 3, 0]]],
    [
      "a class above its guarantee that waits lends",
      [[0, 4, 6], [2, 4, 4], [2, 0, 1], [0, 0, 0], 0, [0, 0, 2]],
    ],
    ["a borrower is not asked twice", [[0, 5, 4], [6, 2, 3], [9, 0, 0], [0, 1, 0], 0, [0, 2, 1]]],
    ["the next borrower gives only the rest", [[0, 5, 4], [6, 1, 3], [2, 0, 0], [0, 0, 0], 0, [0, 1, 1]]],
    ["on a tie, the later class first", [[5, 0, 4], [2, 3, 2], [0, 1, 0], [0, 0, 0], 0, [0, 0, 1]]],
    ["lowest priority first", [[0, 5, 4], [3, 2, 3], [1, 0, 0], [0, 0, 0], 0, [0, 0, 1]]],
    [
      "lower priority before higher, whatever their places",
      [[5, 4, 0], [3, 2, 2], [0, 0, 1], [0, 0, 0], 0, [1, 0, 0]],
    ],
    [
      "a higher priority only when the lower lends nothing",
      [[0, 5, 3], [3, 2, 3], [1, 0, 0], [0, 0, 0], 0, [0, 1, 0]],
    ],
  ])("%s", (_, [used, guarantee, waiting, asked, free, plan]) => {
    const out = [9, 9, 9];
    const total = plan.reduce((a, b) => a + b, 0);
    expect(reclaimPlan(used, guarantee, waiting, asked, free, three, out)).toBe(total);
    expect(out).toEqual(plan);
  });
});
