import { Gate } from "floodgate";
import { stageKey } from "floodgate/redis";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { connectedClient, randomPrefix, sleep, until, within } from "../redis/helpers.js";
import { freePort, type RedisProcess } from "../setup/redis-server.js";
import {
  commandQueueLength,
  describeError,
  expectExactPermits,
  expectFailClosed,
  expectFailedInTime,
  faultBackend,
  Load,
  offlineQueueLength,
  RECOVERY_BOUND_MS,
  recordUnhandled,
  spread,
  startRedis,
} from "./harness.js";

const LIMIT = 3;
/** Long enough that a lease left behind by the hang would still be live when the counts are checked. */
const LEASE_MS = 8_000;
const SLEEP_S = 1.5;

/**
 * `DEBUG SLEEP`: Redis stops answering while every connection stays open, then runs everything
 * it was sent, late. Its own server, because `DEBUG` is off by default since Redis 7.
 */
describe("a Redis that hangs while connected (DEBUG SLEEP)", () => {
  let server: RedisProcess;
  const cleanups: (() => Promise<unknown> | unknown)[] = [];

  beforeAll(async () => {
    server = await startRedis(await freePort(), ["--enable-debug-command", "yes"]);
  });

  afterAll(async () => {
    await server?.stop();
  });

  afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
  });

  it("fails callers closed within the command timeout, recovers when Redis wakes, and counts exactly", async () => {
    const unhandled = recordUnhandled();
    cleanups.push(() => unhandled.stop());
    const connect = async () => {
      const client = await connectedClient(server.url, { retryStrategy: () => 50 });
      cleanups.push(() => client.disconnect());
      return client;
    };
    const [main, subscriber, raw, admin] = await Promise.all([connect(), connect(), connect(), connect()]);
    const prefix = randomPrefix("faults-debug-sleep");
    const backend = faultBackend(main, subscriber, prefix, cleanups);
    const sem = backend.semaphore("sem", { limit: LIMIT, leaseMs: LEASE_MS });
    const bucket = backend.tokenBucket("rate", { keyed: true, capacity: 5, refillPerSecond: 80 });
    const gate = new Gate([bucket, sem]);
    const load = new Load((work) => gate.run(work, { timeoutMs: 10_000, key: "load" }), 6, 20);
    cleanups.push(() => load.stop());
    load.start();
    await until(() => load.calls.filter((c) => c.ok).length >= 10, {
      timeoutMs: 5_000,
      message: "the load never got going",
    });

    let offline = 0;
    let pending = 0;
    const sampler = setInterval(() => {
      offline = Math.max(offline, offlineQueueLength(main), offlineQueueLength(subscriber));
      pending = Math.max(pending, commandQueueLength(main));
    }, 10);
    cleanups.push(() => clearInterval(sampler));

    const faultAt = performance.now();
    const hang = admin.call("DEBUG", "SLEEP", String(SLEEP_S));
    // Let the DEBUG command reach Redis before the probes go out.
    await sleep(20);
    const probes = await expectFailClosed([
      ["sem.tryAdmit()", () => sem.tryAdmit()],
      ["sem.admit()", () => sem.admit({ timeoutMs: 5_000 })],
      ["bucket.admit()", () => bucket.admit({ key: "probe", timeoutMs: 5_000 })],
      ["gate.run()", () => gate.run(() => "sent", { timeoutMs: 5_000, key: "probe" })],
    ]);
    expect(await within(hang, 10_000, "DEBUG SLEEP")).toBe("OK");
    const wokeAt = performance.now();
    const firstOk = await load.firstSuccessAfter(wokeAt, RECOVERY_BOUND_MS + 2_000);
    await sleep(500);
    await load.stop();
    clearInterval(sampler);

    expect(load.otherFailures().map((c) => describeError(c.error))).toEqual([]);
    // Every call that failed did so in time; a call sent during the hang and answered after it
    // may succeed (Redis ran it late), which is fine: it was admitted by Redis, once.
    expectFailedInTime(load, faultAt, wokeAt);
    expect(load.between(faultAt + 20, wokeAt - SLEEP_S * 1000 * 0.5).filter((c) => c.ok)).toEqual([]);
    expect(offline).toBe(0);
    await until(() => commandQueueLength(main) === 0, {
      timeoutMs: 2_000,
      message: "commands sent during the hang still wait for replies after it",
    });
    expect(firstOk - wokeAt).toBeLessThan(RECOVERY_BOUND_MS);
    expect(load.oracle.peak).toBeLessThanOrEqual(LIMIT);
    // The acquires Redis ran late, for callers that had given up, are given back (well before
    // their lease would have run out), and nothing is counted twice.
    await expectExactPermits(raw, prefix, "sem", sem, LIMIT, 2_500);
    expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    expect(await raw.zcard(stageKey(prefix, "sem", "qexp"))).toBe(0);
    expect(unhandled.seen.map(describeError)).toEqual([]);

    const failed = load.calls.filter((c) => !c.ok && c.endedAt > faultAt);
    console.log(
      `DEBUG SLEEP ${SLEEP_S} s: new calls fail closed ${spread(probes)}; load calls failed ${failed.length}, ` +
        `fault → typed error ${spread(failed.map((c) => c.endedAt - Math.max(c.startedAt, faultAt)))}; ` +
        `wake → first success ${(firstOk - wokeAt).toFixed(0)} ms; offline queue max ${offline}, ` +
        `pending replies max ${pending}; peak ${load.oracle.peak}/${LIMIT}`,
    );
  });
});
