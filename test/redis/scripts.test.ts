import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { commandName, redis, SCRIPTS, type ScriptName, scriptSha, scriptSource } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  type BucketConfig,
  type BucketState,
  lineTakeInPlace,
  penalize,
  refund,
} from "../../src/algorithms/token-bucket.js";
import { ownRedis } from "./clients.js";
import { closeClient, connectedClient, ROOT, randomPrefix } from "./helpers.js";

/** This file counts the script calls Redis runs: on a server of its own. */
const redisUrl = ownRedis();

const LUA_DIR = join(ROOT, "lua");
const luaFiles = readdirSync(LUA_DIR)
  .filter((file) => file.endsWith(".lua") && file !== "prelude.lua")
  .map((file) => file.slice(0, -".lua".length))
  .sort();
/** Files that are a part of a script, not one of their own: the gate's first pass. */
const PARTS: Record<string, ScriptName> = { "gate-first": "gate" };
const names = Object.keys(SCRIPTS).sort() as ScriptName[];

/** The comment block a script starts with (its leading `--` lines, blank comment lines included). */
function header(name: string): string {
  const lines = readFileSync(join(LUA_DIR, `${name}.lua`), "utf8").split("\n");
  const block: string[] = [];
  for (const line of lines) {
    if (!line.startsWith("--")) break;
    block.push(line);
  }
  return block.join("\n");
}

/** Distinct `KEYS[i]` / `ARGV[i]` indexes mentioned in `text`. */
function indexes(text: string, table: "KEYS" | "ARGV"): number[] {
  const found = new Set<number>();
  for (const m of text.matchAll(new RegExp(`${table}\\[(\\d+)\\]`, "g"))) found.add(Number(m[1]));
  return [...found].sort((a, b) => a - b);
}

describe("Lua scripts on disk", () => {
  it("registers every file in lua/ except the prelude and the parts of a script, and nothing else", () => {
    expect(luaFiles.length).toBeGreaterThan(0);
    expect(names).toEqual(luaFiles.filter((name) => !(name in PARTS)));
    for (const [part, script] of Object.entries(PARTS)) {
      expect(scriptSource(script), `${part} in ${script}`).toContain(
        readFileSync(join(LUA_DIR, `${part}.lua`), "utf8"),
      );
    }
  });

  it.each(luaFiles)("%s starts with a comment block listing its KEYS and ARGV", (name) => {
    const block = header(name);
    expect(block, `lua/${name}.lua must start with a comment block`).not.toBe("");
    expect(block).toContain("KEYS[1]");
    expect(block).toContain("ARGV[1]");
  });

  it.each(luaFiles)("%s documents every KEYS and ARGV it reads, and numberOfKeys matches", (name) => {
    const body = readFileSync(join(LUA_DIR, `${name}.lua`), "utf8").slice(header(name).length);
    const documentedKeys = indexes(header(name), "KEYS");
    const documentedArgs = indexes(header(name), "ARGV");
    for (const i of indexes(body, "KEYS")) expect(documentedKeys, `KEYS[${i}] of ${name}`).toContain(i);
    for (const i of indexes(body, "ARGV")) expect(documentedArgs, `ARGV[${i}] of ${name}`).toContain(i);
    // ioredis splits KEYS from ARGV by numberOfKeys: it must be the number of keys documented.
    // A script whose keys are counted per call (-1) documents its fixed ones and "KEYS[n…]".
    const count = SCRIPTS[PARTS[name] ?? (name as ScriptName)];
    if (count < 0) expect(header(name)).toMatch(new RegExp(`KEYS\\[${documentedKeys.length + 1}…\\]`));
    const fixed = count < 0 ? documentedKeys.length : count;
    expect(documentedKeys).toEqual(Array.from({ length: fixed }, (_, i) => i + 1));
  });
});

