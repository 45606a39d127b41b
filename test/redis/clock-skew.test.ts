import { type LeaseTicket, type RedisBackendOptions, redis, stageKey } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterEach, beforeAll, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { closeClient, connectedClient, randomPrefix, skewedClock, until } from "./helpers.js";

type Backend = ReturnType<typeof redis>;

const TEN_MINUTES = 10 * 60_000;

/** The Redis server's clock in milliseconds, as the scripts read it. */
async function serverNow(client: Redis): Promise<number> {
  const [seconds, micros] = await client.time();
  return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
}

describe("workers with skewed clocks on one Redis", () => {
  let url: string;
  const clients: Redis[] = [];
  const backends: Backend[] = [];

  beforeAll(() => {
    url = redisUrl();
  });

  afterEach(async () => {
    await Promise.all(backends.splice(0).map((backend) => backend.close()));
    await Promise.all(clients.splice(0).map((client) => closeClient(client)));
  });

  async function backend(options: RedisBackendOptions): Promise<Backend> {
    const [client, subscriber] = await Promise.all([connectedClient(url), connectedClient(url)]);
    clients.push(client, subscriber);
    const b = redis(client, { subscriber, ...options });
    backends.push(b);
    return b;
  }

  async function rawClient(): Promise<Redis> {
    const client = await connectedClient(url);
    clients.push(client);
    return client;
  }

  describe('with time: "server" (the default)', () => {
    it("holds the cap across a worker 10 minutes ahead and one on time", async () => {
      const prefix = randomPrefix("skew-cap");
      const ahead = (await backend({ prefix, clock: skewedClock(TEN_MINUTES) })).semaphore("sem", {
        limit: 2,
        leaseMs: 1_000,
      });
      const onTime = (await backend({ prefix })).semaphore("sem", { limit: 2, leaseMs: 1_000 });

      const a = await ahead.admit();
      const b = await onTime.admit();
      expect(await ahead.tryAdmit()).toBeUndefined();
      expect(await onTime.tryAdmit()).toBeUndefined();
      await a.release("success");
      const c = await onTime.tryAdmit();
      expect(c).toBeDefined();
      expect(await ahead.tryAdmit()).toBeUndefined();
      await Promise.all([b.release("success"), c!.release("success")]);
    });

    it("does not let a worker 10 minutes ahead reap the leases of a worker on time", async () => {
      const prefix = randomPrefix("skew-reap");
      const leaseMs = 1_000;
      const onTime = (await backend({ prefix })).semaphore("sem", { limit: 1, leaseMs });
      const ahead = (await backend({ prefix, clock: skewedClock(TEN_MINUTES) })).semaphore("sem", {
        limit: 1,
        leaseMs,
      });
      const r = await rawClient();

      const held = (await onTime.admit()) as LeaseTicket;
      // Every call the skewed worker makes runs the reaper; none may take the lease away.
      for (let i = 0; i < 5; i++) expect(await ahead.tryAdmit()).toBeUndefined();
      const expiry = Number(await r.zscore(stageKey(prefix, "sem", "holders"), held.leaseId));
      const left = expiry - (await serverNow(r));
      expect(left).toBeGreaterThan(0);
      expect(left).toBeLessThanOrEqual(leaseMs);

      // Once the server's time is past the lease's first expiry, renewed meanwhile, the skewed
      // worker still cannot get in.
      await until(async () => (await serverNow(r)) > expiry, {
        timeoutMs: leaseMs * 10,
        message: "the server's time never passed the first expiry of the lease",
      });
      for (let i = 0; i < 5; i++) expect(await ahead.tryAdmit()).toBeUndefined();
      const renewed = Number(await r.zscore(stageKey(prefix, "sem", "holders"), held.leaseId));
      expect(renewed).toBeGreaterThan(expiry);
      expect(renewed - (await serverNow(r))).toBeLessThanOrEqual(leaseMs);
      expect(held.signal.aborted).toBe(false);
      expect(held.released).toBe(false);
      await held.release("success");
    });

    it("stamps the leases of a worker 10 minutes ahead with the server's time", async () => {
      const prefix = randomPrefix("skew-stamp");
      const leaseMs = 1_000;
      const ahead = (await backend({ prefix, clock: skewedClock(TEN_MINUTES) })).semaphore("sem", {
        limit: 1,
        leaseMs,
      });
      const onTime = (await backend({ prefix })).semaphore("sem", { limit: 1, leaseMs });
      const r = await rawClient();

      const held = (await ahead.admit()) as LeaseTicket;
      const expiry = Number(await r.zscore(stageKey(prefix, "sem", "holders"), held.leaseId));
      const left = expiry - (await serverNow(r));
      expect(left).toBeGreaterThan(0);
      expect(left).toBeLessThanOrEqual(leaseMs); // not ten minutes

      await held.release("success");
      const next = await onTime.tryAdmit();
      expect(next).toBeDefined();
      await next!.release("success");
    });
  });

  describe('with time: "clock", for contrast', () => {
    it("lets a worker whose clock runs 10 minutes ahead reap a live lease and break the cap", async () => {
      const prefix = randomPrefix("skew-clock");
      // Two hosts' wall clocks, one of them wrong. `time: "clock"` is meant for a single host.
      const onTime = (await backend({ prefix, time: "clock", clock: skewedClock(0, Date.now) })).semaphore(
        "sem",
        { limit: 1, leaseMs: 30_000 },
      );
      const ahead = (
        await backend({ prefix, time: "clock", clock: skewedClock(TEN_MINUTES, Date.now) })
      ).semaphore("sem", { limit: 1, leaseMs: 30_000 });

      const held = await onTime.admit();
      const intruder = await ahead.tryAdmit();
      // The skewed worker saw the 30 s lease as ten minutes stale, reaped it and took the permit:
      // two holders of a limit of 1. This is why the default decides with the server's TIME.
      expect(intruder).toBeDefined();
      expect(held.released).toBe(false);
      await Promise.all([held.release("success"), intruder!.release("success")]);
    });
  });
});
