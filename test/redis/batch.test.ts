import { redis, scriptSource } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { ownRedis } from "./clients.js";
import { closeClient, connectedClient, evalCalls, randomPrefix, until } from "./helpers.js";

/** This file counts the script calls Redis runs: on a server of its own. */
const redisUrl = ownRedis();

/**
 * Acquires and releases of one stage made in the same turn of the event loop, while another is
 * out, go to Redis as one script call that decides them in turn exactly as separate calls would.
 */
describe("calls of one turn in one script call", () => {
  let client: Redis;
  beforeAll(async () => {
    client = await connectedClient(redisUrl());
  });
  afterAll(async () => {
    await closeClient(client);
  });

  function keysOf(prefix: string) {
    const key = (part: string) => `${prefix}{s}:${part}`;
    return [key("holders"), key("queue"), key("qexp"), key("meta"), key("procs")];
  }

  async function dump(keys: string[]) {
    return {
      holders: await client.zrange(keys[0]!, 0, -1, "WITHSCORES"),
      queue: await client.zrange(keys[1]!, 0, -1, "WITHSCORES"),
      qexp: await client.zrange(keys[2]!, 0, -1, "WITHSCORES"),
      meta: await client.hgetall(keys[3]!),
    };
  }

  const acquireArgs = (now: number, member: string, again = "") => [
    now,
    member,
    3,
    30_000,
    "wait",
    3_000,
    "ch",
    "",
    0,
    again,
    2_000,
    "1",
    30_000,
    "",
  ];
  const releaseArgs = (now: number, member: string) => [now, member, 3, "ch", "lease", 30_000, "1", ""];

  it("decides many members in one acquire and release exactly as one call each", async () => {
    const one = keysOf(randomPrefix("one"));
    const many = keysOf(randomPrefix("many"));
    const members = ["a:1", "b:2", "c:1", "d:1", "e:2"];
    const singles: unknown[] = [];
    for (const m of members) {
      singles.push(await client.eval(scriptSource("semaphore-acquire"), 5, ...one, ...acquireArgs(1000, m)));
    }
    const pairs = members.slice(1).flatMap((m) => [m, ""]);
    const batched = await client.eval(
      scriptSource("semaphore-acquire"),
      5,
      ...many,
      ...acquireArgs(1000, members[0]!),
      ...pairs,
    );
    expect(batched).toEqual(singles);
    expect(await dump(many)).toEqual(await dump(one));

    // Release a and b in the same turn: c and d are granted, e (cost 2) still waits.
    const singleReleases: unknown[] = [];
    for (const m of ["a:1", "b:2"]) {
      singleReleases.push(
        await client.eval(scriptSource("semaphore-release"), 5, ...one, ...releaseArgs(1100, m)),
      );
    }
    const batchedReleases = await client.eval(
      scriptSource("semaphore-release"),
      5,
      ...many,
      ...releaseArgs(1100, "a:1"),
      "b:2",
      "lease",
    );
    // Each says whether its lease was held; the grants all come, in order, with the last.
    type ReleaseReply = [number, number, number, string[]];
    const flat = (replies: ReleaseReply[]) => replies.flatMap((r) => r[3]);
    expect((batchedReleases as ReleaseReply[]).map((r) => r[0])).toEqual(
      (singleReleases as ReleaseReply[]).map((r) => r[0]),
    );
    expect(flat(batchedReleases as ReleaseReply[])).toEqual(flat(singleReleases as ReleaseReply[]));
    expect(flat(batchedReleases as ReleaseReply[])).toHaveLength(2);
    expect(await dump(many)).toEqual(await dump(one));
  });

  it('releases a gate\'s repeating release step ("~") as a whole step where it is not released with others', async () => {
    const prefix = randomPrefix("repeat-step");
    const sem = keysOf(prefix);
    for (const m of ["a:1", "b:1"])
      await client.eval(scriptSource("semaphore-acquire"), 5, ...sem, ...acquireArgs(1000, m));
    const gate = ["line", "lexp", "gmeta", "held", "hexp", "lane:", "lexp:"].map(
      (part) => `${prefix}{g}:${part}`,
    );
    // One call: a's release ("any": it runs alone), then b's as a repeat of it with its own
    // member and "what" ("lease": it starts a run of releases of its own, so it is built whole).
    const call = JSON.stringify([
      "",
      "try",
      "",
      "",
      "2",
      "semaphore-release",
      "5",
      "8",
      "a:1",
      "3",
      "ch",
      "any",
      "30000",
      "1",
      "",
      "~",
      "1",
      "b:1",
      "lease",
    ]);
    const [reply] = (await client.eval(
      scriptSource("gate"),
      gate.length + sem.length,
      ...gate,
      ...sem,
      1100,
      "each",
      3000,
      "gch",
      1,
      call,
    )) as [[number, number, number, unknown, [number][]]];
    expect(reply[4].map((r) => r[0])).toEqual([1, 1]);
    expect(await client.zcard(sem[0]!)).toBe(0);
    expect(await client.hget(sem[3]!, "used")).toBe("0");
  });

  it.each([
    [
      "someone already in line",
      async (keys: string[]) => {
        await client.eval(scriptSource("semaphore-acquire"), 5, ...keys, ...acquireArgs(900, "h:3"));
        await client.eval(scriptSource("semaphore-acquire"), 5, ...keys, ...acquireArgs(900, "w:1"));
      },
    ],
    [
      "a quarantine",
      async (keys: string[]) => {
        await client.hset(keys[3]!, "quarantine", 5000);
      },
    ],
    [
      "a member asking again",
      async (keys: string[]) => {
        await client.eval(scriptSource("semaphore-acquire"), 5, ...keys, ...acquireArgs(900, "h:3"));
        await client.eval(scriptSource("semaphore-acquire"), 5, ...keys, ...acquireArgs(900, "b:2"));
        await client.eval(scriptSource("semaphore-release"), 5, ...keys, ...releaseArgs(950, "h:3"));
      },
    ],
  ])("decides a batch exactly as one call each with %s", async (_, setup) => {
    const one = keysOf(randomPrefix("one"));
    const many = keysOf(randomPrefix("many"));
    await setup(one);
    await setup(many);
    const members: [string, string][] = [
      ["a:1", ""],
      ["b:2", "1"],
      ["c:1", ""],
      ["d:1", ""],
    ];
    const singles: unknown[] = [];
    for (const [m, again] of members) {
      singles.push(
        await client.eval(scriptSource("semaphore-acquire"), 5, ...one, ...acquireArgs(1000, m, again)),
      );
    }
    const batched = await client.eval(
      scriptSource("semaphore-acquire"),
      5,
      ...many,
      ...acquireArgs(1000, members[0]![0], members[0]![1]),
      ...members.slice(1).flat(),
    );
    expect(batched).toEqual(singles);
    expect(await dump(many)).toEqual(await dump(one));
  });

  it("sends a crowd of admissions and releases as a few script calls, with exact counts", async () => {
    const prefix = randomPrefix("crowd");
    const own = await connectedClient(redisUrl());
    try {
      const sem = redis(own, { prefix, pollMs: 60_000 }).semaphore("crowd", { limit: 10 });
      const calls = () => evalCalls(client);
      // Warm-up: scripts loaded, and the stage subscribed for grants (one caller waits once).
      const warm = await Promise.all(Array.from({ length: 10 }, () => sem.admit()));
      const extra = sem.admit();
      await until(async () => (await client.pubsub("CHANNELS", `${prefix}{crowd}:wake:*`)).length === 1, {
        timeoutMs: 5000,
        message: "the waiter never subscribed",
      });
      await Promise.all(warm.map((t) => t.release("success")));
      await (await extra).release("success");
      const before = await calls();
      const tickets = await Promise.all(Array.from({ length: 10 }, () => sem.admit()));
      // One call for the ten that came in the same turn.
      expect((await calls()) - before).toBe(1);
      expect(sem.snapshot().inFlight).toBe(10);
      expect(await client.hget(`${prefix}{crowd}:meta`, "used")).toBe("10");
      const waiting = Array.from({ length: 10 }, () => sem.admit());
      const mid = await calls();
      await Promise.all(tickets.map((t) => t.release("success")));
      const next = await Promise.all(waiting);
      // The waiters lined up in one call, the releases took one more and granted every waiter;
      // the waiters needed no call of their own to take their permits.
      expect((await calls()) - mid).toBe(2);
      expect(sem.snapshot().inFlight).toBe(10);
      expect(await client.zcard(`${prefix}{crowd}:holders`)).toBe(10);
      expect(await client.zcard(`${prefix}{crowd}:queue`)).toBe(0);
      await Promise.all(next.map((t) => t.release("success")));
      expect(await client.zcard(`${prefix}{crowd}:holders`)).toBe(0);
      expect(await client.hget(`${prefix}{crowd}:meta`, "used")).toBe("0");
    } finally {
      await closeClient(own);
    }
  });
});
