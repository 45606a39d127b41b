import fc from "fast-check";
import { type Backend, memory, type Stage, type TokenBucketOptions } from "floodgate";
import { redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import type { Redis } from "ioredis";
import { describe, expect, it } from "vitest";
import { ownRedis, useClients } from "./clients.js";
import { randomPrefix } from "./helpers.js";

/** This file counts the script calls Redis runs: on a server of its own. */
const redisUrl = ownRedis();

const CLASSES = { interactive: { share: 3, priority: 1 }, bulk: { share: 1 } };

/** One call of a scenario: which process asks, for which class and cost, after how many ms. */
interface Ask {
  proc: number;
  cls: "interactive" | "bulk";
  cost: number;
  after: number;
}

/**
 * A Redis token bucket with classes shared by several processes (backends on their own
 * connections, on one fake clock that is also the scripts' clock), against the memory token
 * bucket, the rule's twin, given the same calls at the same times.
 */
describe("a token bucket with classes across processes (Redis)", () => {
  const { clients, connect } = useClients(redisUrl);

  async function fleet(n: number, options: TokenBucketOptions, clock: FakeClock, pollMs = 1000) {
    const prefix = randomPrefix("bucket-classes");
    const buckets: Stage[] = [];
    for (let i = 0; i < n; i++) {
      const client = await connect();
      const backend: Backend = redis(client, { prefix, clock, time: "clock", pollMs });
      buckets.push(backend.tokenBucket("tb", options));
    }
    return buckets;
  }

  /** Run `asks` on `stages` (the ask's process picks one), 1 ms at a time; grants as [name, ms]. */
  async function play(asks: readonly Ask[], stages: readonly Stage[], clock: FakeClock, untilMs: number) {
    const granted: [string, number][] = [];
    let next = 0;
    let at = 0;
    const calls: Promise<unknown>[] = [];
    for (let t = 0; t <= untilMs; t++) {
      while (next < asks.length && at + asks[next]!.after <= t) {
        const ask = asks[next]!;
        at += ask.after;
        const name = `${ask.cls[0]}${next}`;
        const stage = stages[ask.proc % stages.length]!;
        calls.push(
          stage.admit({ class: ask.cls, cost: ask.cost }).then(() => granted.push([name, clock.now()])),
        );
        next++;
        // Each asks once the one before is in line, as the same calls in one process would.
        await clock.flush();
        await settle(clock, clients);
      }
      await clock.advance(1);
      await settle(clock, clients);
    }
    return { granted, calls };
  }

  it("grants the same calls at the same times as the memory bucket, whichever process asks", async () => {
    const options = { capacity: 2, refillPerSecond: 10, classes: CLASSES };
    const asks: Ask[] = [
      { proc: 0, cls: "bulk", cost: 1, after: 0 },
      { proc: 1, cls: "bulk", cost: 1, after: 0 },
      { proc: 2, cls: "bulk", cost: 1, after: 0 },
      { proc: 0, cls: "bulk", cost: 1, after: 5 },
      { proc: 1, cls: "interactive", cost: 1, after: 5 },
      { proc: 2, cls: "interactive", cost: 2, after: 5 },
      { proc: 1, cls: "bulk", cost: 1, after: 40 },
      { proc: 0, cls: "interactive", cost: 1, after: 10 },
      { proc: 2, cls: "bulk", cost: 2, after: 10 },
      { proc: 0, cls: "interactive", cost: 1, after: 200 },
    ];
    const memClock = new FakeClock();
    const mem = await play(asks, [memory({ clock: memClock }).tokenBucket("tb", options)], memClock, 1_500);
    const clock = new FakeClock();
    const onRedis = await play(asks, await fleet(3, options, clock), clock, 1_500);
    expect(mem.granted.length).toBe(asks.length);
    expect(onRedis.granted).toEqual(mem.granted);
  });

  it("asks Redis again once per grant: only the process whose caller stands first", async () => {
    const clock = new FakeClock();
    const prefix = randomPrefix("bucket-classes-calls");
    const stages: Stage[] = [];
    for (let i = 0; i < 3; i++) {
      const client = await connect();
      stages.push(
        redis(client, { prefix, clock, time: "clock" }).tokenBucket("tb", {
          capacity: 1,
          refillPerSecond: 10,
          classes: CLASSES,
        }),
      );
    }
    await stages[0]!.admit({ class: "bulk" });
    // Two callers in each process wait, in turn: 6 grants, 100 ms apart.
    const calls: Promise<unknown>[] = [];
    for (let round = 0; round < 2; round++) {
      for (const stage of stages) {
        calls.push(stage.admit({ class: "bulk" }));
        await clock.flush();
        await settle(clock, clients);
      }
    }
    const monitor = await connect();
    const feed = await monitor.monitor();
    let scripts = 0;
    feed.on("monitor", (_time: string, args: string[]) => {
      const command = args[0]?.toLowerCase();
      if ((command === "evalsha" || command === "eval") && args[3]?.startsWith(prefix)) scripts++;
    });
    for (let t = 0; t < 700; t++) {
      await clock.advance(1);
      await settle(clock, clients);
    }
    await Promise.all(calls);
    feed.disconnect();
    // One call per grant, by the process whose caller stands first (each asking process told the
    // next one so); with every waiting process asking, it was 3 a grant.
    expect(scripts).toBeLessThanOrEqual(6 + 1);
    expect(scripts).toBeGreaterThanOrEqual(6);
  });

  it("never lets through more than the bucket allows, with grants and polls crossing (random calls)", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(
          fc.record({
            proc: fc.integer({ min: 0, max: 1 }),
            cls: fc.constantFrom("interactive" as const, "bulk" as const),
            cost: fc.integer({ min: 1, max: 4 }),
            after: fc.integer({ min: 0, max: 20 }),
          }),
          { minLength: 1, maxLength: 30 },
        ),
        async (asks) => {
          const clock = new FakeClock();
          // A poll every few ms: asks of waiters cross the grant messages all the time.
          const stages = await fleet(2, { capacity: 5, refillPerSecond: 50, classes: CLASSES }, clock, 10);
          const { granted, calls } = await play(asks, stages, clock, 1_000);
          const costOf = new Map(asks.map((a, i) => [`${a.cls[0]}${i}`, a.cost]));
          expect(granted.length).toBe(asks.length);
          for (const [, from] of granted) {
            const sum = granted
              .filter(([, at]) => at >= from)
              .reduce((n, [name]) => n + costOf.get(name)!, 0);
            const last = Math.max(...granted.map(([, at]) => at));
            expect(sum).toBeLessThanOrEqual(5 + (50 * (last - from)) / 1000 + 1e-9);
          }
          await Promise.all(calls);
          await Promise.all(stages.map((s) => s.close()));
        },
      ),
      // A failure is reported as found: shrinking it through Redis would outlast the test.
      { numRuns: 8, endOnFailure: true },
    );
  }, 60_000);
});

/**
 * Let every process finish what the last step started: loop until none of `clients` has had a
 * command waiting for its reply for two rounds running (a grant heard on one process's
 * subscriber makes it ask Redis again on its own connection). Real time only waits for Redis;
 * the fake clock does not move.
 */
async function settle(clock: FakeClock, clients: readonly Redis[]): Promise<void> {
  let calm = 0;
  for (let round = 0; calm < 2; round++) {
    if (round > 2_000) throw new Error("Redis did not answer the processes' calls within 2000 rounds");
    await new Promise((resolve) => setImmediate(resolve));
    await clock.flush();
    await new Promise((resolve) => setTimeout(resolve, 1));
    await clock.flush();
    calm = clients.every((c) => c.commandQueue.length === 0) ? calm + 1 : 0;
  }
}
