/**
 * Each Lua script run step for step against its TypeScript twin in src/algorithms/, over seeded
 * random sequences on the real redis-server: every reply and every stored field must be what the
 * TypeScript function gives for the same state, time and arguments. (token-bucket-take and
 * token-bucket-take-many are checked the same way in scripts.test.ts.)
 */
import { memory } from "floodgate";
import { commandName, redis, type ScriptName } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type AimdConfig, type AimdState, aimdStep } from "../../src/algorithms/aimd.js";
import { type ClassConfig, type ClassLine, guarantees, nextClass } from "../../src/algorithms/classes.js";
import {
  claimSlot,
  type HostState,
  pauseHost,
  refundSlot,
  spacingMs,
} from "../../src/algorithms/interval.js";
import {
  type BucketConfig,
  type BucketState,
  lineTakeInPlace,
  penalize,
  refund,
  settle,
} from "../../src/algorithms/token-bucket.js";
import { classSpec } from "../../src/base/classes.js";
import { withPrelude } from "../../src/redis/scripts.js";
import { redisUrl } from "../contract/backends.js";
import { closeClient, connectedClient, randomPrefix } from "./helpers.js";

/** Steps per sequence; each script runs a few hundred times per sequence. */
const STEPS = 1500;

/** A seeded generator in [0, 1), so a failing sequence replays from its seed. */
function seeded(seed: number): () => number {
  let x = seed >>> 0 || 1;
  return () => {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    return x / 2 ** 32;
  };
}

const int = (random: () => number, lo: number, hi: number) => lo + Math.floor(random() * (hi - lo + 1));

/** The next time: mostly forward, sometimes standing still or by a fraction, now and then back. */
function step(random: () => number, now: number): number {
  const r = random();
  if (r < 0.1) return now;
  if (r < 0.15) return Math.max(0, now - int(random, 1, 400));
  if (r < 0.25) return now + random() * 50;
  if (r < 0.3) return now + int(random, 10_000, 60_000);
  return now + int(random, 1, 900);
}