describe("the prelude in front of each script", () => {
  /** Code without comments: the `floodgate_*` names it calls, and those it defines. */
  function prelude(name: ScriptName) {
    const code = scriptSource(name).replace(/--[^\n]*/g, "");
    // Functions, and one-line values (`local floodgate_band = …`).
    const defined = [...code.matchAll(/^local (?:function )?(floodgate_\w+)/gm)].map((m) => m[1]!);
    const named = new Set(code.match(/floodgate_\w+/g) ?? []);
    return { code, defined, named };
  }

  it.each(names)("%s defines every prelude function it calls, before calling it", (name) => {
    const { code, defined, named } = prelude(name);
    for (const fn of named) expect(defined, `${fn} in ${name}`).toContain(fn);
    for (const fn of defined) {
      const definition = code.search(new RegExp(`^local (?:function )?${fn}\\b`, "m"));
      const uses = [...code.matchAll(new RegExp(`\\b${fn}\\b`, "g"))].map((m) => m.index!);
      expect(
        uses.every((at) => at >= definition),
        `${fn} is called before it is defined in ${name}`,
      ).toBe(true);
    }
  });

  it.each(names)("%s carries no prelude function it never calls", (name) => {
    const { code, defined } = prelude(name);
    for (const fn of defined) {
      const calls = code.match(new RegExp(`\\b${fn}\\b`, "g"))?.length ?? 0;
      expect(calls, `${fn} is only defined in ${name}`).toBeGreaterThan(1);
    }
  });

  it("never reads the global KEYS or ARGV in a definition (a gate runs each script as a step with its own)", () => {
    const code = readFileSync(join(LUA_DIR, "prelude.lua"), "utf8")
      .split("\n")
      .filter((line) => !line.trimStart().startsWith("--"))
      .join("\n");
    expect(code.match(/\b(KEYS|ARGV)\b/g) ?? []).toEqual([]);
  });

  it("ends each script with the script itself, unchanged", () => {
    for (const name of names) {
      expect(scriptSource(name).endsWith(readFileSync(join(LUA_DIR, `${name}.lua`), "utf8"))).toBe(true);
    }
  });
});

