import type { Redis, RedisOptions } from "ioredis";
import { afterAll, afterEach, beforeAll } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { freePort, haveRedisServer, RedisProcess } from "../setup/redis-server.js";
import { closeClient, connectedClient } from "./helpers.js";

/**
 * Clients of the test Redis for each test of the calling `describe`, closed after each: `connect`
 * adds one (fail-fast options, plus `extra`), `clients` lists this test's in the order made.
 * Only for vitest suites (it registers an `afterEach`); fixtures use `connectedClient`.
 */
export function useClients(url: () => string = redisUrl): {
  clients: Redis[];
  connect(extra?: RedisOptions): Promise<Redis>;
} {
  const clients: Redis[] = [];
  afterEach(async () => {
    await Promise.all(clients.splice(0).map(closeClient));
  });
  return {
    clients,
    async connect(extra: RedisOptions = {}) {
      const client = await connectedClient(url(), extra);
      clients.push(client);
      return client;
    },
  };
}

/**
 * A redis-server of the calling file's own, started before its tests and stopped after them,
 * for the tests that count what Redis ran (INFO commandstats, MONITOR): the test files run side
 * by side, and on the shared server each would count the others' commands. Returns its URL.
 * With REDIS_URL set and no redis-server on the PATH, the shared server is used instead.
 */
export function ownRedis(): () => string {
  let server: RedisProcess | undefined;
  beforeAll(async () => {
    if (process.env.REDIS_URL && !haveRedisServer()) return;
    server = new RedisProcess(await freePort());
    await server.start();
  }, 30_000);
  afterAll(async () => {
    await server?.stop();
  });
  return () => server?.url ?? redisUrl();
}
