import fc from "fast-check";
import { type Backend, Gate, type Outcome, type Stage, type Ticket } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { type backends, coreBackends, useBackend } from "./backends.js";

/**
 * `settle` re-prices only what prices by cost (token buckets): random sequences of admit,
 * tryAdmit, settle (0, the cost, more, far more), refund, release and record on every stage kind
 * and on a gate, each checked step by step against an exact model of what the stage holds (time
 * stands still, so nothing refills). Permits held never exceed the limit; at the end everything
 * is given back and exactly what the model says is free can be admitted, one more refused: a
 * permit stage admits exactly its limit again, so no permit was lost and none minted.
 */

const OUTCOMES: Outcome[] = ["success", "dropped", "ignored"];
const SETTLES = [0, 1, 2, 3, 7, 1_000, 2 ** 31];

type Op =
  | { op: "admit" | "tryAdmit"; cost: number }
  | { op: "settle"; pick: number; actual: number; byName: boolean }
  | { op: "refund" | "release" | "record"; pick: number; outcome: Outcome };

const opArb = (maxCost: number): fc.Arbitrary<Op> =>
  fc.oneof(
    fc.record({
      op: fc.constantFrom("admit" as const, "tryAdmit" as const),
      cost: fc.integer({ min: 1, max: maxCost }),
    }),
    fc.record({
      op: fc.constant("settle" as const),
      pick: fc.nat(),
      actual: fc.constantFrom(...SETTLES),
      byName: fc.boolean(),
    }),
    fc.record({
      op: fc.constantFrom("refund" as const, "release" as const, "record" as const),
      pick: fc.nat(),
      outcome: fc.constantFrom(...OUTCOMES),
    }),
  );

/** What a model needs to follow one stage (or gate) through a run. */
interface Model {
  /** Would an admission of `cost` be granted now? */
  fits(cost: number): boolean;
  granted(t: Held): void;
  settled(t: Held, actual: number): void;
  refunded(t: Held): void;
  released(t: Held): void;
}

interface Held {
  ticket: Ticket;
  cost: number;
  /** The cost the bucket holds it at (settle moves it). */
  priced: number;
  gone: boolean;
}

/** Permits against a fixed limit: semaphore, queue, AIMD with min = max. */
class Permits implements Model {
  held = 0;
  constructor(readonly limit: number) {}
  fits(cost: number) {
    return this.held + cost <= this.limit;
  }
  granted(t: Held) {
    this.held += t.cost;
  }
  settled() {}
  refunded(t: Held) {
    this.held -= t.cost;
  }
  released(t: Held) {
    this.held -= t.cost;
  }
}

/** A token bucket with time standing still: only the latest grant of the key can be refunded. */
class Bucket implements Model {
  latest: Held | undefined;
  constructor(
    public tokens: number,
    readonly capacity: number,
  ) {}
  fits(cost: number) {
    return this.tokens >= cost;
  }
  granted(t: Held) {
    this.tokens -= t.cost;
    this.latest = t;
  }
  settled(t: Held, actual: number) {
    if (actual > t.priced) this.tokens -= actual - t.priced;
    else if (this.latest === t) this.tokens = Math.min(this.capacity, this.tokens + t.priced - actual);
    t.priced = actual;
  }
  refunded(t: Held) {
    if (this.latest !== t) return;
    this.latest = undefined;
    this.tokens = Math.min(this.capacity, this.tokens + t.priced);
  }
  released() {}
}

/** An interval gate's host with time standing still: one start, unless the latest is refunded. */
class Slot implements Model {
  free = true;
  latest: Held | undefined;
  fits() {
    return this.free;
  }
  granted(t: Held) {
    this.free = false;
    this.latest = t;
  }
  settled() {}
  refunded(t: Held) {
    if (this.latest !== t) return;
    this.latest = undefined;
    this.free = true;
  }
  released() {}
}

/** Every stage of a gate at once; the gate admits only when all do, and changes nothing otherwise. */
class All implements Model {
  constructor(readonly parts: Model[]) {}
  fits(cost: number) {
    return this.parts.every((m) => m.fits(cost));
  }
  granted(t: Held) {
    for (const m of this.parts) m.granted(t);
  }
  settled(t: Held, actual: number) {
    for (const m of this.parts) m.settled(t, actual);
  }
  refunded(t: Held) {
    for (const m of this.parts) m.refunded(t);
  }
  released(t: Held) {
    for (const m of this.parts) m.released(t);
  }
}

