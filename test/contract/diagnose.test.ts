import { autoscalerCeiling, diagnose, Gate, InvalidOptionsError, type Stage } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { backends, useBackend } from "./backends.js";

/**
 * `diagnose()`: which bound the throughput met, from the stages' snapshots. Alike on every
 * backend: each scenario drives the stages on a fake clock and checks the verdict and its numbers.
 */
describe.each(backends)("diagnose on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock(1_000);
  });

  /** `n` calls through `stage`, `concurrency` started at once each round, each lasting `ms`. */
  async function load(stage: Stage, n: number, concurrency: number, ms: number) {
    for (let done = 0; done < n; done += concurrency) {
      const calls = [];
      for (let i = 0; i < Math.min(concurrency, n - done); i++) {
        calls.push(
          stage.run!(async () => {
            await new Promise<void>((resolve) => clock.setTimeout(resolve, ms));
          }),
        );
      }
      await clock.flush();
      while (!(await settledAll(calls))) await clock.advance(ms);
    }
  }

  async function settledAll(calls: Promise<unknown>[]): Promise<boolean> {
    let pending = calls.length;
    for (const c of calls) void c.finally(() => pending--);
    await clock.flush();
    return pending === 0;
  }

  it("idle: a stage nobody used", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 4 });
    const d = diagnose(sem);
    expect(d.constraint).toBe("idle");
    expect(d.stages).toHaveLength(1);
    await sem.close();
  });

  it("bound: calls wait for a full semaphore", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 2 });
    await load(sem, 12, 4, 100); // 4 at a time against 2 permits: half of them wait 100 ms
    const d = diagnose(sem);
    expect(d.constraint).toBe("bound");
    expect(d.summary).toMatch(/^the concurrency bound: semaphore "sem" \(/);
    expect(d.summary).toMatch(/of 2; calls waited 0\.60 s for it in the last 0\.6 s\)/);
    expect(d.stages[0]!.flow!.waitedMs).toBe(600);
    expect(d.stages[0]!.flow!.released).toBe(12);
    expect(d.stages[0]!.flow!.serviceMs).toBe(100);
    expect(d.stages[0]!.flow!.meanInFlight).toBeCloseTo(2, 9);
    await sem.close();
  });

  it("provider: calls wait for tokens in a gate, whatever the semaphore's room", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("rpm", { capacity: 2, refillPerSecond: 10 });
    const sem = b.semaphore("sem", { limit: 8 });
    const gate = new Gate([bucket, sem], { clock });
    await load(gate, 8, 8, 50); // 2 at once, then one each 100 ms
    const d = diagnose(gate);
    expect(d.constraint).toBe("provider");
    expect(d.summary).toMatch(
      /^the provider's allowance: tokenBucket "rpm" \(it lets [\d.]+\/s through; calls waited/,
    );
    expect(d.stages.map((s) => s.name)).toEqual(["rpm", "sem"]);
    // A stage shared by several gates is looked at once.
    const other = new Gate([sem], { clock, name: "other" });
    expect(diagnose([gate, other, sem]).stages.map((s) => s.name)).toEqual(["rpm", "sem"]);
    expect(d.stages[1]!.line).toMatch(/^sem \(semaphore.*\): [\d.]+\/s × 0\.050 s = /);
    await gate.close();
  });

  it("provider: a rate calls waited for, over a bound they waited for but that was seldom full", async () => {
    // One permit, four tokens a second, calls of 150 ms: the rate lets 4/s through, so the
    // permit is held 0.6 of the time; callers queue behind its holder as well as for tokens.
    const b = backend.make(clock);
    const sem = b.semaphore("sem", { limit: 1 });
    const bucket = b.tokenBucket("rate", { capacity: 1, refillPerSecond: 4 });
    const gate = new Gate([bucket, sem], { clock });
    await load(gate, 12, 4, 150);
    const [s, r] = [sem.snapshot(), bucket.snapshot()];
    // (The tokens waited for long, the permit far from full; where the gate fuses its stages,
    // callers waited for the permit too: on a cluster, chained, they take it once they have a token.)
    expect(r.flow!.waitedMs).toBeGreaterThan(0.1 * 12 * 150);
    expect(s.flow!.meanInFlight).toBeCloseTo(0.6, 9);
    const d = diagnose(gate);
    expect(d.constraint).toBe("provider");
    expect(d.summary).toMatch(/^the provider's allowance: tokenBucket "rate" \(it lets [\d.]+\/s through; /);
    await gate.close();
  });

  it("provider: an AIMD limiter full of calls", async () => {
    const aimd = backend.make(clock).aimd("aimd", { initial: 2, max: 8 });
    await load(aimd, 8, 4, 100);
    const d = diagnose(aimd);
    expect(d.constraint).toBe("provider");
    expect(d.summary).toMatch(
      /^the provider's allowance: the limit the provider's refusals set, aimd "aimd"/,
    );
    await aimd.close();
  });

  it("provider: the provider refused calls, whatever the stages say", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 8 });
    await load(sem, 2, 1, 100);
    const d = diagnose(sem, { rejected: 3 });
    expect(d.constraint).toBe("provider");
    expect(d.summary).toMatch(/refused 3 calls/);
    await sem.close();
  });

  it("process and producer: the bound is far from full; work waiting in your code tells them apart", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 8 });
    await load(sem, 10, 1, 100); // one at a time: 1 of 8 in flight
    const producer = diagnose(sem);
    expect(producer.constraint).toBe("producer");
    expect(producer.summary).toMatch(/has 1\.0 of 8 in flight on average \(13%\)/);
    const process = diagnose(sem, { backlog: 40 });
    expect(process.constraint).toBe("process");
    expect(process.summary).toMatch(/^this process: 40 jobs wait, yet semaphore "sem" has 1\.0 of 8/);
    await sem.close();
  });

  it("a few short waits do not make a stage the constraint (under a tenth of the time calls held it)", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 4 });
    await load(sem, 10, 1, 100); // 1 s of calls, one at a time
    const held = [await sem.admit(), await sem.admit(), await sem.admit(), await sem.admit()];
    const fifth = sem.admit();
    await clock.advance(10);
    for (const t of held) await t.release("success");
    await (await fifth).release("success");
    expect(sem.snapshot().permitWaitMs).toBe(10);
    expect(diagnose(sem).constraint).toBe("producer");
    await sem.close();
  });

  it("bound without a wait: a semaphore kept full counts as the constraint from `full` on", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 4 });
    await load(sem, 12, 4, 100); // exactly 4 at a time: full, nobody waits
    expect(diagnose(sem).constraint).toBe("bound");
    expect(diagnose(sem, { full: 1 }).constraint).toBe("bound");
    const half = backend.make(clock).semaphore("half", { limit: 8 });
    await load(half, 12, 4, 100);
    expect(diagnose(half).constraint).toBe("producer");
    expect(diagnose(half, { full: 0.5 }).constraint).toBe("bound");
    await sem.close();
    await half.close();
  });
});

