import type { TestProject } from "vitest/node";
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

let server: RedisProcess | undefined;
let cluster: RedisCluster | undefined;

/**
 * Give the Redis suites a real server: REDIS_URL when set, else a throwaway redis-server on a
 * free loopback port. Give the Redis Cluster suites a real cluster: REDIS_CLUSTER_NODES when set,
 * else three throwaway cluster nodes on free loopback ports. Without either, those suites fail
 * with an install hint (they never skip); the in-memory suites still run.
 */
export async function setup(project: TestProject): Promise<void> {
  const needsServer = !process.env.REDIS_URL || !process.env.REDIS_CLUSTER_NODES;
  if (needsServer && !haveRedisServer()) await installRedis();
  const results = await Promise.allSettled([setupServer(project), setupCluster(project)]);
  const failed = results.find((r) => r.status === "rejected");
  if (failed) {
    await teardown();
    throw failed.reason;
  }
}

async function setupServer(project: TestProject): Promise<void> {
  if (process.env.REDIS_URL) {
    project.provide("redisUrl", process.env.REDIS_URL);
    project.provide("redisError", "");
    return;
  }
  if (!haveRedisServer()) {
    project.provide("redisUrl", "");
    project.provide("redisError", `redis-server was not found on the PATH. ${INSTALL_HINT}`);
    return;
  }
  server = new RedisProcess(await freePort());
  await server.start();
  project.provide("redisUrl", server.url);
  project.provide("redisError", "");
}

async function setupCluster(project: TestProject): Promise<void> {
  const fail = (why: string) => {
    project.provide("redisClusterNodes", "");
    project.provide("redisClusterError", `${why} ${CLUSTER_INSTALL_HINT}`);
  };
  if (process.env.REDIS_CLUSTER_NODES) {
    project.provide("redisClusterNodes", process.env.REDIS_CLUSTER_NODES);
    project.provide("redisClusterError", "");
    return;
  }
  if (!haveRedisServer()) return fail("redis-server was not found on the PATH.");
  if (!haveRedisCli()) return fail("redis-cli was not found on the PATH.");
  const started = new RedisCluster();
  try {
    await started.start();
  } catch (error) {
    return fail(`The Redis Cluster could not be started: ${error instanceof Error ? error.message : error}.`);
  }
  cluster = started;
  project.provide("redisClusterNodes", started.nodeList);
  project.provide("redisClusterError", "");
}

export async function teardown(): Promise<void> {
  await Promise.all([server?.stop(), cluster?.stop()]);
}
