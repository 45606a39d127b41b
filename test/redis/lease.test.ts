import { isDeepStrictEqual } from "node:util";
import { Gate, isFloodgateError, LeaseLostError } from "floodgate";
import { type LeaseTicket, type RedisBackendOptions, redis, stageKey } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import type { Redis } from "ioredis";
import { afterEach, beforeAll, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import {
  Child,
  closeClient,
  connectedClient,
  randomPrefix,
  rejectionOf,
  StallableClock,
  until,
  within,
} from "./helpers.js";

type Backend = ReturnType<typeof redis>;

/** The Redis server's clock in milliseconds, as the scripts read it. */
async function serverNow(client: Redis): Promise<number> {
  const [seconds, micros] = await client.time();
  return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
}

describe("Redis leases", () => {
  let url: string;
  const clients: Redis[] = [];
  const backends: Backend[] = [];
  const children: Child[] = [];

  beforeAll(() => {
    url = redisUrl();
  });

  afterEach(async () => {
    await Promise.all(children.splice(0).map((child) => child.kill()));
    await Promise.all(backends.splice(0).map((backend) => backend.close()));
    await Promise.all(clients.splice(0).map((client) => closeClient(client)));
  });

  /** A backend standing for one process: its own client and its own (connected) pub/sub connection. */
  async function backend(prefix: string, options: RedisBackendOptions = {}): Promise<Backend> {
    const [client, subscriber] = await Promise.all([connectedClient(url), connectedClient(url)]);
    clients.push(client, subscriber);
    const b = redis(client, { prefix, subscriber, ...options });
    backends.push(b);
    return b;
  }

  async function rawClient(): Promise<Redis> {
    const raw = await connectedClient(url);
    clients.push(raw);
    return raw;
  }

  it("hands a killed holder's permit to a waiter within about leaseMs", async () => {
    const prefix = randomPrefix("lease-kill");
    const leaseMs = 1_000;
    const holder = new Child("holder.ts", {
      REDIS_URL: url,
      PREFIX: prefix,
      LIMIT: "1",
      LEASE_MS: String(leaseMs),
    });
    children.push(holder);
    const acquired = await holder.message("acquired", 15_000);

    const sem = (await backend(prefix)).semaphore("sem", { limit: 1, leaseMs });
    const r = await rawClient();
    const holders = stageKey(prefix, "sem", "holders");
    const firstExpiry = Number(await r.zscore(holders, String(acquired.leaseId)));
    expect(firstExpiry).toBeGreaterThan(0);
    // The holder renews from its own process: once the server's time is past its first lease's
    // end, it still holds the permit.
    await until(async () => (await serverNow(r)) > firstExpiry, {
      timeoutMs: leaseMs * 10,
      message: "the server's time never passed the first expiry of the lease",
    });
    expect(await sem.tryAdmit()).toBeUndefined();
    expect(Number(await r.zscore(holders, String(acquired.leaseId)))).toBeGreaterThan(firstExpiry);

    const waiting = sem.admit({ timeoutMs: 15_000 });
    await holder.kill();
    const killedAt = performance.now();
    const ticket = (await waiting) as LeaseTicket;
    const waitedMs = performance.now() - killedAt;

    expect(waitedMs).toBeLessThan(leaseMs + 2_000);
    expect(ticket.fence).toBeGreaterThan(Number(acquired.fence));
    expect(ticket.signal.aborted).toBe(false);
    await ticket.release("success");
  });

  /**
   * A semaphore of `limit` with 1 s leases, on a fake clock at 50 s that the scripts decide with
   * too; a raw client, and the key of its holders.
   */
  async function onFakeClock(label: string, limit: number) {
    const clock = new FakeClock(50_000);
    const prefix = randomPrefix(label);
    const b = await backend(prefix, { clock, time: "clock" });
    const sem = b.semaphore("sem", { limit, leaseMs: 1_000 });
    return { clock, sem, r: await rawClient(), holders: stageKey(prefix, "sem", "holders") };
  }

  it("renews each of a stage's leases when its own renewal is due, and none given back", async () => {
    // (Leases taken at different times are each renewed at their own time, with half of a 1 s
    // lease to spare; a lease given back is not.)
    const { clock, sem, r, holders } = await onFakeClock("lease-many", 3);
    const ends = async () => {
      const list = await r.zrange(holders, 0, -1, "WITHSCORES");
      const out: Record<string, number> = {};
      for (let i = 0; i < list.length; i += 2) out[list[i]!] = Number(list[i + 1]) - 50_000;
      return out;
    };
    const settled = (want: Record<string, number>, message: string) =>
      until(async () => isDeepStrictEqual(await ends(), want), { timeoutMs: 5_000, message });
    // (Renewed at `at` ms, not a ms before; and once its reply is taken here too, its lease then
    // counted from when it was sent.)
    type Ends = Record<string, number>;
    const renewsAt = async (t: LeaseTicket, at: number, before: Ends, after: Ends) => {
      await clock.advanceTo(50_000 + at - 1);
      expect(await ends()).toEqual(before);
      await clock.advance(1);
      await settled(after, `renewed at ${at} ms`);
      await until(() => t.validUntil === 50_000 + at + 1_000, {
        timeoutMs: 5_000,
        message: `reply at ${at} ms`,
      });
    };
    const a = (await sem.admit()) as LeaseTicket;
    await clock.advance(300);
    const b = (await sem.admit()) as LeaseTicket;
    await settled({ [a.leaseId]: 1_000, [b.leaseId]: 1_300 }, "two leases, as taken");
    // With half of what is left to spare: the first's renewal is due at 500 ms, the second's at 800.
    const two = { [b.leaseId]: 1_300 };
    await renewsAt(a, 500, { [a.leaseId]: 1_000, ...two }, { [a.leaseId]: 1_500, ...two });
    await clock.advance(100);
    const c = (await sem.admit()) as LeaseTicket;
    await b.release("success");
    // The second's time (800 ms) passes with nothing of it left; the first's next renewal is due
    // at 1,000 ms, the third's at 1,100.
    await renewsAt(
      a,
      1_000,
      { [a.leaseId]: 1_500, [c.leaseId]: 1_600 },
      { [a.leaseId]: 2_000, [c.leaseId]: 1_600 },
    );
    await renewsAt(
      c,
      1_100,
      { [a.leaseId]: 2_000, [c.leaseId]: 1_600 },
      { [a.leaseId]: 2_000, [c.leaseId]: 2_100 },
    );
    expect(a.signal.aborted || c.signal.aborted).toBe(false);
    await a.release("success");
    await c.release("success");
    expect(await ends()).toEqual({});
    expect(clock.pendingTimers).toBe(0);
  });

  it("renews leases taken together on one timer, for as long as any of them is held", async () => {
    const { clock, sem, r, holders } = await onFakeClock("lease-together", 4);
    const before = clock.pendingTimers;
    // (A turn's admissions, their replies taken together: one renewal timer for the four.)
    const tickets = (await Promise.all([0, 1, 2, 3].map(() => sem.tryAdmit()))) as LeaseTicket[];
    expect(tickets.every((t) => t !== undefined)).toBe(true);
    expect(clock.pendingTimers - before).toBe(1);
    await tickets[0]!.release("success");
    await tickets[1]!.release("success");
    expect(clock.pendingTimers - before).toBe(1);
    // The two still held renewed at 500 ms, to 1,500 ms; the two given back are gone.
    await clock.advance(500);
    await until(
      async () => {
        const ends = (await r.zrange(holders, 0, -1, "WITHSCORES")).filter((_, i) => i % 2 === 1);
        return ends.length === 2 && ends.every((end) => Number(end) === 51_500);
      },
      { timeoutMs: 5_000, message: "the two held renewed at 500 ms" },
    );
    await tickets[2]!.release("success");
    await tickets[3]!.release("success");
    expect(await r.zcard(holders)).toBe(0);
    expect(clock.pendingTimers).toBe(before);
  });

  it("renews a fused gate's call's leases at its two permit stages on one timer, each at its stage", async () => {
    const clock = new FakeClock(50_000);
    const prefix = randomPrefix("lease-fused");
    const b = await backend(prefix, { clock, time: "clock" });
    const sem = b.semaphore("sem", { limit: 2, leaseMs: 1_000 });
    const aimd = b.aimd("aimd", { initial: 2, min: 1, max: 2, leaseMs: 1_000 });
    const gate = new Gate([sem, aimd]);
    expect(gate.fused).toBe(true);
    const r = await rawClient();
    const ends = async (stage: string) =>
      (await r.zrange(stageKey(prefix, stage, "holders"), 0, -1, "WITHSCORES"))
        .filter((_, i) => i % 2 === 1)
        .map((end) => Number(end) - 50_000);
    const before = clock.pendingTimers;
    const ticket = await gate.admit();
    expect(clock.pendingTimers - before).toBe(1);
    // Both renewed at 500 ms, each in its own stage's lease set.
    await clock.advance(500);
    await until(async () => (await ends("sem"))[0] === 1_500 && (await ends("aimd"))[0] === 1_500, {
      timeoutMs: 5_000,
      message: "both leases renewed at 500 ms",
    });
    expect(ticket.signal.aborted).toBe(false);
    await ticket.release("success");
    expect(await ends("sem")).toEqual([]);
    expect(await ends("aimd")).toEqual([]);
    expect(clock.pendingTimers).toBe(before);
  });

  it("renews a grant's short claim at its own time, though a longer lease was kept in the same ms", async () => {
    const { clock, sem, r, holders } = await onFakeClock("lease-claim", 2);
    const [a, h] = (await Promise.all([sem.admit(), sem.admit()])) as LeaseTicket[];
    const waiting = sem.admit();
    const queue = holders.replace(/holders$/, "queue");
    await until(async () => (await r.exists(queue)) === 1, { timeoutMs: 5_000, message: "a waiter in line" });
    // The grant on h's release, in the same ms as a's lease was kept: its claim (500 ms) is
    // renewed at 250 ms, not with a's at 500.
    await h!.release("success");
    const w = (await within(waiting, 5_000, "the grant")) as LeaseTicket;
    expect(Number(await r.zscore(holders, w.leaseId)) - 50_000).toBe(500);
    await clock.advance(249);
    expect(Number(await r.zscore(holders, w.leaseId)) - 50_000).toBe(500);
    await clock.advance(1);
    await until(async () => Number(await r.zscore(holders, w.leaseId)) - 50_000 === 1_250, {
      timeoutMs: 5_000,
      message: "the claim renewed at 250 ms",
    });
    expect(w.signal.aborted).toBe(false);
    await w.release("success");
    await a!.release("success");
  });

  it("keeps a running holder's lease past leaseMs by renewing it", async () => {
    const prefix = randomPrefix("lease-renew");
    const leaseMs = 1_000;
    const mine = (await backend(prefix)).semaphore("sem", { limit: 1, leaseMs });
    const theirs = (await backend(prefix)).semaphore("sem", { limit: 1, leaseMs });
    const holders = stageKey(prefix, "sem", "holders");
    const r = await rawClient();

    const ticket = (await mine.admit()) as LeaseTicket;
    const firstExpiry = Number(await r.zscore(holders, ticket.leaseId));

    // Another process waits for 2.5 leases and never gets in.
    const error = await rejectionOf(theirs.admit({ timeoutMs: leaseMs * 2.5 }));
    expect(isFloodgateError(error, "ADMIT_TIMEOUT")).toBe(true);
    expect(ticket.signal.aborted).toBe(false);
    const laterExpiry = Number(await r.zscore(holders, ticket.leaseId));
    expect(laterExpiry).toBeGreaterThan(firstExpiry);

    await ticket.release("success");
    const next = await theirs.tryAdmit();
    expect(next).toBeDefined();
    await next!.release("success");
  });

  it("reports a lease that can no longer be renewed on ticket.signal with LeaseLostError", async () => {
    const prefix = randomPrefix("lease-gone");
    const leaseMs = 500;
    const sem = (await backend(prefix)).semaphore("sem", { limit: 1, leaseMs });
    const r = await rawClient();
    const ticket = (await sem.admit()) as LeaseTicket;
    const signal = ticket.signal;
    expect(signal.aborted).toBe(false);

    // Someone else's script reaped it (as if it had expired): the next renewal finds it gone.
    expect(await r.zrem(stageKey(prefix, "sem", "holders"), ticket.leaseId)).toBe(1);
    await until(() => signal.aborted, {
      timeoutMs: leaseMs + 3_000,
      message: "the ticket's signal never aborted",
    });

    expect(signal.reason).toBeInstanceOf(LeaseLostError);
    expect(isFloodgateError(signal.reason, "LEASE_LOST")).toBe(true);
    expect((signal.reason as LeaseLostError).stage).toBe("sem");
    await ticket.release("success");
  });

  it("lets a stalled holder's lease run out, tells it so, and ignores its late release", async () => {
    const prefix = randomPrefix("lease-stall");
    const leaseMs = 500;
    const clock = new StallableClock();
    const stalled = (await backend(prefix, { clock })).semaphore("sem", { limit: 1, leaseMs });
    const other = (await backend(prefix)).semaphore("sem", { limit: 1, leaseMs });
    const third = (await backend(prefix)).semaphore("sem", { limit: 1, leaseMs });
    const r = await rawClient();

    const late = (await stalled.admit()) as LeaseTicket;
    const lateSignal = late.signal;
    clock.stall(); // its renewal timer no longer runs

    const current = (await other.admit({ timeoutMs: leaseMs + 5_000 })) as LeaseTicket;
    expect(current.fence).toBeGreaterThan(late.fence);

    clock.resume(); // the held-back renewal runs now and finds the lease gone
    await until(() => lateSignal.aborted, {
      timeoutMs: 3_000,
      message: "the stalled holder was never told its lease was lost",
    });
    expect(isFloodgateError(lateSignal.reason, "LEASE_LOST")).toBe(true);

    // The late release frees nothing: the current holder keeps its permit.
    await late.release("success");
    expect(await third.tryAdmit()).toBeUndefined();
    expect(await r.zscore(stageKey(prefix, "sem", "holders"), current.leaseId)).not.toBeNull();
    expect(await r.hget(stageKey(prefix, "sem", "meta"), "used")).toBe("1");
    expect(current.signal.aborted).toBe(false);

    await current.release("success");
    const next = await third.tryAdmit();
    expect(next).toBeDefined();
    await next!.release("success");
  });

  it("issues fencing tokens that strictly increase across grants and processes", async () => {
    const prefix = randomPrefix("lease-fence");
    const stages = await Promise.all(
      [0, 1, 2].map(async () => (await backend(prefix)).semaphore("sem", { limit: 1, leaseMs: 5_000 })),
    );
    const fences: number[] = [];
    // With a limit of 1, grants happen one after another, so the order recorded is the grant order.
    await within(
      Promise.all(
        stages.map(async (sem) => {
          for (let i = 0; i < 4; i++) {
            const ticket = (await sem.admit({ timeoutMs: 10_000 })) as LeaseTicket;
            fences.push(ticket.fence);
            await ticket.release("success");
          }
        }),
      ),
      15_000,
      "12 grants",
    );
    expect(fences).toHaveLength(12);
    for (let i = 1; i < fences.length; i++) expect(fences[i]!).toBeGreaterThan(fences[i - 1]!);
  });
});