describe("Lua scripts on Redis", () => {
  let client: Redis;
  let admin: Redis;

  beforeAll(async () => {
    const url = redisUrl();
    client = await connectedClient(url);
    admin = await connectedClient(url);
  });

  afterAll(async () => {
    await Promise.all([closeClient(client), closeClient(admin)]);
  });

  it("defines every script as a command on the client once a backend is built", async () => {
    const backend = redis(client, { prefix: randomPrefix("scripts") });
    try {
      for (const name of names) {
        expect(typeof (client as unknown as Record<string, unknown>)[commandName(name)], name).toBe(
          "function",
        );
      }
    } finally {
      await backend.close();
    }
  });

  it.each(names)("scriptSha(%s) is the SHA that SCRIPT LOAD returns", async (name) => {
    const sha = await admin.script("LOAD", scriptSource(name));
    expect(sha).toBe(scriptSha(name));
    expect(scriptSha(name)).toMatch(/^[0-9a-f]{40}$/);
  });

  it("runs the token bucket exactly as src/algorithms/token-bucket.ts does, step for step", async () => {
    const backend = redis(client, { prefix: randomPrefix("bucket-math") });
    const run = (name: ScriptName, key: string, ...args: (string | number)[]) =>
      (client as unknown as Record<string, (...a: unknown[]) => Promise<unknown>>)[commandName(name)]!(
        key,
        ...args,
      );
    const c: BucketConfig = { capacity: 10, refillPerSecond: 3.7, recoveryMs: 5000 };
    const key = `${randomPrefix("bucket-math")}b`;
    const args = (now: number) => [now, c.capacity, c.refillPerSecond, c.recoveryMs] as const;
    const stored = async (): Promise<BucketState> => {
      const [tokens, updatedAt, factor, penalizedAt] = await client.hmget(
        key,
        "tokens",
        "updatedAt",
        "factor",
        "penalizedAt",
      );
      return {
        tokens: Number(tokens),
        updatedAt: Number(updatedAt),
        factor: Number(factor),
        penalizedAt: Number(penalizedAt),
      };
    };
    const random = seeded(7);
    let s: BucketState | undefined;
    let now = 1_000_000;
    /** How long a caller waits: not at all, as long as it takes (-1), or up to a few seconds. */
    const maxWait = () => {
      const r = random();
      return r < 0.3 ? 0 : r < 0.6 ? -1 : Math.floor(random() * 3000);
    };
    try {
      for (let step = 0; step < 1000; step++) {
        const where = `step ${step} at ${now}`;
        const r = random();
        if (r < 0.03) {
          // The key expires: a fresh, never penalised bucket again.
          await client.del(key);
          s = undefined;
        } else if (r < 0.1 && s) {
          await run("token-bucket-penalize", key, ...args(now), 0.5, 0.1, c.capacity);
          s = penalize(s, c, 0.5, 0.1, now);
        } else if (r < 0.35) {
          // Several callers at once: as if each had taken in turn at the same time.
          const takes = Array.from({ length: 2 + Math.floor(random() * 4) }, (_, i) => ({
            cost: 1 + Math.floor(random() * 4),
            grant: `g${step}.${i}`,
            maxWaitMs: maxWait(),
          }));
          const replies = (await run(
            "token-bucket-take-many",
            key,
            ...args(now),
            c.capacity,
            ...takes.flatMap((t) => [t.cost, t.grant, t.maxWaitMs]),
          )) as number[];
          let last: string | undefined;
          takes.forEach((t, i) => {
            const state = { ...(s ?? { tokens: c.capacity, updatedAt: now, factor: 1, penalizedAt: now }) };
            const r = lineTakeInPlace(state, c, t.cost, now, t.maxWaitMs);
            const want = [r.taken, r.waitMs, r.taken === 2 ? r.fromMs : 0];
            expect(replies.slice(3 * i, 3 * i + 3), `${where}, caller ${i}`).toEqual(want);
            if (r.taken !== 0) {
              s = state;
              last = t.grant;
            }
          });
          if (last) expect(await client.hget(key, "last"), where).toBe(last);
        } else {
          const cost = 1 + Math.floor(random() * 4);
          const grant = `g${step}`;
          const maxWaitMs = maxWait();
          const reply = (await run(
            "token-bucket-take",
            key,
            ...args(now),
            cost,
            c.capacity,
            grant,
            maxWaitMs,
          )) as number[];
          const state = { ...(s ?? { tokens: c.capacity, updatedAt: now, factor: 1, penalizedAt: now }) };
          const r = lineTakeInPlace(state, c, cost, now, maxWaitMs);
          expect(reply, where).toEqual(r.taken === 2 ? [2, r.waitMs, r.fromMs] : [r.taken, r.waitMs]);
          if (r.taken !== 0) {
            s = state;
            if (random() < 0.2) {
              // Given back while the latest, taken or reserved: as if never taken.
              await run("token-bucket-refund", key, ...args(now), cost, c.capacity, grant);
              s = refund(s, c, cost, now);
            }
          }
        }
        if (s) expect(await stored(), where).toEqual(s);
        // Mostly forward, sometimes standing still, now and then a step back.
        now += Math.floor(random() * 900) - (random() < 0.05 ? 300 : 0);
      }
    } finally {
      await backend.close();
    }
  });

  /** A seeded generator of numbers in [0, 1), so a failing sequence can be replayed. */
  function seeded(start: number): () => number {
    let seed = start;
    return () => {
      seed = (seed * 1103515245 + 12345) % 2 ** 31;
      return seed / 2 ** 31;
    };
  }

  /** Call script `name` with `keys` and `args` through the command the backend defined. */
  function call(
    name: ScriptName,
    keys: readonly string[],
    args: readonly (string | number)[],
  ): Promise<unknown> {
    const client_ = client as unknown as Record<string, (...a: unknown[]) => Promise<unknown>>;
    return client_[commandName(name)]!(...keys, ...args);
  }

  it("decides a turn of an interval gate's callers as if each had called alone, in turn", async () => {
    const backend = redis(client, { prefix: randomPrefix("interval-many") });
    const random = seeded(11);
    const [together, alone] = [`${randomPrefix("interval-many")}h`, `${randomPrefix("interval-alone")}h`];
    let now = 1_000_000;
    try {
      for (let step = 0; step < 300; step++) {
        const where = `step ${step} at ${now}`;
        // Spacings of 0 (callers that may start at once) and others, some fractional.
        const spacings = Array.from({ length: 2 + Math.floor(random() * 4) }, () =>
          random() < 0.4 ? 0 : Math.floor(random() * 400) + (random() < 0.3 ? 0.25 : 0),
        );
        const replies = (await call("interval-gate-take", [together], [now, ...spacings])) as unknown[];
        const each: unknown[] = [];
        for (const spacing of spacings) each.push(await call("interval-gate-take", [alone], [now, spacing]));
        expect(replies, where).toEqual(each);
        expect(await client.hget(together, "nextAt"), where).toBe(await client.hget(alone, "nextAt"));
        const [a, b] = [await client.pttl(together), await client.pttl(alone)];
        expect(Math.abs(a - b), `${where}: the same expiry`).toBeLessThan(100);
        now += Math.floor(random() * 300);
      }
    } finally {
      await backend.close();
    }
  });

  it("releases a turn of an AIMD limiter's leases as if each had released alone, in turn", async () => {
    const backend = redis(client, { prefix: randomPrefix("aimd-many") });
    const random = seeded(5);
    const keysOf = (prefix: string) =>
      ["holders", "queue", "qexp", "meta", "procs"].map((k) => `${prefix}${k}`);
    const together = keysOf(randomPrefix("aimd-many"));
    const alone = keysOf(randomPrefix("aimd-alone"));
    const OUTCOMES = ["success", "dropped", "ignored", "refund"];
    try {
      for (let step = 0; step < 150; step++) {
        const where = `step ${step}`;
        const limit = 1 + Math.floor(random() * 20);
        const epoch = Math.floor(random() * 3);
        const leases = Array.from({ length: 2 + Math.floor(random() * 5) }, (_, i) => ({
          member: `l${step}.${i}:${1 + Math.floor(random() * 3)}`,
          held: random() < 0.8,
          // (One not held may be a waiter in the limiter's line: a release takes it out.)
          queued: random() < 0.5,
          outcome: OUTCOMES[Math.floor(random() * OUTCOMES.length)]!,
          epoch: random() < 0.7 ? epoch : epoch - 1,
          slow: random() < 0.2 ? "1" : "0",
        }));
        const used = leases.filter((l) => l.held).reduce((n, l) => n + Number(l.member.split(":")[1]), 0);
        for (const keys of [together, alone]) {
          await client.del(...keys);
          await client.hset(keys[3]!, "limit", limit, "epoch", epoch, "used", used);
          for (const l of leases) {
            if (l.held) await client.zadd(keys[0]!, 10_000_000, l.member);
            else if (l.queued) {
              await client.zadd(keys[1]!, step, l.member);
              await client.zadd(keys[2]!, 10_000_000, l.member);
            }
          }
        }
        // now, member, channel, outcome, epoch, min, max, ratio, slow, claimMs, listeners, initial, classes
        const args = (l: (typeof leases)[number]) =>
          [1_000_000, l.member, "ch", l.outcome, l.epoch, 1, 20, 0.7, l.slow, 500, "1", limit, ""] as const;
        const [first, ...rest] = leases;
        const replies = (await call("aimd-release", together, [
          ...args(first!),
          ...rest.flatMap((l) => [l.member, l.outcome, l.epoch, l.slow]),
        ])) as unknown[];
        const each: unknown[] = [];
        for (const l of leases) each.push(await call("aimd-release", alone, args(l)));
        expect(replies, where).toEqual(each);
        expect(await client.hmget(together[3]!, "limit", "epoch", "used"), where).toEqual(
          await client.hmget(alone[3]!, "limit", "epoch", "used"),
        );
        for (const i of [0, 1, 2]) expect(await client.zcard(together[i]!), where).toBe(0);
      }
    } finally {
      await backend.close();
    }
  });

  it("sends the takes many callers make of one key at once in few script calls, granted in call order", async () => {
    const backend = redis(client, {
      prefix: randomPrefix("take-many"),
      clock: new FakeClock(),
      time: "clock",
    });
    try {
      const bucket = backend.tokenBucket("many", { capacity: 20, refillPerSecond: 0.001 });
      const calls = async () => {
        const info = await admin.info("commandstats");
        return Number(/^cmdstat_evalsha:calls=(\d+)/m.exec(info)?.[1] ?? 0);
      };
      const before = await calls();
      const tickets = await Promise.all(Array.from({ length: 50 }, () => bucket.tryAdmit()));
      const sent = (await calls()) - before;
      expect(tickets.map((t) => t !== undefined)).toEqual(Array.from({ length: 50 }, (_, i) => i < 20));
      expect(sent).toBeLessThanOrEqual(3);
      await expect(bucket.tryAdmit()).resolves.toBeUndefined();
    } finally {
      await backend.close();
    }
  });

  it("keeps admitting after SCRIPT FLUSH (the client resends the script on NOSCRIPT)", async () => {
    const backend = redis(client, { prefix: randomPrefix("flush") });
    try {
      const sem = backend.semaphore("sem", { limit: 1, leaseMs: 10_000 });
      const bucket = backend.tokenBucket("bucket", { capacity: 10, refillPerSecond: 1 });
      const spacing = backend.intervalGate("hosts", { minIntervalMs: 1 });

      const first = await sem.admit();
      await bucket.admit();
      await spacing.admit({ host: "a" });

      await admin.script("FLUSH");
      const [acquireLoaded] = (await admin.script("EXISTS", scriptSha("semaphore-acquire"))) as number[];
      expect(acquireLoaded).toBe(0);

      // The release and the following acquire both run on a server that has forgotten them.
      await first.release("success");
      const second = await sem.tryAdmit();
      expect(second).toBeDefined();
      expect(await sem.tryAdmit()).toBeUndefined(); // the limit still holds
      await second!.release("success");
      await expect(bucket.tryAdmit()).resolves.toBeDefined();
      await expect(spacing.tryAdmit({ host: "b" })).resolves.toBeDefined();

      const loaded = (await admin.script(
        "EXISTS",
        scriptSha("semaphore-acquire"),
        scriptSha("semaphore-release"),
        scriptSha("token-bucket-take"),
        scriptSha("interval-gate-take"),
      )) as number[];
      expect(loaded).toEqual([1, 1, 1, 1]);
    } finally {
      await backend.close();
    }
  });
});
