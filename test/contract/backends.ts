import { randomUUID } from "node:crypto";
import { type Backend, memory } from "floodgate";
import { type RedisClient, redis } from "floodgate/redis";
import type { FakeClock } from "floodgate/testing";
import { Cluster, type ClusterNode, Redis } from "ioredis";
import { Redis as Redis6 } from "ioredis6";
import { afterAll, beforeAll, inject } from "vitest";
import { closeAny, LIBRARIES } from "../redis/libraries.js";

/**
 * The backends every contract suite runs against. Each builds a fresh backend driven by the
 * given fake clock (and a fixed `random` for jitter), with names that do not collide.
 */
export interface ContractBackend {
  name: string;
  make(clock: FakeClock, random?: () => number): Backend;
  setup?(): Promise<void>;
  teardown?(): Promise<void>;
}

/** The URL of the test Redis, or an error saying how to get one. Never a skip. */
export function redisUrl(): string {
  const url = inject("redisUrl");
  if (!url) throw new Error(inject("redisError") || "no Redis for the Redis suites");
  return url;
}

/** A client that fails fast, as the Redis suites want: no retries, no offline queue. */
export function testClient(url = redisUrl()): Redis {
  return new Redis(url, { maxRetriesPerRequest: 0, enableOfflineQueue: false, lazyConnect: true });
}

/** The seed nodes of the test Redis Cluster, or an error saying how to get one. Never a skip. */
export function redisClusterNodes(): ClusterNode[] {
  const nodes = inject("redisClusterNodes");
  if (!nodes) throw new Error(inject("redisClusterError") || "no Redis Cluster for the Redis Cluster suites");
  return nodes.split(",").map((entry) => {
    const node = entry.trim();
    const at = node.lastIndexOf(":");
    return { host: node.slice(0, at), port: Number(node.slice(at + 1)) };
  });
}

/**
 * A Cluster client that fails fast, like `testClient`: no retries, no offline queue. The offline
 * queue is turned off on the Cluster itself; ioredis keeps it on for the per-node connections it
 * makes (and its types refuse the option there).
 */
export function testClusterClient(nodes = redisClusterNodes()): Cluster {
  return new Cluster(nodes, {
    redisOptions: { maxRetriesPerRequest: 0 },
    enableOfflineQueue: false,
    lazyConnect: true,
    clusterRetryStrategy: () => null,
  });
}

/** Fail-fast options, as for `testClient`. */
const FAIL_FAST = { maxRetriesPerRequest: 0, enableOfflineQueue: false, lazyConnect: true } as const;

/**
 * A backend on `client` (and `subscriber`) for one contract test: a fresh prefix, the test's
 * fake clock and `random`.
 */
function contractRedis(
  client: RedisClient,
  subscriber: RedisClient,
  clock: FakeClock,
  random: (() => number) | undefined,
): Backend {
  return redis(client, {
    prefix: `contract:${randomUUID()}:`,
    clock,
    time: "clock",
    subscriber,
    // A FakeClock jumps (`advance(100_000)` runs every timer at once) while replies and
    // pub/sub messages still take real time, so a grant's default 500 ms window would run out
    // before its message arrives and every grant would be claimed again in Redis: slower,
    // not different. Windows these suites' jumps cannot outrun keep them to the contract;
    // test/redis/liveness and test/faults/chaos cover the defaults in real time.
    claimMs: 30_000,
    livenessMs: 600_000,
    ...(random ? { random } : {}),
  });
}

/** The single-node backend on ioredis 5, or on ioredis 6 (installed as `ioredis6`). */
function redisBackend(name: string, connect: (url: string) => Redis): ContractBackend {
  let client: Redis | undefined;
  let subscriber: Redis | undefined;
  return {
    name,
    async setup() {
      client = connect(redisUrl());
      subscriber = connect(redisUrl());
      await Promise.all([client.connect(), subscriber.connect()]);
    },
    async teardown() {
      await Promise.all([client?.quit(), subscriber?.quit()]);
    },
    make(clock, random) {
      if (!client || !subscriber) throw new Error("the Redis contract backend was not set up");
      return contractRedis(client, subscriber, clock, random);
    },
  };
}

const ioredis6 = (url: string) => new Redis6(url, FAIL_FAST) as unknown as Redis;

