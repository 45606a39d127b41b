import { memory, type Stage } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";

/** A FakeClock that counts how often its time is read. */
class CountingClock extends FakeClock {
  reads = 0;
  override now(): number {
    this.reads++;
    return super.now();
  }
}

/**
 * A memory stage reads its clock once to admit a call that needs no wait and once to release it
 * (the flow's service time): on a VM a read costs tens of ns, a fifth of a memory token take.
 */
describe("memory stages read the clock once an admission and once a release", () => {
  const stages: [string, (b: ReturnType<typeof memory>) => Stage, { key: string }?][] = [
    ["token bucket", (b) => b.tokenBucket("b", { capacity: 1_000_000, refillPerSecond: 1_000 })],
    [
      "keyed token bucket",
      (b) => b.tokenBucket("k", { keyed: true, capacity: 1_000, refillPerSecond: 1 }),
      { key: "a" },
    ],
    ["interval gate", (b) => b.intervalGate("i", { minIntervalMs: 0, defaultHost: "h" })],
    ["semaphore", (b) => b.semaphore("s", { limit: 4 })],
    ["AIMD limiter", (b) => b.aimd("a", { initial: 4, min: 1, max: 8 })],
    ["bounded queue", (b) => b.queue("q", { maxSize: 4 })],
  ];

  for (const [kind, make, options] of stages) {
    it(kind, async () => {
      const clock = new CountingClock(1_000);
      const stage = make(memory({ clock }));
      // (The first call may make the key's state; count the ones after it.)
      await (await stage.admit(options)).release("success");
      const counts: number[] = [];
      for (const admit of [() => stage.admit(options), () => stage.tryAdmit(options)]) {
        clock.reads = 0;
        const ticket = await admit();
        counts.push(clock.reads);
        clock.reads = 0;
        await ticket!.release("success");
        counts.push(clock.reads);
      }
      clock.reads = 0;
      await stage.run!(() => 1, options);
      counts.push(clock.reads);
      expect(counts).toEqual([1, 1, 1, 1, 2]);
      await stage.close();
    });
  }
});
