import { type LeaseTicket, redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { useClients } from "./clients.js";
import { randomPrefix } from "./helpers.js";

/**
 * Redis losing a stage's data (a restart without persistence, FLUSHALL, a stale replica) while
 * permits are held: the holders' calls still run, so nothing is granted for one lease length.
 * Simulated by deleting the stage's keys; two connections stand for two processes.
 */
describe("after Redis loses a stage's data", () => {
  const { connect } = useClients();

  async function backend(prefix: string, clock: FakeClock) {
    const client = await connect();
    return { client, b: redis(client, { prefix, clock, time: "clock" }) };
  }

  it("grants nothing for one lease length, then goes on with higher fencing tokens", async () => {
    const prefix = randomPrefix("quarantine");
    const clock = new FakeClock(1_000_000);
    const a = await backend(prefix, clock);
    const semA = a.b.semaphore("portal", { limit: 2, leaseMs: 10_000 });
    const held = (await semA.admit()) as LeaseTicket;
    const fence = held.fence;
    // Redis forgets everything about the stage; `held`'s call is still running.
    await a.client.del(...["holders", "queue", "qexp", "meta"].map((p) => `${prefix}{portal}:${p}`));

    // The process that saw the fence notices, and holds everyone back.
    expect(await semA.tryAdmit()).toBeUndefined();
    const b = await backend(prefix, clock);
    const semB = b.b.semaphore("portal", { limit: 2, leaseMs: 10_000 });
    expect(await semB.tryAdmit()).toBeUndefined(); // a process that knew nothing is held back too
    const waiting = semB.admit();
    await clock.advance(9_999);
    expect(await semA.tryAdmit()).toBeUndefined();
    await clock.advance(2); // the waiter's timer is set for 1 ms past the quarantine
    const after = (await waiting) as LeaseTicket;
    expect(after.fence).toBeGreaterThan(fence);
    await after.release("success");
    await held.release("success");
  });

  it("does not hold back a stage seen for the first time", async () => {
    const prefix = randomPrefix("fresh");
    const clock = new FakeClock(1_000_000);
    const { b, client } = await backend(prefix, clock);
    const sem = b.semaphore("fresh", { limit: 1, leaseMs: 10_000 });
    const holders = `${prefix}{fresh}:holders`;
    // Granted at once, with no time gone by: the first fencing token, leased from now.
    const t = (await sem.tryAdmit()) as LeaseTicket | undefined;
    expect(t).toMatchObject({ stage: "fresh", cost: 1, released: false, fence: 1 });
    expect(await client.zrange(holders, 0, -1)).toEqual([t!.leaseId]);
    expect(Number(await client.zscore(holders, t!.leaseId))).toBe(1_000_000 + 10_000);
    expect(sem.snapshot()).toMatchObject({ admitted: 1, inFlight: 1, waiting: 0 });
    await t!.release("success");
    expect(t!.released).toBe(true);
    expect(await client.zcard(holders)).toBe(0);
    // Nor is the stage held back once it is known: the next call gets the next token at once.
    const next = (await sem.tryAdmit()) as LeaseTicket | undefined;
    expect(next).toMatchObject({ stage: "fresh", fence: 2 });
    await next!.release("success");
  });
});
