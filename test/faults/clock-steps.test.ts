import { type Clock, LeaseLostError, type Ticket } from "floodgate";
import { type LeaseTicket, type RedisBackendOptions, redis, stageKey } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterEach, beforeAll, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { closeClient, connectedClient, randomPrefix, sleep, until, within } from "../redis/helpers.js";
import { describeError, recordUnhandled, serverNow } from "./harness.js";

type Backend = ReturnType<typeof redis>;

const STEP_MS = 10_000;

/**
 * A worker's clock that is stepped while it runs (an NTP correction, a VM resumed): `now()` jumps
 * by `step(ms)`; its timers run in real time, as the system's do.
 */
class SteppedClock implements Clock {
  offset = 0;
  now(): number {
    return performance.now() + this.offset;
  }
  setTimeout(callback: () => void, ms: number): unknown {
    return setTimeout(callback, ms);
  }
  clearTimeout(timer: unknown): void {
    clearTimeout(timer as ReturnType<typeof setTimeout>);
  }
  step(ms: number): void {
    this.offset += ms;
  }
}

/** Steps: +10 s on one worker and -10 s on another, then the other way round. */
async function stepMidRun(ahead: SteppedClock, behind: SteppedClock, everyMs: number): Promise<void> {
  await sleep(everyMs);
  ahead.step(STEP_MS);
  behind.step(-STEP_MS);
  await sleep(everyMs);
  ahead.step(-STEP_MS);
  behind.step(STEP_MS);
  await sleep(everyMs);
  ahead.step(-STEP_MS);
  behind.step(STEP_MS);
}

