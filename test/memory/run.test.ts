import { Gate, memory } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";

describe("run in memory", () => {
  it("calls fn before stage.run returns when there is room, and waits in line otherwise", async () => {
    const sem = memory({ clock: new FakeClock() }).semaphore("sem", { limit: 1 });
    const order: string[] = [];
    const first = sem.run(async () => {
      order.push("first");
      await Promise.resolve();
    });
    const second = sem.run(() => order.push("second"));
    expect(order).toEqual(["first"]);
    expect(sem.snapshot()).toMatchObject({ inFlight: 1, waiting: 1 });
    await Promise.all([first, second]);
    expect(order).toEqual(["first", "second"]);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0, admitted: 2 });
  });

  it("has a gate of memory stages with room call fn before gate.run returns, holding every stage", async () => {
    const clock = new FakeClock();
    const b = memory({ clock });
    const sem = b.semaphore("sem", { limit: 1 });
    const bucket = b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 });
    const queue = b.queue("jobs", { maxSize: 5 });
    const gate = new Gate([queue, bucket, sem], { clock });
    let during: unknown;
    const call = gate.run(() => {
      during = [gate.snapshot().inFlight, sem.snapshot().inFlight, queue.snapshot().queueDepth];
      return "done";
    });
    expect(during).toEqual([1, 1, 0]);
    expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0, admitted: 1 });
    expect(await call).toBe("done");
    expect(bucket.tokens()).toBe(4);
  });

  it("has a gate whose stages do not all admit wait holding none of them, then take them all at once", async () => {
    const clock = new FakeClock();
    const b = memory({ clock });
    const bucket = b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 });
    const sem = b.semaphore("sem", { limit: 1 });
    const gate = new Gate([bucket, sem], { clock });
    const held = await sem.admit();
    const call = gate.run(() => "late");
    expect(bucket.tokens()).toBe(5);
    expect(gate.snapshot()).toMatchObject({ waiting: 1, inFlight: 0 });
    await clock.advance(10);
    await held.release();
    expect(await call).toBe("late");
    expect(bucket.tokens()).toBe(4);
    expect(gate.snapshot()).toMatchObject({ waiting: 0, inFlight: 0, admitted: 1, permitWaitMs: 10 });
  });
});
