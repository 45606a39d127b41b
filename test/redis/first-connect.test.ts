import { once } from "node:events";
import { type AddressInfo, createServer } from "node:net";
import { AdmitTimeoutError, BackendUnavailableError } from "floodgate";
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

  it("connects a lazyConnect client on its first call, and waits for it", async () => {
    const c = client(redisUrl(), { lazyConnect: true });
    expect(c.status).toBe("wait");
    const sem = redis(c, { prefix: randomPrefix("lazy") }).semaphore("s", { limit: 1 });
    const ticket = await sem.admit();
    await ticket.release("success");
    expect(c.status).toBe("ready");
  });

  it("gives up on the first connection at the call's own timeoutMs or signal, holding nothing", async () => {
    // A server that accepts and never answers: the client stays "connecting" (ioredis waits for
    // the socket's first reply to call itself ready).
    const silent = createServer(() => {});
    silent.listen(0, "127.0.0.1");
    await once(silent, "listening");
    const port = (silent.address() as AddressInfo).port;
    try {
      const c = client(`redis://127.0.0.1:${port}`, { connectTimeout: 60_000 });
      const backend = redis(c, { prefix: randomPrefix("silent"), commandTimeoutMs: 30_000 });
      const sem = backend.semaphore("s", { limit: 1 });
      const started = performance.now();
      const timedOut = await rejectionOf(sem.admit({ timeoutMs: 100 }));
      expect(timedOut).toBeInstanceOf(AdmitTimeoutError);
      const controller = new AbortController();
      const aborted = rejectionOf(sem.admit({ signal: controller.signal }));
      controller.abort(new Error("stop"));
      expect(((await aborted) as Error).message).toBe("stop");
      // Not the command timeout: each gave up on its own bound.
      expect(performance.now() - started).toBeLessThan(10_000);
      expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
      await backend.close();
    } finally {
      silent.close();
    }
  });

  it("closes stages and the backend of a client that never connected without an ioredis error", async () => {
    const port = await closedPort();
    for (const extra of [{ lazyConnect: true }, { retryStrategy: () => 50 }] as RedisOptions[]) {
      const c = client(`redis://127.0.0.1:${port}`, extra);
      const backend = redis(c, { prefix: randomPrefix("unconnected"), commandTimeoutMs: 200 });
      const sem = backend.semaphore("s", { limit: 1 });
      backend.tokenBucket("b", { capacity: 1, refillPerSecond: 1 });
      await expect(sem.close()).resolves.toBeUndefined();
      await expect(backend.close()).resolves.toBeUndefined();
    }
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
