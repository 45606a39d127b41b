import { Gate } from "floodgate";
import { Redis } from "ioredis";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { randomPrefix, sleep, until, within } from "../redis/helpers.js";
import { dropAny, isReady, LIBRARIES } from "../redis/libraries.js";
import { RedisCluster } from "../setup/redis-server.js";
import {
  describeError,
  expectExactPermits,
  expectFailClosed,
  expectFailedInTime,
  faultBackend,
  COMMAND_TIMEOUT_MS as HARNESS_TIMEOUT_MS,
  Load,
  NEW_CALL_BOUND_MS,
  RECOVERY_BOUND_MS,
  recordUnhandled,
  SLACK_MS,
  spread,
} from "./harness.js";

const LIMIT = 3;
/** Short, so the quarantine after the restart (the node came back empty) is short too. */
const LEASE_MS = 1_000;
const COMMAND_TIMEOUT_MS = 2_000;
const CALLERS = 6;
/** The node is down this long: well under the cluster's node timeout (5 s), so no failover. */
const DOWN_MS = 500;
/** A master hangs this long (`DEBUG SLEEP`), as short of the node timeout. */
const HANG_S = 1.5;

/**
 * One master of a Redis Cluster of this file's own (three masters, no replicas, nothing
 * persisted, `DEBUG` on, shared by its tests) killed and started again, empty, while callers go through a semaphore and a token
 * bucket whose keys live on it. Or hanging while its connections stay open (`DEBUG SLEEP`), as
 * a single server's test does (debug-sleep.test.ts): calls fail closed within their command
 * timeout, and what it ran late is given back. As the single-server restart (scripts-restart.test.ts): calls fail
 * only with `BackendUnavailableError` while it is down (until the cluster says it is ok again on
 * every node), the semaphore holds its grants back for a
 * lease once it is back (it lost its leases), the cap holds throughout, and no lease is left.
 * And a slot its owner lets go for a moment (`CLUSTER DELSLOTS`): the Cluster answers CLUSTERDOWN,
 * which every client asks again (floodgate itself on node-redis), so the call is admitted once
 * the slot is served again, within its command timeout.
 */
let cluster: RedisCluster;

/** The hash slot of `key`, and the port of the master that serves it. */
async function ownerOf(seeds: { port: number }[], key: string): Promise<{ port: number; slot: number }> {
  const probe = new Redis({ port: seeds[0]!.port, host: "127.0.0.1", lazyConnect: true });
  probe.on("error", () => {});
  await probe.connect();
  try {
    const slot = (await probe.call("CLUSTER", "KEYSLOT", key)) as number;
    const ranges = (await probe.call("CLUSTER", "SLOTS")) as [number, number, [string, number]][];
    return { port: ranges.find(([from, to]) => slot >= from && slot <= to)![2][1], slot };
  } finally {
    probe.disconnect();
  }
}

beforeAll(async () => {
  cluster = new RedisCluster();
  // (`DEBUG` is off by default since Redis 7.)
  await cluster.start(3, ["--enable-debug-command", "yes"]);
}, 60_000);

afterAll(async () => {
  await cluster?.stop();
});

