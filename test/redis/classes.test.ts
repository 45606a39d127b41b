import { type Logger, ReclaimedError, type Ticket } from "floodgate";
import { redis, scriptSource } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type ClassConfig, type ClassLine, guarantees, nextClass } from "../../src/algorithms/classes.js";
import { redisUrl } from "../contract/backends.js";
import { useClients } from "./clients.js";
import { scriptStage } from "./fixtures/permit-scripts.js";
import { closeClient, connectedClient, randomPrefix, until } from "./helpers.js";

/** Each class's waiters are scored in a band of their own: class i from i × 2^48. */
const BAND = 2 ** 48;

/** Interactive (class 0: share 3, priority 1) and bulk (class 1: share 1); at a limit of 4, guarantees 3 and 1. */
const SPEC = "3,1,1,1;1,1,1,0";
const CONFIGS: ClassConfig[] = [
  { share: 3, maxShare: 1, lendable: 1, priority: 1 },
  { share: 1, maxShare: 1, lendable: 1, priority: 0 },
];

/**
 * Traffic classes decided in Redis: the permit scripts called directly with explicit times, so
 * every lease end is exact, then two processes sharing one stage. The class tables themselves
 * run on every backend in test/contract/classes.test.ts.
 */
describe("traffic classes in the permit scripts", () => {
  let client: Redis;
  beforeAll(async () => {
    client = await connectedClient(redisUrl());
  });
  afterAll(async () => {
    await closeClient(client);
  });

  const stage = (label: string) => scriptStage(client, label);
  const o = (extra: object = {}) => ({ classes: SPEC, listeners: false, livenessMs: 600_000, ...extra });

  it("lines each class up in its own band of scores, in arrival order", async () => {
    const s = stage("bands");
    for (let i = 1; i <= 4; i++) expect((await s.acquire(1000, `h${i}~1:1`, 4, o()))[0]).toBe(1);
    await s.acquire(1000, "b1~1:1", 4, o());
    await s.acquire(1000, "i1~0:2", 4, o());
    await s.acquire(1000, "b2~1:1", 4, o());
    const queue = await client.zrange(s.keys[1]!, 0, -1, "WITHSCORES");
    const scored = new Map<string, number>();
    for (let i = 0; i < queue.length; i += 2) scored.set(queue[i]!, Number(queue[i + 1]));
    expect(scored.get("i1~0:2")).toBeLessThan(BAND);
    expect(scored.get("b1~1:1")).toBeGreaterThanOrEqual(BAND);
    expect(scored.get("b1~1:1")!).toBeLessThan(scored.get("b2~1:1")!);
    expect(await s.classUsed(2)).toEqual([0, 4]);
  });

  it("gives a lease that ran out back to its own class when it is reaped", async () => {
    const s = stage("reap");
    for (let i = 1; i <= 4; i++) await s.acquire(1000, `h${i}~1:1`, 4, o());
    expect(await s.classUsed(2)).toEqual([0, 4]);
    // Every bulk lease ends at 31 000; interactive asks after that and goes at once.
    const reply = await s.acquire(31_001, "i1~0:3", 4, o());
    expect(reply[0]).toBe(1);
    expect(await s.classUsed(2)).toEqual([3, 0]);
    expect(await s.used()).toBe(3);
  });

  it("gives what reaping frees to the line first, by class, before the call that reaped it", async () => {
    const s = stage("reap-line");
    for (let i = 1; i <= 4; i++) await s.acquire(1000, `h${i}~1:1`, 4, o());
    // Bulk waits from 29 000 (its place in line lasts 3 s); the leases end at 31 000.
    expect((await s.acquire(29_000, "b1~1:1", 4, o()))[0]).toBe(0);
    const reply = await s.acquire(31_001, "i1~0:3", 4, o());
    // Bulk holds nothing then, so it is owed its guarantee of 1 and asked first: it is granted
    // on the way, and interactive takes the 3 left.
    expect(reply[5].map((g) => g.split("|")[0])).toEqual(["b1~1:1"]);
    expect(reply[0]).toBe(1);
    expect(await s.classUsed(2)).toEqual([3, 1]);
  });

  it("on release, passes over an owed waiter whose process went silent and grants the borrower", async () => {
    const s = stage("silent");
    for (let i = 1; i <= 4; i++) await s.acquire(1000, `bb-${i}~1:1`, 4, o());
    await s.acquire(1000, "aa-1~0:1", 4, o({ livenessMs: 500 })); // alive until 1500
    await s.acquire(1000, "cc-1~1:1", 4, o({ livenessMs: 10_000 })); // in line until 4000
    const [, , used, grants] = await s.release(2000, "bb-1~1:1", 4, "lease", o());
    expect(grants.map((g) => g.split("|")[0])).toEqual(["cc-1~1:1"]);
    expect(used).toBe(4);
    expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual([]);
    expect(await s.classUsed(2)).toEqual([0, 4]);
  });

  it("passes over a waiter nobody listens for, keeping its place in its class's line", async () => {
    const s = stage("deaf");
    const listener = await connectedClient(redisUrl());
    try {
      await listener.subscribe(`${s.channel}:ee`);
      for (let i = 1; i <= 4; i++) await s.acquire(1000, `bb-${i}~1:1`, 4, o());
      await s.acquire(1000, "dd-1~0:1", 4, o());
      await s.acquire(1000, "ee-1~0:1", 4, o());
      const [, , , grants] = await s.release(2000, "bb-1~1:1", 4, "lease", o({ listeners: true }));
      expect(grants.map((g) => g.split("|")[0])).toEqual(["ee-1~0:1"]);
      expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual(["dd-1~0:1"]);
    } finally {
      await closeClient(listener);
    }
  });

  it("lines a call up in its class's band during a quarantine, and serves by class after it", async () => {
    const s = stage("quarantine");
    await s.acquire(1000, "h1~1:1", 4, o());
    // A process that saw fence 100 finds Redis at 1: Redis lost data, nothing is granted for a lease.
    await client.eval("redis.call('HSET', KEYS[1], 'seq', 1)", 1, s.keys[3]!);
    const q = await client.eval(
      scriptSource("semaphore-acquire"),
      5,
      ...s.keys,
      2000,
      "b1~1:1",
      4,
      30_000,
      "wait",
      60_000,
      s.channel,
      "",
      100,
      "",
      600_000,
      "",
      30_000,
      SPEC,
    );
    expect((q as number[])[6]).toBeGreaterThan(0);
    expect(Number(await client.zscore(s.keys[1]!, "b1~1:1"))).toBeGreaterThanOrEqual(BAND);
  });

  /** Whether `nextClass` would still grant someone, read from what Redis holds now. */
  async function grantable(s: ReturnType<typeof stage>, limit: number): Promise<number> {
    const queue = await client.zrange(s.keys[1]!, 0, -1, "WITHSCORES");
    const lines: ClassLine[] = CONFIGS.map(() => ({ used: 0, headCost: undefined, headAt: 0 }));
    const used = await s.classUsed(2);
    for (let i = 0; i < 2; i++) (lines[i] as { used: number }).used = used[i]!;
    for (let i = 0; i < queue.length; i += 2) {
      const score = Number(queue[i + 1]);
      const cls = Math.floor(score / BAND);
      const line = lines[cls] as { headCost: number | undefined; headAt: number };
      if (line.headCost === undefined) {
        line.headCost = Number(queue[i]!.split(":")[1]);
        line.headAt = score - cls * BAND;
      }
    }
    return nextClass(lines, guarantees(limit, CONFIGS), CONFIGS, limit - (await s.used()));
  }

  it.each([
    ["", SPEC],
    [', asking borrowed leases back (reclaim "signal")', `!${SPEC}`],
  ])(
    "keeps every count true, the limit and each ceiling held, and nobody grantable left waiting, under random calls%s",
    async (_, spec) => {
      const o = (extra: object = {}) => ({ classes: spec, listeners: false, livenessMs: 600_000, ...extra });
      let askedSteps = 0;
      for (const seed of [1, 2, 3]) {
        const s = stage(`random-${seed}-${spec.length}`);
        let x = seed;
        const random = () => {
          x = (x * 1103515245 + 12345) % 2 ** 31;
          return x / 2 ** 31;
        };
        const limit = 6;
        const bounds = guarantees(limit, CONFIGS);
        let now = 1000;
        let n = 0;
        const waiting = new Set<string>();
        for (let step = 0; step < 300; step++) {
          const where = `seed ${seed}, step ${step}`;
          now += Math.floor(random() * 400);
          const r = random();
          const holders = await client.zrange(s.keys[0]!, 0, -1);
          if (r < 0.45) {
            const cls = random() < 0.5 ? 0 : 1;
            const cost = 1 + Math.floor(random() * 2);
            const member = `m${++n}~${cls}:${cost}`;
            const reply = await s.acquire(now, member, limit, o({ mode: random() < 0.8 ? "wait" : "try" }));
            if (reply[0] === 0 && (await client.zscore(s.keys[1]!, member)) !== null) waiting.add(member);
          } else if (r < 0.85 && holders.length > 0) {
            const member = holders[Math.floor(random() * holders.length)]!;
            await s.release(now, member, limit, "lease", o());
          } else if (waiting.size > 0) {
            // A waiter asks again (its grant may have come on a release), or leaves.
            const member = [...waiting][Math.floor(random() * waiting.size)]!;
            waiting.delete(member);
            if (random() < 0.5) await s.acquire(now, member, limit, o({ again: true }));
            else await s.release(now, member, limit, "any", o());
          }
          const held = await client.zrange(s.keys[0]!, 0, -1);
          const byClass = [0, 0];
          for (const m of held) byClass[Number(m.split("~")[1]!.split(":")[0])]! += Number(m.split(":")[1]);
          expect(await s.used(), where).toBe(byClass[0]! + byClass[1]!);
          expect(await s.classUsed(2), where).toEqual(byClass);
          expect(byClass[0]! + byClass[1]!, where).toBeLessThanOrEqual(limit);
          for (let i = 0; i < 2; i++) expect(byClass[i], where).toBeLessThanOrEqual(bounds.ceiling[i]!);
          expect(await grantable(s, limit), where).toBe(-1);
          // Leases asked back are asked once, and are leases, never waiters.
          const asked = ((await client.hget(s.keys[3]!, "rc")) ?? "").split(" ").filter(Boolean);
          expect(new Set(asked).size, where).toBe(asked.length);
          for (const m of asked) expect(await client.zscore(s.keys[1]!, m), where).toBeNull();
          if (asked.length > 0) askedSteps++;
        }
      }
      // Without reclaim nothing is ever asked; with it, the random calls do ask.
      if (spec === SPEC) expect(askedSteps).toBe(0);
      else expect(askedSteps).toBeGreaterThan(0);
    },
  );
});

