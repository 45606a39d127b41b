import { BackendUnavailableError } from "floodgate";
import { redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { closeClient, connectedClient, randomPrefix } from "./helpers.js";

describe("a script Redis refuses to run", () => {
  let client: Redis;
  beforeAll(async () => {
    client = await connectedClient(redisUrl());
  });
  afterAll(async () => {
    await closeClient(client);
  });

  it("fails the call closed with BackendUnavailableError carrying Redis's error, never a raw reply error", async () => {
    const prefix = randomPrefix("refused");
    // Something else wrote a string where the stage keeps its leases.
    await client.set(`${prefix}{sem}:holders`, "not a sorted set");
    await client.set(`${prefix}{bucket}:b:k`, "not a hash");
    const backend = redis(client, { prefix });
    const sem = backend.semaphore("sem", { limit: 1 });
    const bucket = backend.tokenBucket("bucket", { keyed: true, capacity: 2, refillPerSecond: 1 });
    for (const attempt of [sem.admit(), sem.tryAdmit(), bucket.admit({ key: "k" })]) {
      const error = await attempt.then(
        () => undefined,
        (e: unknown) => e,
      );
      expect(error).toBeInstanceOf(BackendUnavailableError);
      expect((error as BackendUnavailableError).message).toMatch(/Redis refused .*WRONGTYPE/);
      expect(((error as Error).cause as Error).message).toMatch(/WRONGTYPE/);
    }
    expect(sem.snapshot()).toMatchObject({ waiting: 0, inFlight: 0 });
    await backend.close();
  });
});