function redisClusterBackend(): ContractBackend {
  let client: Cluster | undefined;
  let subscriber: Cluster | undefined;
  return {
    name: "redis-cluster",
    async setup() {
      client = testClusterClient();
      subscriber = testClusterClient();
      await Promise.all([client.connect(), subscriber.connect()]);
    },
    async teardown() {
      await Promise.all([client?.quit(), subscriber?.quit()]);
    },
    make(clock, random) {
      if (!client || !subscriber) throw new Error("the Redis Cluster contract backend was not set up");
      return contractRedis(client, subscriber, clock, random);
    },
  };
}

/**
 * A backend on a client of another library (node-redis 6 or 5, iovalkey), on the single server
 * or the Cluster: a client and a subscriber opened by `open`, with the options of the backends
 * above.
 */
function libraryBackend(name: string, open: () => Promise<RedisClient>): ContractBackend {
  let client: RedisClient | undefined;
  let subscriber: RedisClient | undefined;
  return {
    name,
    async setup() {
      [client, subscriber] = await Promise.all([open(), open()]);
    },
    async teardown() {
      await Promise.all([closeAny(client), closeAny(subscriber)]);
    },
    make(clock, random) {
      if (!client || !subscriber) throw new Error(`the ${name} contract backend was not set up`);
      return contractRedis(client, subscriber, clock, random);
    },
  };
}

const library = (name: string) => LIBRARIES.find((l) => l.name === name)!;

/** The single-server and Cluster backends of each library other than ioredis. */
const libraryBackends: ContractBackend[] = ["node-redis", "node-redis5", "iovalkey"].flatMap((name) => {
  const lib = library(name);
  const single = libraryBackend(`redis-${name}`, () => lib.connect(redisUrl()));
  if (!lib.connectCluster) return [single];
  const connectCluster = lib.connectCluster;
  return [single, libraryBackend(`redis-cluster-${name}`, () => connectCluster(redisClusterNodes()))];
});

/** Every backend the contract suites know, by the names `FLOODGATE_BACKENDS` takes. */
export const allBackends: readonly ContractBackend[] = [
  { name: "memory", make: (clock, random) => memory({ clock, ...(random ? { random } : {}) }) },
  redisBackend("redis", testClient),
  redisBackend("redis-ioredis6", ioredis6),
  redisClusterBackend(),
  ...libraryBackends,
];

/**
 * The backends named in `selection` (a comma-separated list, as `FLOODGATE_BACKENDS` holds), in
 * the order of `all`; every one when `selection` is unset or blank. An unknown name throws, so a
 * typo never runs fewer suites in silence. A Redis backend selected still needs Redis: without
 * one its suites fail, never skip.
 */
export function selectBackends(
  all: readonly ContractBackend[],
  selection: string | undefined,
): ContractBackend[] {
  const names = (selection ?? "")
    .split(",")
    .map((name) => name.trim())
    .filter((name) => name.length > 0);
  if (names.length === 0) return [...all];
  const known = all.map((b) => b.name);
  const unknown = names.filter((name) => !known.includes(name));
  if (unknown.length > 0) {
    throw new Error(
      `FLOODGATE_BACKENDS names ${unknown.map((n) => `"${n}"`).join(", ")}, which is no contract backend (they are: ${known.join(", ")})`,
    );
  }
  return all.filter((b) => names.includes(b.name));
}

/** The backends every contract suite runs against: `FLOODGATE_BACKENDS` when set, else all. */
export const backends: ContractBackend[] = selectBackends(allBackends, process.env.FLOODGATE_BACKENDS);

/**
 * The backends of the slower suites (property runs, HTTP): memory and the ioredis server when
 * selected, which covers both stores (the other clients share every line above the client
 * interface, which the contract suites cover on each); otherwise every selected backend, so a run
 * that selects only others (`FLOODGATE_BACKENDS=redis-cluster`) still runs them there.
 */
export const coreBackends: ContractBackend[] = ((core) => (core.length > 0 ? core : backends))(
  backends.filter((b) => b.name === "memory" || b.name === "redis"),
);

/** Set a backend up before its suite and tear it down after. */
export function useBackend(backend: ContractBackend): void {
  beforeAll(async () => backend.setup?.());
  afterAll(async () => backend.teardown?.());
}

/** Settle a promise into a tag we can assert on without awaiting it forever. */
export function track<T>(promise: Promise<T>) {
  const state: { settled: boolean; value?: T; error?: unknown } = { settled: false };
  promise.then(
    (value) => {
      state.settled = true;
      state.value = value;
    },
    (error) => {
      state.settled = true;
      state.error = error;
    },
  );
  return state;
}