describe.each(LIBRARIES.filter((l) => l.connectCluster !== undefined))(
  "a Redis Cluster master restarted empty under load, on $name",
  (library) => {
    const cleanups: (() => Promise<unknown> | unknown)[] = [];

    afterEach(async () => {
      for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
    });

    /**
     * Two Cluster clients of the library (one for pub/sub) and a backend on them, on this file's
     * cluster, with calls timed out after `commandTimeoutMs`.
     */
    async function setup(label: string, commandTimeoutMs = COMMAND_TIMEOUT_MS) {
      const seeds = cluster.nodes.map((node) => ({ host: "127.0.0.1", port: node.port }));
      const connect = async () => {
        const client = await library.connectCluster!(seeds, { reconnect: true });
        cleanups.push(() => dropAny(client));
        return client;
      };
      const [main, subscriber] = await Promise.all([connect(), connect()]);
      const prefix = randomPrefix(`faults-cluster-${label}`);
      const backend = faultBackend(main, subscriber, prefix, cleanups, commandTimeoutMs);
      return { seeds, main, subscriber, prefix, backend };
    }

    it("asks a cluster that answers CLUSTERDOWN again, within the command timeout, and takes the permit once", async () => {
      const { seeds, prefix, backend } = await setup("down");
      const sem = backend.semaphore("sem", { limit: 1, leaseMs: 30_000 });
      await (await sem.admit()).release("success");
      const { port, slot } = await ownerOf(seeds, `${prefix}{sem}:holders`);
      const owner = new Redis({ port, host: "127.0.0.1", lazyConnect: true });
      owner.on("error", () => {});
      await owner.connect();
      cleanups.push(async () => {
        await owner.call("CLUSTER", "ADDSLOTS", String(slot)).catch(() => {});
        await cluster.waitForOk();
        owner.disconnect();
      });
      // The slot's owner lets it go: the cluster answers CLUSTERDOWN for it until it takes it back.
      await owner.call("CLUSTER", "DELSLOTS", String(slot));
      // Without asking again, it fails at once; the link fails it after the command timeout.
      const admitted = sem.tryAdmit();
      await sleep(300);
      await owner.call("CLUSTER", "ADDSLOTS", String(slot));
      const ticket = await admitted;
      expect(ticket, "the permit, once the cluster served the slot again").toBeDefined();
      expect(await sem.tryAdmit(), "a second permit of a limit of 1").toBeUndefined();
      await ticket!.release("success");
      expect(await owner.zcard(`${prefix}{sem}:holders`)).toBe(0);
    }, 30_000);

    it("fails calls only with BackendUnavailableError while the node is down, holds the cap through its quarantine, and leaves no lease", async () => {
      const unhandled = recordUnhandled();
      cleanups.push(() => unhandled.stop());
      const { seeds, main, subscriber, prefix, backend } = await setup("restart");
      const sem = backend.semaphore("sem", { limit: LIMIT, leaseMs: LEASE_MS });
      const gate = new Gate([sem, backend.tokenBucket("rate", { capacity: 10, refillPerSecond: 500 })]);
      const load = new Load((work) => gate.run(work, { timeoutMs: 15_000 }), CALLERS, 10);
      cleanups.push(() => load.stop());

      // The master that holds the semaphore's keys (they share its name's hash slot).
      const { port } = await ownerOf(seeds, `${prefix}{sem}:holders`);
      const node = cluster.nodes.find((n) => n.port === port)!;

      // Two calls hold their permits across the restart, counted by the oracle as running: the
      // node forgets them, and only its quarantine keeps the load from taking their permits again
      // (which would put five calls in flight against a limit of three).
      const across = await Promise.all([gate.admit(), gate.admit()]);
      load.oracle.now += across.length;
      load.oracle.peak = Math.max(load.oracle.peak, load.oracle.now);
      const startedAt = performance.now();
      load.start();
      await sleep(1_500);
      expect(load.between(startedAt, performance.now()).filter((c) => c.ok).length).toBeGreaterThan(10);

      const down = performance.now();
      await node.stop();
      await sleep(DOWN_MS);
      await node.start();
      // Up again once the cluster says so on every node: until then the nodes answer CLUSTERDOWN
      // (which a client may retry, as ioredis does, or pass on, as node-redis does).
      await cluster.waitForOk();
      const up = performance.now();
      await until(() => isReady(main) && isReady(subscriber), {
        timeoutMs: 10_000,
        message: "the Cluster clients did not come back after the restart",
      });
      // The calls across the restart end well within the lease after it; their leases are gone.
      await sleep(LEASE_MS * 0.6);
      for (const ticket of across) {
        await ticket.release("success").catch(() => {});
        load.oracle.now--;
      }
      // The node came back empty: the semaphore holds its grants back for one lease (quarantine).
      const recovered = (await load.firstSuccessAfter(up, 2 * LEASE_MS + 10_000)) - up;
      await sleep(1_000);
      await load.stop();

      const failed = load.calls.filter((c) => !c.ok);
      expect(
        load.otherFailures().map((c) => describeError(c.error)),
        "calls that failed other than with BackendUnavailableError",
      ).toEqual([]);
      // A failure overlaps the down window (stop, then until the cluster is ok again, plus slack).
      const late = failed.filter((c) => !(c.endedAt >= down && c.startedAt <= up + SLACK_MS));
      expect(late.map((c) => describeError(c.error))).toEqual([]);
      expect(load.oracle.peak).toBeLessThanOrEqual(LIMIT);
      expect(recovered).toBeLessThan(2 * LEASE_MS + 8_000);
      const raw = new Redis({ port, host: "127.0.0.1", lazyConnect: true });
      raw.on("error", () => {});
      await raw.connect();
      cleanups.push(() => raw.disconnect());
      await expectExactPermits(raw, prefix, "sem", sem, LIMIT, 2 * LEASE_MS + 5_000);
      expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
      expect(unhandled.seen.map(describeError)).toEqual([]);

      console.log(
        `cluster restart (${library.name}): node ${port} down ${DOWN_MS} ms; ${load.calls.length} calls, ` +
          `${failed.length} failed closed (all BackendUnavailableError, all in the down window); ` +
          `restart → first success ${Math.round(recovered)} ms (a lease's quarantine included); peak ${load.oracle.peak}/${LIMIT}`,
      );
    }, 60_000);

    it("fails calls closed within the command timeout while a master hangs, recovers when it wakes, and counts exactly", async () => {
      const unhandled = recordUnhandled();
      cleanups.push(() => unhandled.stop());
      // The harness's command timeout (300 ms): a hang is seen as one.
      const { seeds, prefix, backend } = await setup("hang", HARNESS_TIMEOUT_MS);
      const sem = backend.semaphore("sem", { limit: LIMIT, leaseMs: 8_000 });
      const bucket = backend.tokenBucket("rate", { capacity: 10, refillPerSecond: 500 });
      const gate = new Gate([sem, bucket]);
      const load = new Load((work) => gate.run(work, { timeoutMs: 10_000 }), CALLERS, 10);
      cleanups.push(() => load.stop());
      // The master that holds the semaphore's keys, on a connection of its own.
      const { port } = await ownerOf(seeds, `${prefix}{sem}:holders`);
      const { port: bucketPort } = await ownerOf(seeds, `${prefix}{rate}:b:default`);
      expect(bucketPort, "the bucket's keys on another master than the semaphore's").not.toBe(port);
      const admin = new Redis({ port, host: "127.0.0.1", lazyConnect: true });
      admin.on("error", () => {});
      await admin.connect();
      cleanups.push(() => admin.disconnect());
      load.start();
      await until(() => load.calls.filter((c) => c.ok).length >= 10, {
        timeoutMs: 5_000,
        message: "the load never got going",
      });

      const faultAt = performance.now();
      const hang = admin.call("DEBUG", "SLEEP", String(HANG_S));
      // Let the DEBUG command reach the node before the probes go out.
      await sleep(20);
      const probes = await expectFailClosed([
        ["sem.tryAdmit()", () => sem.tryAdmit()],
        ["sem.admit()", () => sem.admit({ timeoutMs: 5_000 })],
        ["gate.run()", () => gate.run(() => "sent", { timeoutMs: 5_000 })],
      ]);
      // The bucket's keys hash elsewhere (their own slot, on another master here): a node that
      // hangs holds up only its own.
      const bucketAt = performance.now();
      await within(bucket.admit({ timeoutMs: 5_000 }), 5_000, "the bucket on another node").then((t) =>
        t.release("success"),
      );
      expect(performance.now() - bucketAt, "the bucket on another node, while this one hangs").toBeLessThan(
        NEW_CALL_BOUND_MS,
      );
      expect(await within(hang, 10_000, "DEBUG SLEEP")).toBe("OK");
      const wokeAt = performance.now();
      const firstOk = await load.firstSuccessAfter(wokeAt, RECOVERY_BOUND_MS + 2_000);
      await sleep(500);
      await load.stop();

      expect(load.otherFailures().map((c) => describeError(c.error))).toEqual([]);
      // Every call that failed did so in time; a call sent during the hang and answered after it
      // may succeed (the node ran it late), once.
      expectFailedInTime(load, faultAt, wokeAt);
      expect(load.between(faultAt + 20, wokeAt - HANG_S * 1000 * 0.5).filter((c) => c.ok)).toEqual([]);
      expect(firstOk - wokeAt).toBeLessThan(RECOVERY_BOUND_MS);
      expect(load.oracle.peak).toBeLessThanOrEqual(LIMIT);
      // The acquires the node ran late, for callers that had given up, are given back (well before
      // their lease would have run out), and nothing is counted twice.
      await expectExactPermits(admin, prefix, "sem", sem, LIMIT, 2_500);
      expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
      expect(unhandled.seen.map(describeError)).toEqual([]);

      const failed = load.calls.filter((c) => !c.ok && c.endedAt > faultAt);
      console.log(
        `cluster DEBUG SLEEP ${HANG_S} s (${library.name}): new calls fail closed ${spread(probes)}; ` +
          `load calls failed ${failed.length}, fault → typed error ` +
          `${spread(failed.map((c) => c.endedAt - Math.max(c.startedAt, faultAt)))}; ` +
          `wake → first success ${(firstOk - wokeAt).toFixed(0)} ms; peak ${load.oracle.peak}/${LIMIT}`,
      );
    }, 60_000);
  },
);
