import { redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { closeClient, connectedClient, randomPrefix } from "../redis/helpers.js";
import { freePort, type RedisProcess } from "../setup/redis-server.js";
import { noscriptReplies, startRedis } from "./harness.js";

/**
 * `SCRIPT FLUSH` with no pause between flushes: the client's own resend after NOSCRIPT can
 * itself meet an empty cache. No call may fail because a script was missing. A server of its own,
 * so the flushes do not disturb the other tests' command counts.
 */
describe("script cache flushed without a pause", () => {
  let server: RedisProcess;
  let client: Redis;
  let admin: Redis;
  beforeAll(async () => {
    server = await startRedis(await freePort());
    client = await connectedClient(server.url);
    admin = await connectedClient(server.url);
  });
  afterAll(async () => {
    await closeClient(client);
    await closeClient(admin);
    await server?.stop();
  });

  it("loses no call to a missing script", async () => {
    const backend = redis(client, { prefix: randomPrefix("noscript"), commandTimeoutMs: 5000 });
    const bucket = backend.tokenBucket("b", { keyed: true, capacity: 1000, refillPerSecond: 1000 });
    const sem = backend.semaphore("s", { limit: 1000 });
    // Each script run once first, so that only a flush makes the client send it again.
    await bucket.tryAdmit({ key: "k0" });
    await (await sem.admit()).release("success");
    const before = await noscriptReplies(admin);
    let flushing = true;
    const flusher = (async () => {
      let flushes = 0;
      while (flushing) {
        await admin.script("FLUSH");
        flushes++;
      }
      return flushes;
    })();
    const errors: unknown[] = [];
    let calls = 0;
    const deadline = performance.now() + 1500;
    await Promise.all(
      Array.from({ length: 40 }, async (_, i) => {
        while (performance.now() < deadline) {
          calls++;
          try {
            if (i % 2 === 0) await bucket.tryAdmit({ key: `k${calls % 50}` });
            else await (await sem.admit()).release("success");
          } catch (error) {
            errors.push(error);
          }
        }
      }),
    );
    flushing = false;
    const flushes = await flusher;
    const missed = (await noscriptReplies(admin)) - before;
    expect(errors).toEqual([]);
    expect(calls).toBeGreaterThan(100);
    expect(flushes).toBeGreaterThan(10);
    // The flushes did bite: Redis answered NOSCRIPT, and every such call was sent again.
    expect(missed).toBeGreaterThan(0);
    await backend.close();
  });
});
