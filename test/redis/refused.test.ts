import { BackendUnavailableError } from "floodgate";
import { redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { refused } from "../../src/redis/link.js";
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

describe("what a refused script call says", () => {
  // As Debian 11's packaged redis-server 6.0.16 answers a fused gate's script (its Lua has no cjson).
  const noCjson = new Error(
    "ERR Error running script (call to f_7816f10f8c0fae440aadd34ee5affc30a358af10): @enable_strict_lua:15: " +
      "user_script:2628: Script attempted to access nonexistent global variable 'cjson'",
  );

  it("says what to do when the server's Lua has no cjson", () => {
    const text = refused("gate", noCjson);
    expect(text).toMatch(/^Redis refused gate: ERR Error running script/);
    expect(text).toContain("nonexistent global variable 'cjson'");
    expect(text).toContain("this server's Lua has no cjson");
    expect(text).toContain("`fuse: false`");
  });

  it("passes any other error on as Redis said it", () => {
    const wrongType = new Error("WRONGTYPE Operation against a key holding the wrong kind of value");
    expect(refused("semaphore-acquire", wrongType)).toBe(
      `Redis refused semaphore-acquire: ${wrongType.message}`,
    );
    expect(refused("gate", "a string")).toBe("Redis refused gate: a string");
    // Another global missing is not the cjson case.
    expect(
      refused("gate", new Error("Script attempted to access nonexistent global variable 'bit'")),
    ).not.toContain("fuse: false");
  });
});