describe("Lua scripts against their TypeScript twins", () => {
  let client: Redis;
  let close: () => Promise<void>;
  const run = (name: ScriptName, keys: string[], ...args: (string | number)[]): Promise<unknown> =>
    (client as unknown as Record<string, (...a: unknown[]) => Promise<unknown>>)[commandName(name)]!(
      ...keys,
      ...args,
    );

  beforeAll(async () => {
    client = await connectedClient(redisUrl());
    // Building a backend defines every script as a command on the client.
    const backend = redis(client, { prefix: randomPrefix("twins") });
    close = () => backend.close();
  });

  afterAll(async () => {
    await close?.();
    await closeClient(client);
  });

  describe("traffic classes: the bounds and the next class of floodgate_classes", () => {
    // Each case as JSON, its classes as the stage sends them (classSpec), decided in Lua, the
    // decisions back as JSON (all integers: exact).
    const body = `
      local out = {}
      for _, c in ipairs(cjson.decode(ARGV[1])) do
        local classes = floodgate_classes(KEYS, c.spec)
        local g, ceil, kept = classes.bounds(c.limit)
        local headCost = {}
        for i = 1, #c.used do headCost[i] = c.headCost[i] >= 0 and c.headCost[i] or false end
        local next = classes.next(c.used, headCost, c.headAt, g, ceil, kept, c.free)
        out[#out + 1] = { g, ceil, kept, next - 1 }
      end
      return cjson.encode(out)`;

    it.each([5, 17, 29])(
      "decide as the TypeScript does, over random classes and lines (seed %i)",
      async (seed) => {
        const random = seeded(seed);
        const cases = Array.from({ length: 400 }, () => {
          const n = int(random, 1, 5);
          const classes: ClassConfig[] = Array.from({ length: n }, () => ({
            // Whole and fractional shares, so the remainders and the float rounding are exercised.
            share: random() < 0.5 ? int(random, 1, 100) : Math.round(random() * 1000) / 997,
            priority: int(random, -2, 2),
            maxShare: [0.05, 0.1, 0.25, 0.5, 0.75, 1][int(random, 0, 5)]!,
            lendable: [0, 0.3, 0.5, 0.9, 1, 1][int(random, 0, 5)]!,
          }));
          const limit = random() < 0.3 ? int(random, 1, n) : int(random, 1, 1000);
          const lines: ClassLine[] = classes.map(() => ({
            used: int(random, 0, limit),
            headCost: random() < 0.3 ? undefined : int(random, 0, Math.max(1, limit >> 1)),
            headAt: int(random, 0, 40),
          }));
          return { classes, limit, lines, free: int(random, 0, limit) };
        });
        const json = JSON.stringify(
          cases.map((c) => ({
            limit: c.limit,
            spec: classSpec(c.classes),
            used: c.lines.map((l) => l.used),
            headCost: c.lines.map((l) => l.headCost ?? -1),
            headAt: c.lines.map((l) => l.headAt),
            free: c.free,
          })),
        );
        const reply = JSON.parse((await client.eval(withPrelude(body), 0, json)) as string) as [
          number[],
          number[],
          number[],
          number,
        ][];
        let picked = 0;
        cases.forEach((c, i) => {
          const bounds = guarantees(c.limit, c.classes);
          const next = nextClass(c.lines, bounds, c.classes, c.free);
          if (next >= 0) picked++;
          const [guarantee, ceiling, kept, lua] = reply[i]!;
          expect({ case: i, guarantee, ceiling, kept, next: lua }).toEqual({ case: i, ...bounds, next });
        });
        // The sequences reach both answers: a class picked, and none.
        expect(picked).toBeGreaterThan(40);
        expect(picked).toBeLessThan(cases.length - 40);
      },
    );
  });

  it("floodgate_cost reads a member's cost as its last ':' and digits say, else 1", async () => {
    // Members as the stages make them (permit-stage.ts, bucket-classes.ts), a fused gate's with
    // no cost, and odd ones a hostile caller could not make but the rule still answers.
    const random = seeded(11);
    const members = ["5d4a88618eaa6116-6", "a", "", ":", "a:", "a:b", "a:b:3", "a:07", "a:1:", "~2:15"];
    for (let i = 0; i < 300; i++) {
      const token = Math.floor(random() * 2 ** 48).toString(16);
      const cost = [0, 1, 7, 9, 10, 99, 123_456][int(random, 0, 6)]!;
      const cls = int(random, -1, 3);
      members.push(cls < 0 ? `${token}-${i}:${cost}` : `${token}-${i}~${cls}:${cost}`);
    }
    const body = `
      local out = {}
      for i, m in ipairs(cjson.decode(ARGV[1])) do out[i] = floodgate_cost(m) end
      return out`;
    const reply = (await client.eval(withPrelude(body), 0, JSON.stringify(members))) as number[];
    const expected = members.map((m) => Number(/:(\d+)$/.exec(m)?.[1] ?? 1));
    expect(reply).toEqual(expected);
  });

  describe("token-bucket-settle, -refund and -penalize, with -take for the grants", () => {
    const configs: (BucketConfig & { initial: number; seed: number })[] = [
      { capacity: 10, refillPerSecond: 3.7, recoveryMs: 5000, initial: 6, seed: 11 },
      { capacity: 1, refillPerSecond: 0.25, recoveryMs: 700, initial: 0, seed: 23 },
      { capacity: 1000, refillPerSecond: 250, recoveryMs: 30_000, initial: 1000, seed: 37 },
      // A refill so slow that a debt lasts, and a penalty gone in a millisecond.
      { capacity: 3, refillPerSecond: 0.001, recoveryMs: 1, initial: 3, seed: 41 },
    ];

    it.each(configs)(
      "capacity $capacity, refill $refillPerSecond/s, recovery $recoveryMs ms (seed $seed)",
      async (c) => {
        const random = seeded(c.seed);
        const key = `${randomPrefix("twin-bucket")}b`;
        const head = (now: number) => [now, c.capacity, c.refillPerSecond, c.recoveryMs] as const;
        const fresh = (now: number): BucketState => ({
          tokens: c.initial,
          updatedAt: now,
          factor: 1,
          penalizedAt: now,
        });
        const maxCost = Math.min(c.capacity, 4);
        /** The model: the stored state (undefined while the key is missing) and its latest grant. */
        let s: BucketState | undefined;
        let last: string | undefined;
        let grants = 0;
        const counts = { take: 0, reserve: 0, settle: 0, refund: 0, penalize: 0, expire: 0 };
        let now = 1_000_000;
        for (let i = 0; i < STEPS; i++) {
          const where = `seed ${c.seed}, step ${i} at ${now}`;
          const r = random();
          const before = s ?? fresh(now);
          /** A grant id: the latest mostly, else one that is not (or none at all). */
          const someGrant = () =>
            last !== undefined && random() < 0.7 ? last : `stale${int(random, 0, grants)}`;
          if (r < 0.03) {
            counts.expire++;
            await client.del(key);
            s = undefined;
            last = undefined;
          } else if (r < 0.35) {
            counts.take++;
            const cost = int(random, 1, maxCost);
            const grant = `g${++grants}`;
            // Not at all, as long as it takes, or up to a while.
            const maxWaitMs = random() < 0.4 ? 0 : random() < 0.5 ? -1 : int(random, 0, 5000);
            const reply = (await run(
              "token-bucket-take",
              [key],
              ...head(now),
              cost,
              c.initial,
              grant,
              maxWaitMs,
            )) as number[];
            const state = { ...before };
            const t = lineTakeInPlace(state, c, cost, now, maxWaitMs);
            expect(reply, where).toEqual(t.taken === 2 ? [2, t.waitMs, t.fromMs] : [t.taken, t.waitMs]);
            // A key seen for the first time starts refilling now, granted or not.
            s = t.taken === 0 ? before : state;
            if (t.taken !== 0) last = grant;
            if (t.taken === 2) counts.reserve++;
          } else if (r < 0.65) {
            counts.settle++;
            const delta = random() < 0.5 ? int(random, 1, 3 * maxCost) : -int(random, 1, maxCost);
            const grant = someGrant();
            const reply = await run("token-bucket-settle", [key], ...head(now), delta, c.initial, grant);
            const next = settle(before, c, delta, grant === last, now);
            if (next) {
              expect(reply, where).toBe(Math.floor(next.tokens * 1000));
              s = next;
            } else {
              expect(reply, where).toBe("unchanged");
            }
          } else if (r < 0.85) {
            counts.refund++;
            const cost = int(random, 1, maxCost);
            const grant = someGrant();
            const reply = await run("token-bucket-refund", [key], ...head(now), cost, c.initial, grant);
            if (grant === last) {
              const next = refund(before, c, cost, now);
              expect(reply, where).toBe(Math.floor(next.tokens * 1000));
              s = next;
              last = undefined;
            } else {
              expect(reply, where).toBe(-1);
            }
          } else {
            counts.penalize++;
            const factor = [0.5, 0.3, 0.9, 0.75][int(random, 0, 3)]!;
            const minFactor = [0.1, 0.25, 1][int(random, 0, 2)]!;
            const reply = await run(
              "token-bucket-penalize",
              [key],
              ...head(now),
              factor,
              minFactor,
              c.initial,
            );
            const next = penalize(before, c, factor, minFactor, now);
            expect(reply, where).toBe(Math.floor(next.factor * 1000));
            s = next;
          }
          const [tokens, updatedAt, factor, penalizedAt, storedLast] = await client.hmget(
            key,
            "tokens",
            "updatedAt",
            "factor",
            "penalizedAt",
            "last",
          );
          if (s === undefined) {
            expect(tokens, where).toBeNull();
          } else {
            expect(
              {
                tokens: Number(tokens),
                updatedAt: Number(updatedAt),
                factor: Number(factor),
                penalizedAt: Number(penalizedAt),
              },
              where,
            ).toEqual(s);
          }
          expect(storedLast ?? undefined, where).toBe(last);
          // Real time must not expire the key under a sequence on its own fake clock.
          await client.persist(key);
          now = step(random, now);
        }
        // Every script of the twin ran many times, in and out of debt.
        for (const [name, n] of Object.entries(counts)) {
          // A bucket of 1000 is never short of the costs taken here: nothing to reserve.
          if (name === "reserve" && c.capacity >= 1000) continue;
          expect(n, name).toBeGreaterThan(STEPS / 50);
        }
        await client.del(key);
      },
    );
  });

  describe("aimd-release: the AIMD step", () => {
    const configs: (AimdConfig & { seed: number })[] = [
      { min: 1, max: 50, backoffRatio: 0.9, seed: 5 },
      { min: 3, max: 10, backoffRatio: 0.5, seed: 17 },
      { min: 2, max: 200, backoffRatio: 0.7312345, seed: 29 },
    ];

    it.each(configs)("min $min, max $max, backoffRatio $backoffRatio (seed $seed)", async (c) => {
      const random = seeded(c.seed);
      const prefix = randomPrefix("twin-aimd");
      const keys = ["holders", "queue", "qexp", "meta", "procs"].map((k) => `${prefix}${k}`);
      const [holders, , , meta] = keys as [string, string, string, string, string];
      const outcomes = ["success", "dropped", "ignored", "refund"] as const;
      let s: AimdState = { limit: int(random, c.min, c.max), epoch: 0 };
      await client.hset(meta, "limit", s.limit, "epoch", 0, "used", 0);
      let moved = 0;
      for (let i = 0; i < STEPS; i++) {
        const where = `seed ${c.seed}, step ${i}`;
        if (random() < 0.02) {
          // A limit outside [min, max], as a fleet finds it after a deploy changed them.
          s = { limit: int(random, 1, 2 * c.max), epoch: s.epoch };
          await client.hset(meta, "limit", s.limit);
        }
        const cost = int(random, 1, Math.min(3, c.min));
        // In flight when the sample arrives, this call included: around the limit, either side.
        const used = int(random, cost, 2 * s.limit + 2);
        // Mostly admitted in the current epoch, sometimes in an older one.
        const epoch = random() < 0.7 ? s.epoch : int(random, 0, s.epoch);
        const outcome = outcomes[int(random, 0, 3)]!;
        const slow = random() < 0.2;
        // Now and then the lease is gone already (released or reaped): it teaches nothing.
        const held = random() < 0.9;
        const member = `${i.toString(16)}-1:${cost}`;
        await client.hset(meta, "used", used);
        if (held) await client.zadd(holders, 1e12, member);
        const reply = (await run(
          "aimd-release",
          keys,
          1_000_000 + i,
          member,
          `${prefix}channel`,
          outcome,
          epoch,
          c.min,
          c.max,
          c.backoffRatio,
          slow ? "1" : "0",
          1000,
          "",
        )) as [number, number, number, number, unknown[]];
        const next =
          held && (outcome === "success" || outcome === "dropped")
            ? aimdStep(s, c, { dropped: outcome === "dropped" || slow, inFlight: used, epoch })
            : s;
        if (next.limit !== s.limit) moved++;
        s = next;
        const after = held ? used - cost : used;
        expect(reply.slice(0, 4), where).toEqual([held ? 1 : 0, s.limit, s.epoch, after]);
        expect(reply[4], where).toEqual([]);
        expect(await client.hmget(meta, "limit", "epoch", "used"), where).toEqual([
          String(s.limit),
          String(s.epoch),
          String(after),
        ]);
      }
      expect(moved, "the limit moved").toBeGreaterThan(STEPS / 20);
      await client.del(...keys);
    });

    it("starts from initial, as semaphore-acquire does, when meta has no limit (Redis lost it)", async () => {
      const prefix = randomPrefix("twin-aimd-lost");
      const keys = ["holders", "queue", "qexp", "meta", "procs"].map((k) => `${prefix}${k}`);
      const meta = keys[3]!;
      const c = { min: 1, max: 50, backoffRatio: 0.5 };
      // A lease Redis no longer knows: nothing is learnt, and the limit written is where a fleet starts.
      const args = [
        "1000",
        "gone-1:1",
        `${prefix}channel`,
        "success",
        0,
        c.min,
        c.max,
        c.backoffRatio,
        "0",
        1000,
        "",
      ];
      const reply = (await run("aimd-release", keys, ...args, 7)) as number[];
      expect(reply.slice(0, 3)).toEqual([0, 7, 0]);
      expect(await client.hget(meta, "limit")).toBe("7");
      await client.del(...keys);
    });
  });

  describe("interval-gate-take, -pause and -refund", () => {
    const configs = [
      { minIntervalMs: 100, jitterMs: 0, start: 1_000_000, seed: 3 },
      { minIntervalMs: 250, jitterMs: 137.5, start: 1_000_000, seed: 13 },
      { minIntervalMs: 1, jitterMs: 2000, start: 1_000_000, seed: 31 },
      // A clock below zero (only differences of its readings matter), crossing it.
      { minIntervalMs: 300, jitterMs: 50, start: -200_000, seed: 43 },
    ];

    it.each(configs)(
      "minIntervalMs $minIntervalMs, jitterMs $jitterMs, from $start (seed $seed)",
      async (c) => {
        const random = seeded(c.seed);
        const key = `${randomPrefix("twin-interval")}h`;
        /** The model: a field not written (no slot yet, no pause) holds nothing back. */
        const never = (): HostState => ({ nextAt: -Infinity, pausedUntil: -Infinity });
        const read = (field: string | null | undefined) => (field == null ? -Infinity : Number(field));
        let h = never();
        const claims: { claimed: string; previous: string }[] = [];
        const counts = { started: 0, waited: 0, pause: 0, handedBack: 0, kept: 0, expire: 0 };
        let now = c.start;
        for (let i = 0; i < STEPS; i++) {
          const where = `seed ${c.seed}, step ${i} at ${now}`;
          const r = random();
          if (r < 0.03) {
            counts.expire++;
            await client.del(key);
            h = never();
          } else if (r < 0.6) {
            const spacing = spacingMs(c.minIntervalMs, c.jitterMs, random());
            const reply = (await run("interval-gate-take", [key], now, spacing)) as [number, string, string?];
            if (h.nextAt > now) {
              counts.waited++;
              expect(reply[0], where).toBe(0);
              expect(Number(reply[1]), where).toBe(h.nextAt - now);
            } else {
              counts.started++;
              const previous = claimSlot(h, now, spacing);
              expect(reply[0], where).toBe(1);
              expect(read(reply[1] === "" ? null : reply[1]), where).toBe(previous);
              expect(Number(reply[2]), where).toBe(h.nextAt);
              claims.push({ claimed: reply[2]!, previous: reply[1] });
            }
          } else if (r < 0.75) {
            counts.pause++;
            const ms = random() < 0.5 ? int(random, 0, 3000) : random() * 500;
            const reply = await run("interval-gate-pause", [key], now, ms);
            pauseHost(h, now, ms);
            expect(reply, where).toBe(Math.ceil(h.nextAt - now));
          } else if (claims.length > 0) {
            // The latest claim mostly, else an older one.
            const at = random() < 0.7 ? claims.length - 1 : int(random, 0, claims.length - 1);
            const { claimed, previous } = claims[at]!;
            const reply = await run("interval-gate-refund", [key], now, claimed, previous);
            const handed = refundSlot(h, Number(claimed), read(previous === "" ? null : previous));
            if (handed) counts.handedBack++;
            else counts.kept++;
            expect(reply, where).toBe(handed ? 1 : 0);
          }
          const [nextAt, pausedUntil] = await client.hmget(key, "nextAt", "pausedUntil");
          expect(read(nextAt), where).toBe(h.nextAt);
          expect(read(pausedUntil), where).toBe(h.pausedUntil);
          await client.persist(key);
          now = step(random, now);
        }
        for (const [name, n] of Object.entries(counts)) expect(n, name).toBeGreaterThan(STEPS / 100);
        await client.del(key);
      },
    );
  });

  it("starts, pauses and hands back a fresh host's slot alike in memory and on Redis on a clock below zero", async () => {
    const clock = new FakeClock(-10_000);
    const onRedis = redis(client, { prefix: randomPrefix("twin-below-zero"), clock, time: "clock" });
    const inMemory = memory({ clock });
    try {
      const gates = [inMemory, onRedis].map((b) => b.intervalGate("g", { minIntervalMs: 100 }));
      const started = async () =>
        Promise.all(gates.map(async (g) => (await g.tryAdmit({ host: "h" })) !== undefined));
      expect(await started()).toEqual([true, true]);
      expect(await started()).toEqual([false, false]);
      // The first slot of a fresh host handed back: the host may start again at once.
      const tickets = await Promise.all(gates.map((g) => g.tryAdmit({ host: "r" })));
      await Promise.all(tickets.map((t) => t!.refund()));
      expect(
        await Promise.all(gates.map(async (g) => (await g.tryAdmit({ host: "r" })) !== undefined)),
      ).toEqual([true, true]);
      await Promise.all(gates.map((g) => g.pause("p", 50)));
      expect(
        await Promise.all(gates.map(async (g) => (await g.tryAdmit({ host: "p" })) !== undefined)),
      ).toEqual([false, false]);
      await clock.advance(50);
      expect(
        await Promise.all(gates.map(async (g) => (await g.tryAdmit({ host: "p" })) !== undefined)),
      ).toEqual([true, true]);
    } finally {
      await Promise.all([inMemory.close(), onRedis.close()]);
    }
  });
});
