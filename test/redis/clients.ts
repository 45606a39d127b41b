import type { Redis, RedisOptions } from "ioredis";
import { afterEach } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { closeClient, connectedClient } from "./helpers.js";

/**
 * Clients of the test Redis for each test of the calling `describe`, closed after each: `connect`
 * adds one (fail-fast options, plus `extra`), `clients` lists this test's in the order made.
 * Only for vitest suites (it registers an `afterEach`); fixtures use `connectedClient`.
 */
export function useClients(): { clients: Redis[]; connect(extra?: RedisOptions): Promise<Redis> } {
  const clients: Redis[] = [];
  afterEach(async () => {
    await Promise.all(clients.splice(0).map(closeClient));
  });
  return {
    clients,
    async connect(extra: RedisOptions = {}) {
      const client = await connectedClient(redisUrl(), extra);
      clients.push(client);
      return client;
    },
  };
}
