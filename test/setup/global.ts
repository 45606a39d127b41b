import type { TestProject } from "vitest/node";
import { freePort, haveRedisServer, INSTALL_HINT, RedisProcess } from "./redis-server.js";

declare module "vitest" {
  export interface ProvidedContext {
    /** URL of the Redis the suites use, or "" when there is none. */
    redisUrl: string;
    /** Why there is no Redis, when there is none. */
    redisError: string;
  }
}

let server: RedisProcess | undefined;

/**
 * Give the Redis suites a real server: REDIS_URL when set, else a throwaway redis-server on a
 * free loopback port. Without either, the Redis suites fail with INSTALL_HINT (they never skip);
 * the in-memory suites still run.
 */
export async function setup(project: TestProject): Promise<void> {
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

export async function teardown(): Promise<void> {
  await server?.stop();
}
