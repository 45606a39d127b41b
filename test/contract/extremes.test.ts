import { randomUUID } from "node:crypto";
import { AdmitTimeoutError, type Backend, isFloodgateError, memory } from "floodgate";
import { redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { testClient } from "./backends.js";

/**
 * Extreme but valid values are accepted alike on both backends: a refill of one token in 31
 * million years, a spacing or a pause of 1e17 ms (or 1e300), a settle of 1e17 tokens. Waits
 * beyond Number.MAX_SAFE_INTEGER ms are waited that long; on Redis no script fails on a TTL or
 * a number it cannot write, and no key is left written without its expiry.
 */

const LONGEST = Number.MAX_SAFE_INTEGER;

let client: Redis;
let subscriber: Redis;

beforeAll(async () => {
  client = testClient();
  subscriber = testClient();
  await Promise.all([client.connect(), subscriber.connect()]);
});

afterAll(async () => {
  await Promise.all([client?.quit(), subscriber?.quit()]);
});

interface Made {
  backend: Backend;
  /** Every Redis key the backend wrote, with its TTL in ms (-1: none); none in memory. */
  keys(): Promise<Map<string, number>>;
}

const makers: { name: string; make(clock: FakeClock): Made }[] = [
  {
    name: "memory",
    make: (clock) => ({ backend: memory({ clock }), keys: async () => new Map() }),
  },
  {
    name: "redis",
    make(clock) {
      const prefix = `extremes:${randomUUID()}:`;
      return {
        backend: redis(client, { prefix, clock, time: "clock", subscriber }),
        async keys() {
          const found = await client.keys(`${prefix}*`);
          const ttls = new Map<string, number>();
          for (const k of found) ttls.set(k, await client.pttl(k));
          return ttls;
        },
      };
    },
  },
];

/** No key without an expiry, and none longer than the longest wait (plus the second of slack). */
async function expectTtls(made: Made): Promise<void> {
  for (const [key, ttl] of await made.keys()) {
    expect(ttl, key).toBeGreaterThan(0);
    expect(ttl, key).toBeLessThanOrEqual(LONGEST);
  }
}

async function refusal(promise: Promise<unknown>): Promise<unknown> {
  return promise.then(
    () => undefined,
    (e) => e,
  );
}

describe.each(makers)("extreme values on $name", (maker) => {
  it("accepts a refill of one token in 31 million years and says how long the wait is", async () => {
    const clock = new FakeClock(1_000);
    const made = maker.make(clock);
    const bucket = made.backend.tokenBucket("glacial", { capacity: 2, refillPerSecond: 1e-15 });
    const held = [await bucket.admit(), await bucket.admit()];
    expect(await bucket.tryAdmit()).toBeUndefined();
    const error = await refusal(bucket.admit({ timeoutMs: 1_000 }));
    expect(error).toBeInstanceOf(AdmitTimeoutError);
    // 1e18 ms, told as the longest wait floodgate deals in.
    expect((error as AdmitTimeoutError).retryAfterMs).toBe(LONGEST);
    await expectTtls(made);
    for (const t of held) await t.release();
    await made.backend.close();
  });

  it("accepts a spacing of 1e17 ms: one start, then the host waits", async () => {
    const clock = new FakeClock(1_000);
    const made = maker.make(clock);
    const hosts = made.backend.intervalGate("slow", { minIntervalMs: 1e17 });
    const first = await hosts.admit({ host: "h" });
    expect(await hosts.tryAdmit({ host: "h" })).toBeUndefined();
    const waiting = refusal(hosts.admit({ host: "h", timeoutMs: 50 }));
    await clock.advance(60);
    expect(await waiting).toBeInstanceOf(AdmitTimeoutError);
    expect(hosts.snapshot().waiting).toBe(0);
    await expectTtls(made);
    await first.release();
    await made.backend.close();
  });

  it("accepts a pause of 1e17 ms and of 1e300 ms, writing nothing it cannot expire", async () => {
    const clock = new FakeClock(1_000);
    const made = maker.make(clock);
    const hosts = made.backend.intervalGate("paused", { minIntervalMs: 10 });
    await hosts.pause("h", 1e17);
    expect(await hosts.tryAdmit({ host: "h" })).toBeUndefined();
    await hosts.pause("h2", 1e300);
    expect(await hosts.tryAdmit({ host: "h2" })).toBeUndefined();
    const other = await hosts.tryAdmit({ host: "other" });
    expect(other).toBeDefined();
    await expectTtls(made);
    // A waiter for the paused host waits (it does not spin), and leaves on its timeout.
    const waiting = refusal(hosts.admit({ host: "h", timeoutMs: 100 }));
    await clock.advance(150);
    expect(await waiting).toBeInstanceOf(AdmitTimeoutError);
    expect(hosts.snapshot().waiting).toBe(0);
    await made.backend.close();
  });

  it("accepts a settle of 1e17 tokens: the key is in debt, and later calls wait", async () => {
    const clock = new FakeClock(1_000);
    const made = maker.make(clock);
    const bucket = made.backend.tokenBucket("debt", { capacity: 5, refillPerSecond: 1 });
    const t = await bucket.admit();
    await t.settle(1e17);
    expect(t.cost).toBe(1e17);
    await t.release();
    expect(await bucket.tryAdmit()).toBeUndefined();
    const error = await refusal(bucket.admit({ timeoutMs: 1_000 }));
    expect(error).toBeInstanceOf(AdmitTimeoutError);
    expect((error as AdmitTimeoutError).retryAfterMs).toBe(LONGEST);
    await expectTtls(made);
    // A waiter with no timeout waits for ever rather than spinning; close ends it.
    const waiting = refusal(bucket.admit());
    await clock.advance(10_000);
    expect(bucket.snapshot().waiting).toBe(1);
    await bucket.close();
    expect(isFloodgateError(await waiting, "CLOSED")).toBe(true);
    await made.backend.close();
  });

  it("accepts the largest finite spacing with the largest jitter (their sum overflows)", async () => {
    const clock = new FakeClock(1_000);
    const made = maker.make(clock);
    const hosts = made.backend.intervalGate("overflow", {
      minIntervalMs: Number.MAX_VALUE,
      jitterMs: Number.MAX_VALUE,
      random: () => 0.99,
      defaultHost: "api",
    });
    const first = await hosts.admit();
    expect(await hosts.tryAdmit()).toBeUndefined();
    await expectTtls(made);
    await first.release();
    await made.backend.close();
  });
});