describe("worker clocks stepped ±10 s mid-run, with the server's clock deciding (the default)", () => {
  let url: string;
  const clients: Redis[] = [];
  const backends: Backend[] = [];

  beforeAll(() => {
    url = redisUrl();
  });

  afterEach(async () => {
    await Promise.all(backends.splice(0).map((b) => within(b.close(), 5_000, "backend.close()")));
    await Promise.all(clients.splice(0).map(closeClient));
  });

  /** A backend standing for one worker process: its own connections, its own clock. */
  async function worker(options: RedisBackendOptions): Promise<Backend> {
    const [client, subscriber] = await Promise.all([connectedClient(url), connectedClient(url)]);
    clients.push(client, subscriber);
    const b = redis(client, { subscriber, pollMs: 200, ...options });
    backends.push(b);
    return b;
  }

  it("holds the cap, reaps no live lease, grants nothing extra", async () => {
    const unhandled = recordUnhandled();
    try {
      const prefix = randomPrefix("faults-clock-sem");
      const limit = 3;
      const leaseMs = 600;
      const ahead = new SteppedClock();
      const behind = new SteppedClock();
      const sems = await Promise.all(
        [ahead, behind, undefined].map(async (clock) =>
          (await worker({ prefix, ...(clock ? { clock } : {}) })).semaphore("sem", { limit, leaseMs }),
        ),
      );
      const raw = await connectedClient(url);
      clients.push(raw);
      const holders = stageKey(prefix, "sem", "holders");

      // One long holder per worker: it holds for almost three leases, across every step, renewing.
      const longHeld = (await Promise.all(sems.map((s) => s.admit({ timeoutMs: 5_000 })))) as LeaseTicket[];
      const oracle = { now: longHeld.length, peak: longHeld.length, grants: 0 };
      let running = true;
      const stopSignal = new AbortController();
      // Two more callers per worker compete for what is left (none) and for each long holder's
      // permit once it is given back.
      const callers = sems.flatMap((sem) =>
        [0, 1].map(async () => {
          while (running) {
            let ticket: Ticket | undefined;
            try {
              ticket = await sem.admit({ timeoutMs: 20_000, signal: stopSignal.signal });
            } catch {
              return;
            }
            oracle.grants++;
            oracle.peak = Math.max(oracle.peak, ++oracle.now);
            await sleep(15);
            oracle.now--;
            await ticket.release("success");
          }
        }),
      );

      // Expiries, read after each step: never in the past (reaped early) nor beyond one lease.
      const leftAfterSteps: number[] = [];
      const check = async (tickets: LeaseTicket[]) => {
        const [now, scores] = await Promise.all([
          serverNow(raw),
          Promise.all(tickets.map((t) => raw.zscore(holders, t.leaseId))),
        ]);
        for (const score of scores) {
          expect(score, "a long holder's lease vanished").not.toBeNull();
          leftAfterSteps.push(Number(score) - now);
        }
        for (const t of tickets) expect(t.signal.aborted).toBe(false);
      };
      // Stepped back, and back again to where it was: the holders renew as if nothing happened.
      const [aheadHeld, behindHeld, steadyHeld] = longHeld as [LeaseTicket, LeaseTicket, LeaseTicket];
      await sleep(leaseMs * 0.7);
      behind.step(-STEP_MS);
      ahead.step(-STEP_MS);
      await sleep(leaseMs * 0.7);
      await check(longHeld);
      await sleep(leaseMs * 0.7);
      await check(longHeld);
      // Stepped forward past the lease's end: from the process that is what a freeze looks like,
      // so its holder is told at once that its lease is lost, and stops renewing it. Redis still
      // has the lease until its own end: nothing is granted early.
      ahead.step(2 * STEP_MS);
      expect(aheadHeld.signal.aborted).toBe(true);
      expect(aheadHeld.signal.reason).toBeInstanceOf(LeaseLostError);
      oracle.now--;
      const aheadEnd = Number(await raw.zscore(holders, aheadHeld.leaseId));
      expect(aheadEnd).toBeGreaterThan(await serverNow(raw));
      await check([behindHeld, steadyHeld]);
      // Nobody else got in while the long holders held all three permits, until the lost lease
      // ran out on the server.
      await sleep(Math.max(0, aheadEnd - (await serverNow(raw)) - 100));
      if ((await serverNow(raw)) < aheadEnd) expect(oracle.grants).toBe(0);
      await until(() => oracle.grants > 0, { timeoutMs: 5_000, message: "the lost permit never came back" });
      behind.step(STEP_MS);
      ahead.step(-STEP_MS);

      // The long holders give back; the others take turns, the cap holding, clocks still stepping.
      for (const t of [behindHeld, steadyHeld]) {
        oracle.now--;
        await t.release("success");
      }
      await aheadHeld.release("success");
      await stepMidRun(ahead, behind, 150);
      await sleep(150);
      running = false;
      stopSignal.abort();
      await within(Promise.all(callers), 5_000, "the callers");

      expect(oracle.peak).toBeLessThanOrEqual(limit);
      expect(oracle.grants).toBeGreaterThan(10);
      expect(sems[0]!.snapshot().leasesLost).toBeGreaterThanOrEqual(1);
      for (const left of leftAfterSteps) {
        expect(left).toBeGreaterThan(0);
        expect(left).toBeLessThanOrEqual(leaseMs);
      }
      // A waiter stopped while its acquire was out gives back what that acquire got once its reply
      // is here, in the background: after the callers have returned. Nothing else runs a script
      // now, so a lease nobody gave back would stay.
      await until(async () => (await raw.zcard(holders)) === 0, {
        timeoutMs: 2_000,
        message: "leases left when the callers had returned",
      }).catch(async (error: Error) => {
        // (Named as they are when the wait gives up, not as they were when it began.)
        throw new Error(`${error.message}: ${await raw.zrange(holders, 0, -1)}`);
      });
      expect(await raw.hget(stageKey(prefix, "sem", "meta"), "used")).toBe("0");
      expect(unhandled.seen.map(describeError)).toEqual([]);
      console.log(
        `clock steps ±${STEP_MS / 1000} s: long holders stepped back kept their leases across 2.1 leases, ` +
          `the one stepped forward was told its lease was lost and its permit came back at the lease's end ` +
          `(lease left after each step ${Math.min(...leftAfterSteps)}–${Math.max(...leftAfterSteps)} ms of ${leaseMs}); ` +
          `${oracle.grants} later grants, peak ${oracle.peak}/${limit}`,
      );
    } finally {
      unhandled.stop();
    }
  });

  /** Callers on three workers taking one token at a time as fast as the bucket allows. */
  async function drain(
    buckets: ReturnType<Backend["tokenBucket"]>[],
    runMs: number,
    during: () => Promise<void>,
  ): Promise<{ startedAt: number; grants: number[] }> {
    const grants: number[] = [];
    let running = true;
    const startedAt = performance.now();
    const callers = buckets.flatMap((bucket) =>
      [0, 1].map(async () => {
        while (running) {
          await bucket.admit();
          grants.push(performance.now());
        }
      }),
    );
    await Promise.all([during(), sleep(runMs)]);
    running = false;
    await within(Promise.all(callers), 5_000, "the token bucket callers");
    return { startedAt, grants: grants.sort((a, b) => a - b) };
  }

  it("keeps token bucket rates unchanged", async () => {
    const prefix = randomPrefix("faults-clock-bucket");
    const rate = 20;
    const ahead = new SteppedClock();
    const behind = new SteppedClock();
    const buckets = await Promise.all(
      [ahead, behind, undefined].map(async (clock) =>
        (await worker({ prefix, ...(clock ? { clock } : {}) })).tokenBucket("rate", {
          capacity: 20,
          refillPerSecond: rate,
          initialTokens: 1,
        }),
      ),
    );
    const runMs = 2_400;
    const { startedAt, grants } = await drain(buckets, runMs, () => stepMidRun(ahead, behind, 600));

    // Never ahead of the rate: by any grant, at most rate × (time since the start) tokens were
    // granted, plus the one it started with (5 ms allow for Redis reading its clock in whole
    // milliseconds). A step forward would have filled it at once.
    grants.forEach((at, i) => {
      expect(i + 1, `grant ${i + 1} at ${(at - startedAt).toFixed(0)} ms`).toBeLessThanOrEqual(
        Math.floor((rate * (at - startedAt + 5)) / 1000) + 1,
      );
    });
    // Never held back: the rate was kept up (generously: a busy machine runs timers late), with
    // no stall. A step back would have stopped the refill for 10 s.
    const expected = (rate * (grants.at(-1)! - startedAt)) / 1000;
    expect(grants.length).toBeGreaterThanOrEqual(Math.floor(expected * 0.75));
    const gaps = grants.slice(1).map((at, i) => at - grants[i]!);
    expect(Math.max(...gaps)).toBeLessThan(1_000);
    console.log(
      `clock steps ±${STEP_MS / 1000} s: token bucket at ${rate}/s granted ${grants.length} in ` +
        `${((grants.at(-1)! - startedAt) / 1000).toFixed(2)} s (${expected.toFixed(1)} at the exact rate), ` +
        `longest gap ${Math.max(...gaps).toFixed(0)} ms`,
    );
  });

  it('would not with time: "clock", for contrast: a step forward refills the bucket at once', async () => {
    const prefix = randomPrefix("faults-clock-contrast");
    const rate = 20;
    const clock = new SteppedClock();
    const bucket = (await worker({ prefix, clock, time: "clock" })).tokenBucket("rate", {
      capacity: 20,
      refillPerSecond: rate,
      initialTokens: 1,
    });
    const { startedAt, grants } = await drain([bucket], 1_000, async () => {
      await sleep(400);
      clock.step(STEP_MS);
    });
    const ahead = grants.filter((at, i) => i + 1 > Math.floor((rate * (at - startedAt)) / 1000) + 1);
    // The whole capacity was granted at the step, far ahead of the rate.
    expect(ahead.length).toBeGreaterThan(10);
  });
});
