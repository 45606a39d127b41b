import { BackendUnavailableError } from "floodgate";
import { redis } from "floodgate/redis";
import { Redis, type RedisOptions } from "ioredis";
import { afterEach, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { closedPort } from "../http/server.js";
import { closeClient, randomPrefix, rejectionOf } from "./helpers.js";

describe("the first calls on a client that is still connecting", () => {
  const clients: Redis[] = [];
  afterEach(async () => {
    await Promise.all(clients.splice(0).map(closeClient));
  });

  function client(url: string, extra: RedisOptions = {}): Redis {
    const c = new Redis(url, { enableOfflineQueue: false, maxRetriesPerRequest: 0, ...extra });
    c.on("error", () => {});
    clients.push(c);
    return c;
  }

  it("waits for a client made just now instead of failing its first call", async () => {
    const c = client(redisUrl());
    expect(c.status).not.toBe("ready");
    const sem = redis(c, { prefix: randomPrefix("first") }).semaphore("s", { limit: 1 });
    const ticket = await sem.admit();
    await ticket.release("success");
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
  });

  it("fails closed with BackendUnavailableError once commandTimeoutMs passes with no first connection", async () => {
    const c = client(`redis://127.0.0.1:${await closedPort()}`, { retryStrategy: () => 50 });
    const sem = redis(c, { prefix: randomPrefix("never"), commandTimeoutMs: 200 }).semaphore("s", {
      limit: 1,
    });
    const error = await rejectionOf(sem.admit());
    expect(error).toBeInstanceOf(BackendUnavailableError);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
  });
});