interface Subject {
  stage: Stage;
  model: Model;
  /** Name `settle({ [name]: n })` re-prices at, when settled by name. */
  pricedBy: string;
  maxCost: number;
  /** Permits held, when the subject has a limit: never above it. */
  held?: () => number;
  limit?: number;
}

const LIMIT = 3;
const CAPACITY = 6;
/**
 * Tokens per second: slow enough that a Redis key, whose TTL (the time to refill, plus a second)
 * runs in real time while this test's clock stands still, outlives a run on a loaded machine: at
 * 1 per second a bucket one token short expired after 2 s and came back full.
 */
const REFILL = 0.001;

function subjects(b: Backend): Record<string, () => Subject> {
  return {
    semaphore: () => {
      const model = new Permits(LIMIT);
      return {
        stage: b.semaphore("sem", { limit: LIMIT }),
        model,
        pricedBy: "sem",
        maxCost: LIMIT,
        held: () => model.held,
        limit: LIMIT,
      };
    },
    queue: () => {
      const model = new Permits(LIMIT);
      return {
        stage: b.queue("q", { maxSize: LIMIT, whenFull: "shed" }),
        model,
        pricedBy: "q",
        maxCost: LIMIT,
        held: () => model.held,
        limit: LIMIT,
      };
    },
    aimd: () => {
      const model = new Permits(LIMIT);
      return {
        stage: b.aimd("adaptive", { initial: LIMIT, min: LIMIT, max: LIMIT }),
        model,
        pricedBy: "adaptive",
        maxCost: LIMIT,
        held: () => model.held,
        limit: LIMIT,
      };
    },
    tokenBucket: () => ({
      stage: b.tokenBucket("tb", { capacity: CAPACITY, refillPerSecond: REFILL }),
      model: new Bucket(CAPACITY, CAPACITY),
      pricedBy: "tb",
      maxCost: CAPACITY,
    }),
    intervalGate: () => ({
      stage: b.intervalGate("ig", { minIntervalMs: 1_000, defaultHost: "api" }),
      model: new Slot(),
      pricedBy: "ig",
      maxCost: 4,
    }),
    gate: () => {
      const sem = new Permits(LIMIT);
      const adaptive = new Permits(LIMIT);
      const queue = new Permits(100);
      const bucket = new Bucket(CAPACITY * 2, CAPACITY * 2);
      // Bounded queue first, the bucket last: a stage that refuses leaves the ones before it
      // refunded exactly (permits), and the bucket is never taken from and then refunded.
      const stage = new Gate(
        [
          b.queue("gq", { maxSize: 100 }),
          b.semaphore("gsem", { limit: LIMIT }),
          b.aimd("gadaptive", { initial: LIMIT, min: LIMIT, max: LIMIT }),
          b.tokenBucket("gtb", { capacity: CAPACITY * 2, refillPerSecond: REFILL }),
        ],
        { name: "g" },
      );
      // The queue's slot is given back as soon as the call has passed every stage.
      const passing: Model = {
        fits: (cost) => queue.fits(cost),
        granted() {},
        settled() {},
        refunded() {},
        released() {},
      };
      return {
        stage,
        model: new All([passing, sem, adaptive, bucket]),
        pricedBy: "gtb",
        maxCost: LIMIT,
        held: () => sem.held,
        limit: LIMIT,
      };
    },
  };
}

async function tryGet(stage: Stage, op: "admit" | "tryAdmit", cost: number): Promise<Ticket | undefined> {
  if (op === "tryAdmit") return stage.tryAdmit({ cost });
  try {
    return await stage.admit({ cost, timeoutMs: 0 });
  } catch (error) {
    if ((error as { code?: string }).code === "ADMIT_TIMEOUT" || (error as { code?: string }).code === "SHED")
      return undefined;
    throw error;
  }
}

