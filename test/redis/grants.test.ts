import { redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { ownRedis, useClients } from "./clients.js";
import { scriptStage } from "./fixtures/permit-scripts.js";
import { closeClient, connectedClient, evalCalls, evalCallsReach, randomPrefix, until } from "./helpers.js";

/** This file counts the script calls Redis runs: on a server of its own. */
const redisUrl = ownRedis();

/**
 * Grant on release: a release hands the freed permits to the waiters at the head of the line in
 * the same script, so a waiter that had to wait costs no round trip more than one that did not.
 * The scripts are called directly here with explicit times, so every lease end is exact.
 */
describe("grants made on release (scripts)", () => {
  let client: Redis;
  beforeAll(async () => {
    client = await connectedClient(redisUrl());
  });
  afterAll(async () => {
    await closeClient(client);
  });

  const stage = (label: string) => scriptStage(client, label);

  it("moves the head waiter into holders on release, with a lease that ends when its place in line would have", async () => {
    const s = stage("handoff");
    expect((await s.acquire(1000, "h:1", 1))[0]).toBe(1);
    const refused = await s.acquire(1000, "w:1", 1);
    expect(refused[0]).toBe(0);
    const [released, , used, grants] = await s.release(2000, "h:1", 1);
    expect(released).toBe(1);
    expect(used).toBe(1);
    expect(grants).toHaveLength(1);
    const [member, fence, epoch, ends, at] = grants[0]!.split("|");
    expect(member).toBe("w:1");
    expect(Number(fence)).toBeGreaterThan(0);
    expect(epoch).toBe("0");
    // Its place in line ran to 1000 + 3000: the grant lasts until then unless claimed. The
    // message says when it ends and when it was made, in the server's time.
    expect(Number(ends)).toBe(4000);
    expect(Number(at)).toBe(2000);
    expect(await s.expiry("w:1")).toBe(4000);
    expect(await client.zcard(s.keys[1]!)).toBe(0);
    expect(await client.zcard(s.keys[2]!)).toBe(0);
  });

  it("lets the waiter claim the grant with a full lease and a newer fencing token", async () => {
    const s = stage("claim");
    await s.acquire(1000, "h:1", 1);
    await s.acquire(1000, "w:1", 1);
    const [, , , grants] = await s.release(2000, "h:1", 1);
    const fence = Number(grants[0]!.split("|")[1]);
    const claim = await s.acquire(2500, "w:1", 1, { again: true });
    expect(claim[0]).toBe(1);
    expect(claim[1]).toBeGreaterThan(fence);
    expect(await s.expiry("w:1")).toBe(2500 + 30_000);
    expect(await s.used()).toBe(1);
  });

  it("takes back a grant nobody claimed once the waiter's place in line would have ended", async () => {
    const s = stage("unclaimed");
    await s.acquire(1000, "h:1", 1);
    await s.acquire(1000, "dead:1", 1); // its process dies: it never asks again
    await s.release(2000, "h:1", 1);
    expect(await s.expiry("dead:1")).toBe(4000);
    // Before that end the permit is still the dead waiter's.
    expect((await s.acquire(3999, "x:1", 1))[0]).toBe(0);
    // After it, the next caller gets it: the grant ended where its wait would have.
    const next = await s.acquire(4001, "x:1", 1, { again: true });
    expect(next[0]).toBe(1);
    expect(await s.expiry("dead:1")).toBeUndefined();
    expect(await s.used()).toBe(1);
  });

  it("refuses a grant claimed after its end and does not line its member up again", async () => {
    const s = stage("late-claim");
    await s.acquire(1000, "h:1", 1);
    await s.acquire(1000, "w:1", 1);
    await s.release(2000, "h:1", 1);
    const late = await s.acquire(4001, "w:1", 1, { again: true });
    // Gone: the member is neither holding nor in line; the caller asks under a new member.
    expect(late[0]).toBe(-1);
    expect(await s.expiry("w:1")).toBeUndefined();
    expect(await client.zcard(s.keys[1]!)).toBe(0);
    expect(await s.used()).toBe(0);
    expect((await s.acquire(4002, "w2:1", 1))[0]).toBe(1);
    expect(await s.used()).toBe(1);
  });

  it("grants every waiter that fits in one release, in order, and stops at the first that does not", async () => {
    const s = stage("burst");
    await s.acquire(1000, "big:3", 4);
    await s.acquire(1000, "one:1", 4);
    for (const m of ["a:1", "b:2", "c:2", "d:1"]) expect((await s.acquire(1000, m, 4))[0]).toBe(0);
    const [, , used, grants] = await s.release(1100, "big:3", 4);
    // 3 permits freed: a (1) and b (2) fit; c (2) does not, and d (1) must not overtake it.
    expect(grants.map((g) => g.split("|")[0])).toEqual(["a:1", "b:2"]);
    expect(used).toBe(4);
    expect(await s.used()).toBe(4);
    expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual(["c:2", "d:1"]);
  });

  it("keeps a large waiter at the head ahead of a stream of small releases", async () => {
    const s = stage("heavy");
    await s.acquire(1000, "h1:1", 3);
    await s.acquire(1000, "h2:1", 3);
    await s.acquire(1000, "h3:1", 3);
    await s.acquire(1000, "heavy:3", 3);
    await s.acquire(1000, "small:1", 3);
    expect((await s.release(1100, "h1:1", 3))[3]).toEqual([]);
    expect((await s.release(1100, "h2:1", 3))[3]).toEqual([]);
    const [, , , grants] = await s.release(1100, "h3:1", 3);
    expect(grants.map((g) => g.split("|")[0])).toEqual(["heavy:3"]);
  });

  it("drops a waiter whose place in line already ran out instead of granting it", async () => {
    const s = stage("stale");
    await s.acquire(1000, "h:1", 1);
    await s.acquire(1000, "stale:1", 1);
    await s.acquire(3000, "fresh:1", 1);
    const [, , , grants] = await s.release(4500, "h:1", 1);
    expect(grants.map((g) => g.split("|")[0])).toEqual(["fresh:1"]);
    expect(await s.expiry("stale:1")).toBeUndefined();
  });

  it("grants nothing while the stage is in quarantine", async () => {
    const s = stage("quarantine");
    await s.acquire(1000, "h:1", 1);
    await s.acquire(1000, "w:1", 1);
    await client.hset(s.keys[3]!, "quarantine", 5000);
    expect((await s.release(2000, "h:1", 1))[3]).toEqual([]);
    expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual(["w:1"]);
  });

  it("gives the permits of a waiter that left back to the next one in line", async () => {
    const s = stage("left");
    await s.acquire(1000, "h:1", 1);
    await s.acquire(1000, "gone:1", 1);
    await s.acquire(1000, "next:1", 1);
    await s.release(2000, "h:1", 1); // granted to gone:1, which has already left
    const [released, , , grants] = await s.release(2001, "gone:1", 1, "any");
    expect(released).toBe(1);
    expect(grants.map((g) => g.split("|")[0])).toEqual(["next:1"]);
  });

  it("frees nothing on a second, late or foreign release, and never evicts a live holder", async () => {
    const s = stage("foreign");
    await s.acquire(1000, "a:1", 2);
    await s.acquire(1000, "b:1", 2);
    expect((await s.release(1100, "a:1", 2))[0]).toBe(1);
    // Twice: the second frees nothing.
    expect((await s.release(1100, "a:1", 2))[0]).toBe(0);
    // Foreign: an id that never held anything, with any cost.
    expect((await s.release(1100, "stranger:2", 2, "any"))[0]).toBe(0);
    expect(await s.used()).toBe(1);
    // Late: b's lease runs out and its permit goes to c; b's release then frees nothing of c's.
    expect((await s.acquire(1000 + 30_001, "c:1", 2))[0]).toBe(1);
    expect((await s.acquire(1000 + 30_001, "d:1", 2))[0]).toBe(1);
    expect(await s.expiry("b:1")).toBeUndefined();
    expect((await s.release(1000 + 30_002, "b:1", 2))[0]).toBe(0);
    expect(await s.used()).toBe(2);
    expect(await s.expiry("c:1")).toBeDefined();
    expect(await s.expiry("d:1")).toBeDefined();
    expect((await s.acquire(1000 + 30_003, "e:1", 2, { mode: "try" }))[0]).toBe(0);
  });

  it("announces each grant on the stage's channel", async () => {
    const s = stage("publish");
    const sub = await connectedClient(redisUrl());
    try {
      const heard: string[] = [];
      sub.on("message", (_channel: string, message: string) => heard.push(message));
      await sub.subscribe(s.channel);
      await s.acquire(1000, "h:1", 1);
      await s.acquire(1000, "w:1", 1);
      const [, , , grants] = await s.release(2000, "h:1", 1);
      await until(() => heard.length === 1, { timeoutMs: 5000, message: "no grant was published" });
      expect(heard).toEqual(grants);
    } finally {
      await closeClient(sub);
    }
  });
});

/** Two backends on two connections stand for two processes. */
describe("grants made on release (stages)", () => {
  const { clients, connect } = useClients(redisUrl);

  async function backend(prefix: string, pollMs = 60_000) {
    const client = await connect();
    return redis(client, { prefix, pollMs });
  }

  it("costs two round trips per admission that had to wait: its acquire and its release", async () => {
    const prefix = randomPrefix("trips");
    const a = (await backend(prefix)).semaphore("trips", { limit: 1 });
    const b = (await backend(prefix)).semaphore("trips", { limit: 1 });
    // Warm up: subscribe both.
    let held = await a.admit();
    let waiting = b.admit();
    await until(async () => (await clients[0]!.zcard(`${prefix}{trips}:queue`)) === 1, {
      timeoutMs: 5000,
      message: "b did not line up",
    });
    await held.release("success");
    held = await waiting;
    const lining = await evalCalls(clients[0]!);
    waiting = a.admit();
    // a lines up, subscribes, and asks once more now that it listens: two script calls.
    const before = await evalCallsReach(
      clients[0]!,
      lining + 2,
      "a did not line up and ask again once subscribed",
    );
    expect(await clients[0]!.zcard(`${prefix}{trips}:queue`)).toBe(1);
    // 20 handoffs between the two, each one a wait.
    const rounds = 20;
    const sems = [a, b];
    for (let i = 0; i < rounds; i++) {
      await held.release("success");
      held = await waiting;
      const next = sems[i % 2]!;
      waiting = next.admit();
      await until(async () => (await clients[0]!.zcard(`${prefix}{trips}:queue`)) === 1, {
        timeoutMs: 5000,
        intervalMs: 2,
        message: "the next waiter did not line up",
      });
    }
    const calls = (await evalCalls(clients[0]!)) - before;
    // Each round: one release, one acquire that lines up. The grant itself costs nothing.
    expect(calls).toBe(2 * rounds);
    await held.release("success");
    await (await waiting).release("success");
  });

  it("sends each grant only to the process of the waiter it is for", async () => {
    const prefix = randomPrefix("own");
    const holder = (await backend(prefix)).semaphore("own", { limit: 1 });
    const b = (await backend(prefix)).semaphore("own", { limit: 1 });
    const c = (await backend(prefix)).semaphore("own", { limit: 1 });
    const spy = await connect();
    const heard: [string, string][] = [];
    // (Grants only: not what the release says on `wake:freed` for fused gates, lua/prelude.lua.)
    spy.on("pmessage", (_pattern: string, channel: string, message: string) => {
      if (channel !== `${prefix}{own}:wake:freed`) heard.push([channel, message]);
    });
    await spy.psubscribe(`${prefix}{own}:wake:*`);
    const held = await holder.admit();
    const waitB = b.admit();
    const waitC = c.admit();
    await until(async () => (await clients[0]!.pubsub("CHANNELS", `${prefix}{own}:wake:*`)).length === 2, {
      timeoutMs: 5000,
      message: "the two waiting processes did not both subscribe",
    });
    await held.release("success");
    const first = await Promise.race([waitB, waitC]);
    await until(() => heard.length === 1, { timeoutMs: 5000, message: "no grant was published" });
    const [channel, message] = heard[0]!;
    const token = message.split("-")[0]!;
    expect(channel).toBe(`${prefix}{own}:wake:${token}`);
    expect(message.startsWith((first as unknown as { leaseId: string }).leaseId)).toBe(true);
    await first.release("success");
    for (const t of await Promise.all([waitB, waitC])) if (t !== first) await t.release("success");
  });

  it("hands a waiter in the releasing process its permit from the release reply", async () => {
    const prefix = randomPrefix("local");
    const sem = (await backend(prefix)).semaphore("local", { limit: 1 });
    const held = await sem.admit();
    const lining = await evalCalls(clients[0]!);
    const waiting = sem.admit();
    // The waiter lines up, subscribes, and asks once more now that it listens: two script calls.
    const before = await evalCallsReach(
      clients[0]!,
      lining + 2,
      "the waiter did not line up and ask again once subscribed",
    );
    expect(await clients[0]!.zcard(`${prefix}{local}:queue`)).toBe(1);
    await held.release("success");
    const ticket = await waiting;
    expect(await evalCalls(clients[0]!)).toBe(before + 1);
    expect(sem.snapshot().inFlight).toBe(1);
    await ticket.release("success");
    expect(await clients[0]!.zcard(`${prefix}{local}:holders`)).toBe(0);
  });

  it("claims a grant whose message was lost on the waiter's next poll, with a full lease", async () => {
    const prefix = randomPrefix("lost");
    const holder = (await backend(prefix)).semaphore("lost", { limit: 1, leaseMs: 20_000 });
    // Its grant message is lost, so only its poll can find the grant.
    const client = await connect();
    // Its pub/sub connection will be killed and must not come back.
    const deaf = await connectedClient(redisUrl(), { retryStrategy: () => null, autoResubscribe: false });
    clients.push(deaf);
    const deafId = await deaf.client("ID");
    const waiter = redis(client, { prefix, pollMs: 100, subscriber: deaf }).semaphore("lost", {
      limit: 1,
      leaseMs: 20_000,
    });
    const held = await holder.admit();
    const pending = waiter.admit();
    await until(async () => (await clients[0]!.zcard(`${prefix}{lost}:queue`)) === 1, {
      timeoutMs: 5000,
      message: "the waiter did not line up",
    });
    await until(async () => (await clients[0]!.pubsub("CHANNELS", `${prefix}{lost}:wake:*`)).length === 1, {
      timeoutMs: 5000,
      message: "the waiter never subscribed",
    });
    // Kill this one connection only: other tests share the server.
    await clients[0]!.client("KILL", "ID", String(deafId));
    await held.release("success"); // its grant message goes nowhere
    const ticket = await pending;
    const [member, score] = await clients[0]!.zrange(`${prefix}{lost}:holders`, 0, 0, "WITHSCORES");
    expect(member).toBeDefined();
    const time = await clients[0]!.time();
    const nowMs = Number(time[0]) * 1000 + Math.floor(Number(time[1]) / 1000);
    // Claimed: a full lease from the claim, not the rest of its place in line (at most 300 ms).
    expect(Number(score) - nowMs).toBeGreaterThan(10_000);
    await ticket.release("success");
  });
});