describe("traffic classes across processes", () => {
  const { clients, connect } = useClients();

  async function processes(n: number, prefix: string) {
    const out = [];
    for (let i = 0; i < n; i++) {
      const client = await connect();
      out.push(redis(client, { prefix, pollMs: 60_000 }));
    }
    return out;
  }

  const classes = { interactive: { share: 3, priority: 1 }, bulk: { share: 1 } };

  it("warns, once per difference, when another process built the stage with other classes", async () => {
    const prefix = randomPrefix("classes-differ");
    const warned: { obj: object; msg?: string }[] = [];
    const logger: Logger = {
      child: () => logger,
      debug: () => {},
      info: () => {},
      warn: (obj, msg) => void warned.push({ obj, msg }),
      error: () => {},
    };
    const [a, b] = await processes(2, prefix);
    const semA = a!.semaphore("cls", { limit: 4, classes, logger });
    const semB = b!.semaphore("cls", {
      limit: 4,
      classes: { interactive: { share: 1 }, bulk: { share: 1 } },
    });
    await (await semA.admit({ class: "bulk" })).release("success");
    expect(warned).toEqual([]);
    await (await semB.admit({ class: "bulk" })).release("success");
    await (await semA.admit({ class: "bulk" })).release("success");
    await (await semA.admit({ class: "bulk" })).release("success");
    expect(warned.map((w) => w.msg)).toEqual([
      expect.stringContaining("another process built this stage with other classes"),
    ]);
    expect(warned[0]!.obj).toEqual({ theirs: "1,1,1,0;1,1,1,0", ours: "3,1,1,1;1,1,1,0" });
  });

  it('asks a borrowed lease of another process back through its signal (reclaim "signal")', async () => {
    const prefix = randomPrefix("classes-reclaim");
    const [a, b] = await processes(2, prefix);
    const semA = a!.semaphore("cls", { limit: 4, classes, reclaim: "signal" });
    const semB = b!.semaphore("cls", { limit: 4, classes, reclaim: "signal" });
    const held: Ticket[] = [];
    for (let k = 0; k < 4; k++) held.push(await semA.admit({ class: "bulk" }));
    // Bulk borrows 3 beyond its guarantee of 1; interactive of B wants 2 of its 3.
    const interactive = [semB.admit({ class: "interactive" }), semB.admit({ class: "interactive" })];
    await until(() => held.filter((t) => t.signal.aborted).length === 2, {
      timeoutMs: 5000,
      message: "no borrowed lease asked back",
    });
    expect(held.map((t) => t.signal.aborted)).toEqual([false, false, true, true]);
    expect(held[3]!.signal.reason).toBeInstanceOf(ReclaimedError);
    // Asked back, still held: nothing is granted before its release.
    expect(semB.snapshot().classes!.interactive!.held).toBe(0);
    await held[3]!.release("success");
    await held[2]!.release("success");
    await Promise.all((await Promise.all(interactive)).map((t) => t.release("success")));
    await held[1]!.release("success");
    await held[0]!.release("success");
    expect(await clients[0]!.hmget(`${prefix}{cls}:meta`, "used", "u0", "u1")).toEqual(["0", "0", "0"]);
  });

  it("serves the owed class of another process first, and each class in arrival order across processes", async () => {
    const prefix = randomPrefix("classes");
    const [a, b, c] = await processes(3, prefix);
    const semA = a!.semaphore("cls", { limit: 4, classes });
    const semB = b!.semaphore("cls", { limit: 4, classes });
    const semC = c!.semaphore("cls", { limit: 4, classes });
    const queue = `${prefix}{cls}:queue`;
    const held = await Promise.all([1, 2, 3, 4].map(() => semA.admit({ class: "bulk" })));
    const order: string[] = [];
    const tickets: Promise<Ticket>[] = [];
    const inLine = () => clients[0]!.zcard(queue);
    const lineUp = async (sem: typeof semA, cls: string, label: string) => {
      const before = await inLine();
      tickets.push(
        sem.admit({ class: cls }).then((t) => {
          order.push(label);
          return t;
        }),
      );
      await until(async () => (await inLine()) === before + 1, {
        timeoutMs: 5000,
        message: `${label} did not line up`,
      });
    };
    // Bulk of B asks first, then interactive of C, then interactive of B.
    await lineUp(semB, "bulk", "B bulk");
    await lineUp(semC, "interactive", "C interactive");
    await lineUp(semB, "interactive", "B interactive");
    // Both waiting processes listen for their grants (a waiter nobody listens for is passed over).
    await until(async () => (await clients[0]!.pubsub("CHANNELS", `${prefix}{cls}:wake:*`)).length === 2, {
      timeoutMs: 5000,
      message: "B and C did not subscribe",
    });
    for (let k = 0; k < 3; k++) {
      await held[k]!.release("success");
      await until(() => order.length > k, {
        timeoutMs: 5000,
        message: `nobody granted after release ${k + 1}`,
      });
    }
    // Interactive holds less than its 3 until both of its waiters have theirs; bulk, holding 1
    // (its guarantee) after three releases, borrows only then.
    expect(order).toEqual(["C interactive", "B interactive", "B bulk"]);
    expect(semB.snapshot().classes).toMatchObject({ interactive: { held: 1 }, bulk: { held: 1 } });
    expect(await clients[0]!.hmget(`${prefix}{cls}:meta`, "used", "u0", "u1")).toEqual(["4", "2", "2"]);
    await held[3]!.release("success");
    await Promise.all((await Promise.all(tickets)).map((t) => t.release("success")));
    expect(await clients[0]!.hmget(`${prefix}{cls}:meta`, "used", "u0", "u1")).toEqual(["0", "0", "0"]);
  });
});
