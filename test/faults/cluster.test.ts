import { randomUUID } from "node:crypto";
import { Gate } from "floodgate";
import type { RedisClient } from "floodgate/redis";
import { Redis } from "ioredis";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { redisClusterNodes, testClusterClient } from "../contract/backends.js";
import { randomPrefix, sleep, until } from "../redis/helpers.js";
import { dropAny, LIBRARIES } from "../redis/libraries.js";
import {
  describeError,
  expectExactPermits,
  faultBackend,
  IN_FLIGHT_BOUND_MS,
  Load,
  RECOVERY_BOUND_MS,
  recordUnhandled,
  spread,
} from "./harness.js";

const LIMIT = 3;
const LEASE_MS = 8_000;
const CALLERS = 6;
const COMMAND_TIMEOUT_MS = 1_000;

/**
 * The three-node test Cluster, shared with the other suites, under faults that touch only this
 * file's connections: `SCRIPT FLUSH` on every node again and again, and this file's client
 * connections killed on every node (`CLIENT KILL ID`, found by their connection name), while
 * callers go through a semaphore and a token bucket on a Cluster client of each library.
 */
describe.each(LIBRARIES)("the Redis Cluster under faults, on $name", (library) => {
  let nodes: Redis[] = [];
  const cleanups: (() => Promise<unknown> | unknown)[] = [];

  beforeAll(async () => {
    nodes = await Promise.all(
      redisClusterNodes().map(async (seed) => {
        const { host, port } = seed as { host: string; port: number };
        const node = new Redis({ host, port, lazyConnect: true });
        node.on("error", () => {});
        await node.connect();
        return node;
      }),
    );
  });

  afterAll(async () => {
    await Promise.all(nodes.map((node) => node.quit()));
  });

  afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
  });

  async function setup(label: string) {
    if (!library.connectCluster) throw new Error(`${library.name} has no Cluster client`);
    const name = `fgfault-${randomUUID().slice(0, 8)}`;
    const unhandled = recordUnhandled();
    cleanups.push(() => unhandled.stop());
    const connect = async () => {
      const client: RedisClient = await library.connectCluster!(redisClusterNodes(), {
        name,
        reconnect: true,
      });
      cleanups.push(() => dropAny(client));
      return client;
    };
    const [main, subscriber] = await Promise.all([connect(), connect()]);
    const raw = testClusterClient();
    await raw.connect();
    cleanups.push(() => raw.disconnect());
    const prefix = randomPrefix(`faults-cluster-${label}`);
    const backend = faultBackend(main, subscriber, prefix, cleanups, COMMAND_TIMEOUT_MS);
    const sem = backend.semaphore("sem", { limit: LIMIT, leaseMs: LEASE_MS });
    const bucket = backend.tokenBucket("rate", { capacity: 10, refillPerSecond: 500 });
    const gate = new Gate([sem, bucket]);
    const load = new Load((work) => gate.run(work, { timeoutMs: 10_000 }), CALLERS, 10);
    cleanups.push(() => load.stop());
    return { name, unhandled, raw, prefix, sem, gate, load };
  }

  /** Kill every connection named `name` on every node; how many were killed. */
  async function killConnections(name: string): Promise<number> {
    let killed = 0;
    for (const node of nodes) {
      const list = (await node.client("LIST")) as string;
      for (const line of list.split("\n")) {
        if (!line.includes(` name=${name} `)) continue;
        const id = /(?:^|\s)id=(\d+)/.exec(line)?.[1];
        if (id) killed += Number(await node.client("KILL", "ID", id));
      }
    }
    return killed;
  }

  it("loses no call to SCRIPT FLUSH on every node", async () => {
    const s = await setup("flush");
    s.load.start();
    let flushes = 0;
    let flushing = true;
    const flusher = (async () => {
      while (flushing) {
        await sleep(20 + Math.random() * 30);
        await Promise.all(nodes.map((node) => node.script("FLUSH")));
        flushes++;
      }
    })();
    await sleep(1_500);
    flushing = false;
    await flusher;
    await s.load.stop();
    expect(s.load.calls.filter((c) => !c.ok).map((c) => describeError(c.error))).toEqual([]);
    expect(s.load.calls.length).toBeGreaterThan(20);
    expect(flushes).toBeGreaterThan(5);
    expect(s.load.oracle.peak).toBeLessThanOrEqual(LIMIT);
    await expectExactPermits(s.raw as unknown as Redis, s.prefix, "sem", s.sem, LIMIT, 2_500);
    expect(s.unhandled.seen.map(describeError)).toEqual([]);
    console.log(
      `cluster SCRIPT FLUSH ×${flushes} on ${nodes.length} nodes (${library.name}): ${s.load.calls.length} calls, none failed; peak ${s.load.oracle.peak}/${LIMIT}`,
    );
  });

  it("fails calls only with BackendUnavailableError when its connections are cut on every node, recovers, and counts nothing twice", async () => {
    const s = await setup("cut");
    s.load.start();
    await until(() => s.load.calls.filter((c) => c.ok).length >= 10, {
      timeoutMs: 5_000,
      message: "the load never got going",
    });
    const recoveries: number[] = [];
    let killed = 0;
    for (let i = 0; i < 3; i++) {
      const cutAt = performance.now();
      killed += await killConnections(s.name);
      recoveries.push((await s.load.firstSuccessAfter(cutAt, RECOVERY_BOUND_MS + 5_000)) - cutAt);
      await sleep(200);
    }
    await sleep(300);
    await s.load.stop();

    expect(killed).toBeGreaterThan(0);
    const others = s.load.otherFailures().map((c) => describeError(c.error));
    expect(others, "calls that failed other than with BackendUnavailableError").toEqual([]);
    const failed = s.load.calls.filter((c) => !c.ok);
    expect(failed.filter((c) => c.endedAt - c.startedAt > IN_FLIGHT_BOUND_MS + COMMAND_TIMEOUT_MS)).toEqual(
      [],
    );
    expect(Math.max(...recoveries)).toBeLessThan(RECOVERY_BOUND_MS + 5_000);
    expect(s.load.oracle.peak).toBeLessThanOrEqual(LIMIT);
    await expectExactPermits(s.raw as unknown as Redis, s.prefix, "sem", s.sem, LIMIT, 5_000);
    expect(s.gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    expect(s.unhandled.seen.map(describeError)).toEqual([]);
    console.log(
      `cluster cut ×3 (${library.name}): ${killed} connections killed, ${failed.length} calls failed closed` +
        (failed.length ? `, each within ${spread(failed.map((c) => c.endedAt - c.startedAt))}` : "") +
        `; cut → next success ${spread(recoveries)}; peak ${s.load.oracle.peak}/${LIMIT}`,
    );
  });
});
