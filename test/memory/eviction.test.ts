import { memory } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";

describe("idle key eviction", () => {
  it("forgets token bucket keys once they are full again", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("per-key", { keyed: true, capacity: 2, refillPerSecond: 1 });
    for (let i = 0; i < 100_000; i++) await bucket.tryAdmit({ key: `k${i}` });
    expect(bucket.keyCount).toBe(100_000);
    await clock.advance(1000);
    expect(bucket.keyCount).toBe(100_000); // one token short of full: still remembered
    await clock.advance(2000);
    expect(bucket.keyCount).toBe(0);
    expect(clock.pendingTimers).toBe(0); // no sweep left running once the map is empty
  });

  it("keeps a key that has waiters or a penalty still running", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("per-key", {
      keyed: true,
      capacity: 1,
      refillPerSecond: 1,
      penalty: { factor: 0.5, recoveryMs: 60_000 },
    });
    await (await bucket.admit({ key: "slow" })).release("dropped");
    await clock.advance(10_000);
    expect(bucket.evictIdle()).toBe(0);
    expect(bucket.keyCount).toBe(1);
    await clock.advance(60_000); // the periodic sweep has run meanwhile
    expect(bucket.keyCount).toBe(0);
  });

  it("behaves like a fresh key after eviction", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("per-key", { keyed: true, capacity: 3, refillPerSecond: 1 });
    await bucket.admit({ key: "a", cost: 3 });
    await bucket.admit({ key: "b", cost: 1 });
    await clock.advance(999);
    expect(bucket.evictIdle()).toBe(0);
    await clock.advance(2001);
    bucket.evictIdle();
    expect(bucket.keyCount).toBe(0);
    expect(await bucket.tryAdmit({ key: "a", cost: 3 })).toBeDefined();
    expect(await bucket.tryAdmit({ key: "a" })).toBeUndefined();
  });

  it("forgets interval gate hosts once their spacing has passed", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("hosts", { minIntervalMs: 500 });
    for (let i = 0; i < 10_000; i++) await gate.admit({ host: `h${i}.test` });
    expect(gate.hostCount).toBe(10_000);
    await clock.advance(1000);
    expect(gate.hostCount).toBe(0);
  });
});
