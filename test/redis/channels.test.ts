import diagnostics_channel from "node:diagnostics_channel";
import { BackendUnavailableError, CHANNELS } from "floodgate";
import { redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import { afterEach, describe, expect, it } from "vitest";
import { useClients } from "./clients.js";
import { randomPrefix, until } from "./helpers.js";

/** The Redis backend's own diagnostics channel events: a lost lease, a failed Redis call. */
describe("diagnostics channels of the Redis backend", () => {
  const { connect } = useClients();
  const subscribed: [string, (m: unknown) => void][] = [];

  afterEach(() => {
    for (const [name, fn] of subscribed.splice(0)) diagnostics_channel.unsubscribe(name, fn);
  });

  function listen(name: string): Record<string, unknown>[] {
    const seen: Record<string, unknown>[] = [];
    const fn = (m: unknown) => seen.push(m as Record<string, unknown>);
    diagnostics_channel.subscribe(name, fn);
    subscribed.push([name, fn]);
    return seen;
  }

  it("publishes a lease that ran out before its release", async () => {
    const client = await connect();
    const prefix = randomPrefix("channels-lost");
    const clock = new FakeClock(1_000);
    const b = redis(client, { prefix, clock, time: "clock", claimMs: 30_000 });
    const sem = b.semaphore("sem", { limit: 1, leaseMs: 1_000 });
    const lost = listen(CHANNELS.leaseLost);
    const t = await sem.admit();
    // The lease is gone from Redis (as after a failover to a stale replica): the renewal finds it lost.
    await client.del(`${prefix}{sem}:holders`);
    await clock.advance(900);
    await until(() => lost.length > 0, { timeoutMs: 5_000, message: "no lease-lost message" });
    expect(lost[0]).toMatchObject({ stage: "sem", kind: "semaphore", backend: "redis" });
    expect(typeof lost[0]!.leaseId).toBe("string");
    expect(t.signal.aborted).toBe(true);
    await t.release("success");
    await b.close();
  });

  it("publishes a Redis call that failed, with its error", async () => {
    const client = await connect();
    const b = redis(client, { prefix: randomPrefix("channels-error") });
    const sem = b.semaphore("sem", { limit: 1 });
    const errors = listen(CHANNELS.backendError);
    client.disconnect();
    await expect(sem.admit()).rejects.toBeInstanceOf(BackendUnavailableError);
    expect(errors.length).toBeGreaterThanOrEqual(1);
    expect(errors[0]).toMatchObject({ stage: "sem", backend: "redis" });
    expect(errors[0]!.error).toBeInstanceOf(BackendUnavailableError);
    await b.close();
  });
});
