import { Gate, type Stage } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { backends, useBackend } from "./backends.js";

/**
 * `snapshot().flow`: Little's law over the last 10 s, from the stage's own admissions and
 * releases. Alike on every backend (the figures are this process's, timed on the stage's clock).
 */
describe.each(backends)("flow on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock(1_000);
  });

  /** `n` calls of `ms` each on `stage`, `concurrency` at a time, one batch after another. */
  async function calls(stage: Stage, n: number, ms: number, concurrency: number) {
    for (let done = 0; done < n; done += concurrency) {
      const batch = Math.min(concurrency, n - done);
      const held = [];
      for (let i = 0; i < batch; i++) held.push(await stage.admit());
      await clock.advance(ms);
      for (const t of held) await t.release("success");
    }
  }

  it("gives throughput, service time, mean in flight and their product against the limit", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 8 });
    await calls(sem, 40, 250, 4); // 10 batches of 4 calls of 250 ms: 2.5 s, 16 calls a second
    const flow = sem.snapshot().flow!;
    expect(flow.windowMs).toBe(2_500);
    expect(flow.released).toBe(40);
    expect(flow.throughput).toBeCloseTo(16, 9);
    expect(flow.serviceMs).toBe(250);
    expect(flow.serviceP95Ms).toBe(250);
    expect(flow.meanInFlight).toBeCloseTo(4, 9);
    expect(flow.littleInFlight).toBeCloseTo(4, 9);
    expect(flow.utilisation).toBeCloseTo(0.5, 9);
    await sem.close();
  });

  it("counts the calls still in flight in the mean, and only released ones in the throughput", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 4 });
    const a = await sem.admit();
    const b = await sem.admit();
    await clock.advance(1_000);
    await a.release("success");
    await clock.advance(1_000);
    const flow = sem.snapshot().flow!;
    expect(flow.windowMs).toBe(2_000);
    expect(flow.released).toBe(1);
    expect(flow.serviceMs).toBe(1_000);
    // 2 in flight for 1 s, then 1 for 1 s: 1.5 on average over 2 s.
    expect(flow.meanInFlight).toBeCloseTo(1.5, 9);
    expect(flow.utilisation).toBeCloseTo(0.375, 9);
    await b.release("success");
    await sem.close();
  });

  it("slides: figures older than the window drop out", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 2 });
    await calls(sem, 4, 500, 2); // 2 s of 2 in flight
    await clock.advance(20_000); // idle
    await calls(sem, 1, 100, 1);
    const flow = sem.snapshot().flow!;
    expect(flow.windowMs).toBeLessThanOrEqual(10_000);
    expect(flow.windowMs).toBeGreaterThan(9_000);
    expect(flow.released).toBe(1);
    expect(flow.serviceMs).toBe(100);
    expect(flow.meanInFlight).toBeCloseTo(100 / flow.windowMs, 9);
  });

  it("does not count a refund as a completed call, but times it out of the mean in flight", async () => {
    const bucket = backend.make(clock).tokenBucket("bucket", { capacity: 5, refillPerSecond: 1 });
    const t = await bucket.admit();
    await clock.advance(400);
    await t.refund();
    const u = await bucket.admit();
    await clock.advance(600);
    await u.release("success");
    const flow = bucket.snapshot().flow!;
    expect(flow.released).toBe(1);
    expect(flow.serviceMs).toBe(600);
    expect(flow.meanInFlight).toBeCloseTo(1, 9);
    expect(flow.utilisation).toBe(0); // a bucket has no concurrency limit
    await bucket.close();
  });

  it("a gate measures its own calls, and each stage its own", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("sem", { limit: 4 });
    const bucket = b.tokenBucket("bucket", { capacity: 100, refillPerSecond: 100 });
    const gate = new Gate([bucket, sem], { clock });
    for (let i = 0; i < 5; i++) {
      await gate.run(async () => {
        await clock.advance(200);
      });
    }
    const snap = gate.snapshot();
    expect(snap.flow!.released).toBe(5);
    expect(snap.flow!.serviceMs).toBe(200);
    expect(snap.flow!.throughput).toBeCloseTo(5, 9);
    expect(snap.flow!.utilisation).toBeCloseTo(0.25, 9);
    for (const s of snap.stages) {
      expect(s.flow!.released).toBe(5);
      expect(s.flow!.serviceMs).toBe(200);
    }
    await gate.close();
  });

  it("keeps the p95 of the service times in the window", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 1 });
    for (let i = 1; i <= 20; i++) await calls(sem, 1, i * 10, 1); // 10, 20, … 200 ms
    const flow = sem.snapshot().flow!;
    expect(flow.released).toBe(20);
    expect(flow.serviceP95Ms).toBe(190);
    expect(flow.serviceMs).toBe(105);
    await sem.close();
  });
});
