import type { TestProject } from "vitest/node";
import { pruneEntries } from "./bundle.js";
import {
  CLUSTER_INSTALL_HINT,
  freePort,
  haveRedisCli,
  haveRedisServer,
  INSTALL_HINT,
  installRedis,
  RedisCluster,
  RedisProcess,
} from "./redis-server.js";

declare module "vitest" {
  export interface ProvidedContext {
    /** URL of the Redis the suites use, or "" when there is none. */
    redisUrl: string;
    /** Why there is no Redis, when there is none. */
    redisError: string;
    /** Seed nodes of the Redis Cluster the suites use (`host:port,host:port,…`), or "" when there is none. */
    redisClusterNodes: string;
    /** Why there is no Redis Cluster, when there is none. */
    redisClusterError: string;
  }
}

/** What the suites are given: the `ProvidedContext` values. */
type Provided = {
  redisUrl: string;
  redisError: string;
  redisClusterNodes: string;
  redisClusterError: string;
};

/**
 * The servers of this vitest process, started once for every project (the suite and the fault
 * suites both call `setup`, maybe from two copies of this module): kept on `globalThis`, with
 * the number of projects set up, so the last teardown stops them.
 */
interface Shared {
  started: Promise<Provided> | undefined;
  server: RedisProcess | undefined;
  cluster: RedisCluster | undefined;
  users: number;
}
const SHARED = Symbol.for("floodgate.test.redis");
const holder = globalThis as { [SHARED]?: Shared };

/**
 * Give the Redis suites a real server: REDIS_URL when set, else a throwaway redis-server on a
 * free loopback port. Give the Redis Cluster suites a real cluster: REDIS_CLUSTER_NODES when set,
 * else three throwaway cluster nodes on free loopback ports. Without either, those suites fail
 * with an install hint (they never skip); the in-memory suites still run. Every project of the
 * run gets the same server and cluster.
 */
export async function setup(project: TestProject): Promise<void> {
  holder[SHARED] ??= { started: undefined, server: undefined, cluster: undefined, users: 0 };
  const shared = holder[SHARED];
  // (Before any file runs: no fixture process of this run starts from a bundle yet.)
  if (shared.users === 0) pruneEntries();
  shared.started ??= startAll(shared);
  shared.users++;
  const provided = await shared.started;
  for (const [key, value] of Object.entries(provided) as [keyof Provided, string][])
    project.provide(key, value);
}

async function startAll(shared: Shared): Promise<Provided> {
  const needsServer = !process.env.REDIS_URL || !process.env.REDIS_CLUSTER_NODES;
  if (needsServer && !haveRedisServer()) await installRedis();
  const [server, cluster] = await Promise.allSettled([setupServer(shared), setupCluster(shared)]);
  if (server.status === "rejected" || cluster.status === "rejected") {
    await stopAll(shared);
    throw server.status === "rejected" ? server.reason : (cluster as PromiseRejectedResult).reason;
  }
  return { ...server.value, ...cluster.value };
}

async function setupServer(shared: Shared): Promise<Pick<Provided, "redisUrl" | "redisError">> {
  if (process.env.REDIS_URL) return { redisUrl: process.env.REDIS_URL, redisError: "" };
  if (!haveRedisServer()) {
    return { redisUrl: "", redisError: `redis-server was not found on the PATH. ${INSTALL_HINT}` };
  }
  const server = new RedisProcess(await freePort());
  shared.server = server;
  await server.start();
  return { redisUrl: server.url, redisError: "" };
}

async function setupCluster(
  shared: Shared,
): Promise<Pick<Provided, "redisClusterNodes" | "redisClusterError">> {
  const fail = (why: string) => ({
    redisClusterNodes: "",
    redisClusterError: `${why} ${CLUSTER_INSTALL_HINT}`,
  });
  if (process.env.REDIS_CLUSTER_NODES) {
    return { redisClusterNodes: process.env.REDIS_CLUSTER_NODES, redisClusterError: "" };
  }
  if (!haveRedisServer()) return fail("redis-server was not found on the PATH.");
  if (!haveRedisCli()) return fail("redis-cli was not found on the PATH.");
  const started = new RedisCluster();
  try {
    await started.start();
  } catch (error) {
    return fail(`The Redis Cluster could not be started: ${error instanceof Error ? error.message : error}.`);
  }
  shared.cluster = started;
  return { redisClusterNodes: started.nodeList, redisClusterError: "" };
}

async function stopAll(shared: Shared): Promise<void> {
  await Promise.all([shared.server?.stop(), shared.cluster?.stop()]);
}

/** The last project's teardown stops the servers. */
export async function teardown(): Promise<void> {
  const shared = holder[SHARED];
  if (shared === undefined || --shared.users > 0) return;
  holder[SHARED] = undefined;
  await stopAll(shared);
}
