import { Gate, memory, type Stage } from "floodgate";
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

/**
 * A gate of memory stages on its own clock reads it once to admit a call every stage admits at
 * once (for the gate's count and flow and every stage's), and once to release it, fused or taken
 * stage by stage.
 */
describe("a gate of memory stages reads the clock once an admission and once a release", () => {
  /** The five memory stages, none binding here. */
  const five = (b: ReturnType<typeof memory>): Stage[] => [
    b.queue("q", { maxSize: 4 }),
    b.semaphore("s", { limit: 4 }),
    b.aimd("a", { initial: 4, min: 1, max: 8 }),
    b.tokenBucket("b", { capacity: 1_000, refillPerSecond: 1_000 }),
    b.intervalGate("i", { minIntervalMs: 0, defaultHost: "h" }),
  ];
  const gates: [string, (b: ReturnType<typeof memory>, clock: FakeClock) => Gate][] = [
    ["a semaphore", (b, clock) => new Gate([b.semaphore("s", { limit: 4 })], { clock })],
    ["five stages, fused", (b, clock) => new Gate(five(b), { clock })],
    ["five stages, taken in turn", (b, clock) => new Gate(five(b), { clock, fuse: false })],
  ];

  for (const [kind, make] of gates) {
    it(kind, async () => {
      const clock = new CountingClock(1_000);
      const gate = make(memory({ clock }), clock);
      await (await gate.admit()).release("success");
      const counts: number[] = [];
      clock.reads = 0;
      const ticket = await gate.admit();
      counts.push(clock.reads);
      clock.reads = 0;
      await ticket.release("success");
      counts.push(clock.reads);
      clock.reads = 0;
      // (The function reads nothing: the two reads are the admission's and the release's.)
      await gate.run(() => 1);
      counts.push(clock.reads);
      expect(counts).toEqual([1, 1, 2]);
      await gate.close();
    });
  }
});