describe("diagnose and autoscalerCeiling with hostile input", () => {
  const clock = new FakeClock(0);

  it.each([
    [undefined, "targets"],
    [null, "targets"],
    [42, "targets"],
    [[], "targets"],
    [[{}], "targets.0"],
    [
      [
        {
          snapshot() {
            throw new Error("boom");
          },
        },
      ],
      "targets.0",
    ],
  ])("targets %j: InvalidOptionsError naming %s", (targets, field) => {
    const error = (() => {
      try {
        diagnose(targets as never);
      } catch (e) {
        return e;
      }
    })();
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect((error as InvalidOptionsError).field).toBe(field);
  });

  it.each([
    [null, "options"],
    [[], "options"],
    [{ backlog: -1 }, "backlog"],
    [{ backlog: 1.5 }, "backlog"],
    [{ backlog: "3" }, "backlog"],
    [{ rejected: Number.NaN }, "rejected"],
    [{ full: 0 }, "full"],
    [{ full: 1.5 }, "full"],
    [{ ful: 0.5 }, "ful"],
    ["a getter that throws", "backlog"],
  ])("options %j: InvalidOptionsError naming %s", async (given, field) => {
    const options =
      given === "a getter that throws"
        ? Object.defineProperty({}, "backlog", {
            enumerable: true,
            get() {
              throw new Error("trap");
            },
          })
        : given;
    const { memory } = await import("floodgate");
    const sem = memory({ clock }).semaphore("sem", { limit: 1 });
    const error = (() => {
      try {
        diagnose(sem, options as never);
      } catch (e) {
        return e;
      }
    })();
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect((error as InvalidOptionsError).field).toBe(field);
  });

  it("the autoscaler ceiling is the fleet bound ÷ the per-process bound, rounded down, at least 1", () => {
    expect(autoscalerCeiling(8, 2)).toBe(4);
    expect(autoscalerCeiling(10, 4)).toBe(2);
    expect(autoscalerCeiling(3, 8)).toBe(1);
    for (const [fleet, per, field] of [
      [0, 2, "fleetBound"],
      [Number.POSITIVE_INFINITY, 2, "fleetBound"],
      ["8", 2, "fleetBound"],
      [8, 0, "perProcessBound"],
      [8, Number.NaN, "perProcessBound"],
    ] as const) {
      let error: unknown;
      try {
        autoscalerCeiling(fleet as number, per as number);
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect((error as InvalidOptionsError).field).toBe(field);
    }
  });
});
