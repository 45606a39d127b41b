import { type Clock, LeaseLostError } from "floodgate";
import { redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { ownRedis, useClients } from "./clients.js";
import { scriptStage } from "./fixtures/permit-scripts.js";
import { closeClient, connectedClient, evalCalls, randomPrefix, until } from "./helpers.js";

/** This file counts the script calls Redis runs: on a server of its own. */
const redisUrl = ownRedis();

/**
 * Waiters stay in line, and are granted, only while their process gives a sign of life; a grant
 * message is judged by the time it ends before it becomes a ticket. The scripts are called
 * directly with explicit times, so every end is exact; the stage tests then forge what a frozen
 * or killed process would leave behind.
 */
describe("signs of life and grant ends (scripts)", () => {
  let client: Redis;
  beforeAll(async () => {
    client = await connectedClient(redisUrl());
  });
  afterAll(async () => {
    await closeClient(client);
  });

  const stage = (label: string) => scriptStage(client, label);
  /** A waiting process's call: listeners not asked, unless said. */
  const wait = (livenessMs: number, again = false) => ({ livenessMs, again, listeners: false });

  it("grants nothing to a waiter whose process went silent, and gives the permit to the next one", async () => {
    const s = stage("silent");
    expect((await s.acquire(1000, "aa-1:1", 1, wait(2_000)))[0]).toBe(1);
    expect((await s.acquire(1000, "bb-1:1", 1, wait(500)))[0]).toBe(0); // alive until 1500
    expect((await s.acquire(1000, "cc-1:1", 1, wait(5_000)))[0]).toBe(0);
    const [, , used, grants] = await s.release(2000, "aa-1:1", 1, "lease", { listeners: false });
    expect(grants.map((g) => g.split("|")[0])).toEqual(["cc-1:1"]);
    expect(used).toBe(1);
    expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual([]);
    expect(await s.expiry("bb-1:1")).toBeUndefined();
  });

  it("ends a grant no later than its waiter's process stops counting as alive", async () => {
    const s = stage("ends");
    await s.acquire(1000, "aa-1:1", 1, wait(2_000));
    await s.acquire(1000, "bb-1:1", 1, wait(2_000)); // alive until 3000; its place in line until 4000
    const [, , , grants] = await s.release(1500, "aa-1:1", 1, "lease", { listeners: false });
    const [, , , ends, at] = grants[0]!.split("|");
    expect(Number(ends)).toBe(3000);
    expect(Number(at)).toBe(1500);
    expect(await s.expiry("bb-1:1")).toBe(3000);
  });

  it("ends a grant nobody claims after claimMs, and lets the next caller take the permit back", async () => {
    const s = stage("claim");
    await s.acquire(1000, "aa-1:1", 1, wait(2_000));
    await s.acquire(1000, "bb-1:1", 1, wait(5_000));
    const [, , , grants] = await s.release(1500, "aa-1:1", 1, "lease", { listeners: false, claimMs: 200 });
    expect(Number(grants[0]!.split("|")[3])).toBe(1700);
    expect(await s.expiry("bb-1:1")).toBe(1700);
    // bb's process died right after the grant: the next caller reaps it once it has ended.
    expect((await s.acquire(1699, "cc-1:1", 1, wait(5_000)))[0]).toBe(0);
    expect((await s.acquire(1701, "cc-1:1", 1, wait(5_000, true)))[0]).toBe(1);
    expect(await s.expiry("bb-1:1")).toBeUndefined();
  });

  it("keeps a waiter in line while its process gives signs of life with no call of its own", async () => {
    const s = stage("beat");
    await s.acquire(1000, "aa-1:1", 1, wait(2_000));
    await s.acquire(1000, "bb-1:1", 1, wait(2_000));
    await s.sign(2500, "bb", 2_000); // alive until 4500
    const [, , , grants] = await s.release(2900, "aa-1:1", 1, "lease", { listeners: false });
    expect(grants.map((g) => g.split("|")[0])).toEqual(["bb-1:1"]);
  });

  it("passes over a waiter whose process nobody hears, keeps its place, and grants it when it asks again", async () => {
    const s = stage("deaf");
    const sub = await connectedClient(redisUrl());
    try {
      const channel = (token: string) => `${s.keys[0]!.slice(0, -"holders".length)}wake:${token}`;
      await sub.subscribe(channel("cc"));
      await s.acquire(1000, "aa-1:1", 2, wait(5_000));
      await s.acquire(1000, "aa-2:1", 2, wait(5_000));
      await s.acquire(1000, "bb-1:1", 2, wait(5_000)); // its process was killed: nobody listens
      await s.acquire(1000, "cc-1:1", 2, wait(5_000));
      const [, , , grants] = await s.release(1100, "aa-1:1", 2, "lease", { listeners: true });
      expect(grants.map((g) => g.split("|")[0])).toEqual(["cc-1:1"]);
      expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual(["bb-1:1"]);
      // A process that releases hears its own grants in the reply: nobody needs to listen.
      const [, , , own] = await s.release(1200, "cc-1:1", 2, "lease", { listeners: true });
      expect(own).toEqual([]);
      // bb's process was only deaf for a moment: when it asks again it is at the head, and fits.
      const again = await s.acquire(1300, "bb-1:1", 2, { livenessMs: 5_000, again: true, listeners: true });
      expect(again[0]).toBe(1);
    } finally {
      await closeClient(sub);
    }
  });

  it("hands a waiter of the releasing process its grant in the reply even when it does not listen", async () => {
    const s = stage("own");
    await s.acquire(1000, "aa-1:1", 1, wait(5_000));
    await s.acquire(1000, "aa-2:1", 1, wait(5_000));
    const [, , , grants] = await s.release(1100, "aa-1:1", 1, "lease", { listeners: true });
    expect(grants.map((g) => g.split("|")[0])).toEqual(["aa-2:1"]);
  });

  it("says a member is gone when it asks again after being dropped from the line, and does not line it up", async () => {
    const s = stage("gone");
    await s.acquire(1000, "aa-1:1", 1, wait(2_000));
    await s.acquire(1000, "bb-1:1", 1, wait(500));
    await s.acquire(1000, "cc-1:1", 1, wait(5_000));
    await s.release(2000, "aa-1:1", 1, "lease", { listeners: false }); // bb is dropped, cc granted
    const again = await s.acquire(2100, "bb-1:1", 1, wait(2_000, true));
    expect(again[0]).toBe(-1);
    expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual([]);
  });
});

/** Two backends on two connections stand for two processes. */
describe("signs of life and grant ends (stages)", () => {
  const { connect } = useClients(redisUrl);

  async function connection(): Promise<Redis> {
    const client = await connect();
    return client;
  }

  /** The one member in line, once there is one. */
  async function memberInLine(admin: Redis, prefix: string, name: string): Promise<string> {
    return until(async () => (await admin.zrange(`${prefix}{${name}}:queue`, 0, -1))[0], {
      timeoutMs: 5000,
      message: "the waiter did not line up",
    });
  }

  async function subscribed(admin: Redis, prefix: string, name: string): Promise<void> {
    await until(async () => (await admin.pubsub("CHANNELS", `${prefix}{${name}}:wake:*`)).length === 1, {
      timeoutMs: 5000,
      message: "the waiter never subscribed",
    });
  }

  it("gives no ticket for a grant message that has already ended, and asks Redis instead", async () => {
    const admin = await connection();
    const prefix = randomPrefix("stale");
    const holder = redis(await connection(), { prefix }).semaphore("st", { limit: 1 });
    const waiter = redis(await connection(), { prefix, pollMs: 60_000 }).semaphore("st", { limit: 1 });
    const held = await holder.admit();
    let granted = false;
    const pending = waiter.admit().then((t) => {
      granted = true;
      return t;
    });
    const member = await memberInLine(admin, prefix, "st");
    await subscribed(admin, prefix, "st");
    const token = member.split("-")[0]!;
    const before = await evalCalls(admin);
    // What a release long ago would have sent: a grant that ended at server time 1.
    await admin.publish(`${prefix}{st}:wake:${token}`, `${member}|999999|0|1|0`);
    await until(async () => (await evalCalls(admin)) > before, {
      timeoutMs: 5000,
      message: "the waiter did not ask Redis about the grant",
    });
    expect(granted).toBe(false);
    expect(waiter.snapshot()).toMatchObject({ waiting: 1, inFlight: 0 });
    expect(await admin.zrange(`${prefix}{st}:queue`, 0, -1)).toEqual([member]);
    await held.release("success");
    const ticket = await pending;
    expect((ticket as unknown as { leaseId: string }).leaseId).toBe(member);
    await ticket.release("success");
  });

  it("lines up again under a new member when the grant it was told of ended unclaimed", async () => {
    const admin = await connection();
    const prefix = randomPrefix("lapsed");
    const holder = redis(await connection(), { prefix }).semaphore("lp", { limit: 2 });
    const waiter = redis(await connection(), { prefix, pollMs: 60_000 }).semaphore("lp", { limit: 2 });
    const held = await holder.admit({ cost: 2 });
    const pending = waiter.admit();
    const member = await memberInLine(admin, prefix, "lp");
    await subscribed(admin, prefix, "lp");
    // A grant made while the waiter's process was frozen, which ran out before it woke: the
    // member holds a lease that has already ended and is no longer in line.
    const key = (part: string) => `${prefix}{lp}:${part}`;
    await admin.zrem(key("queue"), member);
    await admin.zrem(key("qexp"), member);
    await admin.zadd(key("holders"), 1, member);
    await held.release("success");
    await admin.hset(key("meta"), "used", 1);
    const token = member.split("-")[0]!;
    await admin.publish(key(`wake:${token}`), `${member}|999999|0|1|0`);
    // It asks again, finds its grant gone, and lines up as someone new: it is granted then.
    const ticket = await pending;
    const leaseId = (ticket as unknown as { leaseId: string }).leaseId;
    expect(leaseId).not.toBe(member);
    expect(await admin.zscore(key("holders"), member)).toBeNull();
    expect(await admin.hget(key("meta"), "used")).toBe("1");
    await ticket.release("success");
    expect(await admin.hget(key("meta"), "used")).toBe("0");
  });

  it("aborts a ticket's signal as soon as it is read after its lease has ended on the process's clock", async () => {
    let frozenMs = 0;
    // The process's monotonic clock runs on while it is stopped: this one jumps when told.
    const clock: Clock = {
      now: () => performance.now() + frozenMs,
      setTimeout: (fn, ms) => setTimeout(fn, ms),
      clearTimeout: (t) => clearTimeout(t as ReturnType<typeof setTimeout>),
    };
    const prefix = randomPrefix("frozen");
    const sem = redis(await connection(), { prefix, clock }).semaphore("fr", { limit: 1, leaseMs: 1000 });
    const ticket = await sem.admit();
    expect(ticket.signal.aborted).toBe(false);
    frozenMs = 1001;
    expect(ticket.signal.aborted).toBe(true);
    expect(ticket.signal.reason).toBeInstanceOf(LeaseLostError);
    expect(sem.snapshot().leasesLost).toBe(1);
    await ticket.release("success");
    expect(sem.snapshot().leasesLost).toBe(1);
  });
});