/** Run one sequence on a fresh subject; throws on the first step that breaks the model. */
async function runSequence(backend: (typeof backends)[number], kind: string, ops: Op[]): Promise<void> {
  const clock = new FakeClock(1_000_000);
  const b = backend.make(clock);
  const s = subjects(b)[kind]!();
  const all: Held[] = [];
  try {
    for (const [i, step] of ops.entries()) {
      const where = `step ${i} ${JSON.stringify(step)}`;
      if ("cost" in step) {
        const cost = Math.min(step.cost, s.maxCost);
        const expected = s.model.fits(cost);
        const ticket = await tryGet(s.stage, step.op, cost);
        expect(ticket !== undefined, where).toBe(expected);
        if (ticket) {
          const h: Held = { ticket, cost, priced: cost, gone: false };
          all.push(h);
          s.model.granted(h);
        }
      } else if (all.length > 0) {
        const h = all[step.pick % all.length]!;
        if ("actual" in step) {
          const actual = step.byName ? { [s.pricedBy]: step.actual } : step.actual;
          await h.ticket.settle(actual);
          s.model.settled(h, step.actual);
          // A permit ticket's cost, and a gate ticket's, never move.
          if (kind !== "tokenBucket") expect(h.ticket.cost, where).toBe(h.cost);
        } else if (step.op === "record") {
          h.ticket.record(step.outcome);
        } else if (!h.gone) {
          h.gone = true;
          if (step.op === "refund") {
            await h.ticket.refund();
            s.model.refunded(h);
          } else {
            await h.ticket.release(step.outcome);
            s.model.released(h);
          }
        }
      }
      if (s.held && s.limit !== undefined) expect(s.held(), where).toBeLessThanOrEqual(s.limit);
      expect(s.stage.snapshot().waiting, where).toBe(0);
    }
    // Everything back: exactly what the model says is free is admitted, and one more refused.
    for (const h of all) {
      if (h.gone) continue;
      h.gone = true;
      await h.ticket.release("ignored");
      s.model.released(h);
    }
    const again: Ticket[] = [];
    while (s.model.fits(1) && again.length < 100) {
      const t = await s.stage.tryAdmit({ cost: 1 });
      expect(t, `admission ${again.length + 1} after the run`).toBeDefined();
      again.push(t!);
      s.model.granted({ ticket: t!, cost: 1, priced: 1, gone: false });
    }
    expect(await s.stage.tryAdmit({ cost: 1 }), "one more than is free").toBeUndefined();
    if (s.limit !== undefined && kind !== "gate") expect(again).toHaveLength(s.limit);
    for (const t of again) await t.release();
    if (kind === "intervalGate") {
      // Once the spacing has passed, the host admits one start again.
      await clock.advance(1_001);
      expect(await s.stage.tryAdmit()).toBeDefined();
      expect(await s.stage.tryAdmit()).toBeUndefined();
    }
  } finally {
    await s.stage.close();
    await b.close();
  }
}

const KINDS = ["semaphore", "queue", "aimd", "tokenBucket", "intervalGate", "gate"];
const RUNS: Record<string, number> = { memory: 200, redis: 40 };

describe.each(coreBackends)("settle keeps capacity exact on $name", (backend) => {
  useBackend(backend);

  it.each(KINDS)(
    "a %s admits exactly its capacity whatever is settled, refunded or released",
    async (kind) => {
      await fc.assert(
        fc.asyncProperty(fc.array(opArb(LIMIT + 1), { minLength: 1, maxLength: 25 }), (ops) =>
          runSequence(backend, kind, ops),
        ),
        { numRuns: RUNS[backend.name] ?? 10 },
      );
    },
  );

  it("a semaphore of 2 settled up then released never admits a third", async () => {
    const b = backend.make(new FakeClock());
    const sem = b.semaphore("two", { limit: 2 });
    const t = await sem.admit();
    await t.settle(5);
    await t.release();
    const got = await Promise.all([1, 2, 3].map(() => sem.tryAdmit()));
    expect(got.filter(Boolean)).toHaveLength(2);
    for (const x of got) await x?.release();
    const zero = await sem.admit();
    await zero.settle(0);
    await zero.release();
    const back = await Promise.all([sem.tryAdmit(), sem.tryAdmit()]);
    expect(back.every(Boolean)).toBe(true);
    for (const x of back) await x?.release();
    await b.close();
  });
});
