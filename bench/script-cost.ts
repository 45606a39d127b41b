/**
 * Where a script call's time goes inside Redis: what the building blocks of floodgate's Lua cost
 * on this server (a script call, one command from Lua, closures, plain Lua steps), the `gate`
 * script's fixed cost as EVALSHA and as a Redis Function (FCALL, Redis 7+), and the commands a
 * lone semaphore and a fused four-stage gate run per admission. Figures from INFO commandstats.
 */
import { readFileSync } from "node:fs";
import { Gate, type Stage } from "floodgate";
import { type RedisBackend, redis, scriptSource } from "floodgate/redis";
import type { Redis } from "ioredis";
import { type BenchArgs, type Benchmark, median, table } from "./lib.js";
import { commandStats, connect, freshPrefix } from "./redis-clients.js";

/** The commands a benchmark's own bookkeeping sends, left out of the counts. */
const OWN = new Set(["info", "config|resetstat", "config", "script|load", "function|load", "ping"]);

/** µs per call of `fn`'s one script command (`name` in commandstats), over `n` calls. */
async function usPerCall(c: Redis, name: string, n: number, fn: () => Promise<unknown>): Promise<number> {
  await c.config("RESETSTAT");
  for (let i = 0; i < n; i++) await fn();
  const s = (await commandStats(c)).get(name);
  return s ? s.usec / s.calls : Number.NaN;
}

/** Tiny scripts, each one building block on top of `return 1`. */
const BLOCKS: [string, string][] = [
  ["a script call (`return 1`)", "return 1"],
  ["+ one command from Lua (TIME)", "redis.call('TIME') return 1"],
  ["+ one command on a key (ZRANGE of an empty key)", "redis.call('ZRANGE', KEYS[1], 0, 0) return 1"],
  ["+ 8 closures made", "local x = {} for i = 1, 8 do x[i] = function() return i end end return 1"],
  ["+ 100 steps of plain Lua", "local n = 0 for i = 1, 100 do n = n + i end return 1"],
];

async function blocks(c: Redis, n: number, functions: boolean): Promise<string[][]> {
  const rows: string[][] = [];
  if (functions) {
    const lib = BLOCKS.map(
      ([, body], i) => `redis.register_function('fg_block_${i}', function(KEYS, ARGV) ${body} end)`,
    );
    await c.call("FUNCTION", "LOAD", "REPLACE", `#!lua name=floodgate_bench_blocks\n${lib.join("\n")}\n`);
  }
  const key = `${freshPrefix("blocks")}z`;
  for (const [i, [label, body]] of BLOCKS.entries()) {
    const sha = (await c.script("LOAD", body)) as string;
    const evalsha = median(await repeat(3, () => usPerCall(c, "evalsha", n, () => c.evalsha(sha, 1, key))));
    const fcall = functions
      ? median(await repeat(3, () => usPerCall(c, "fcall", n, () => c.fcall(`fg_block_${i}`, 1, key))))
      : Number.NaN;
    rows.push([label, evalsha.toFixed(1), Number.isNaN(fcall) ? "n/a" : fcall.toFixed(1)]);
  }
  return rows;
}

async function repeat(times: number, fn: () => Promise<number>): Promise<number[]> {
  const out: number[] = [];
  for (let i = 0; i < times; i++) out.push(await fn());
  return out;
}

/**
 * The `gate` script with no calls in it: its fixed cost. As EVALSHA, and as a Redis Function
 * whose library defines the prelude and the steps once, so only the gate's own body runs per call.
 */
async function gateFixed(c: Redis, n: number, functions: boolean): Promise<string[]> {
  const source = scriptSource("gate");
  const sha = (await c.script("LOAD", source)) as string;
  const args = ["", "all", "1000", "ch", "0"];
  const keys = ["a", "b", "c"].map((k) => `${freshPrefix("fixed")}${k}`);
  const evalsha = median(
    await repeat(3, () => usPerCall(c, "evalsha", n, () => c.evalsha(sha, 3, ...keys, ...args))),
  );
  let fcall = Number.NaN;
  if (functions) {
    // The definitions once, in the library; per call, the first pass (lua/gate-first.lua, which
    // reads the call's KEYS and ARGV) and the gate's own body.
    const first = readFileSync(new URL("../lua/gate-first.lua", import.meta.url), "utf8");
    const body = source.indexOf("-- gate: ");
    if (body < 0 || !source.includes(first)) {
      throw new Error("script-cost: the gate script's body or first pass was not found in its source");
    }
    const lib =
      `#!lua name=floodgate_bench_gate\n${source.slice(0, body).replace(first, "")}\n` +
      `local function gate(KEYS, ARGV)\n${first}\n${source.slice(body)}\nend\n` +
      `redis.register_function('floodgate_bench_gate', gate)\n`;
    await c.call("FUNCTION", "LOAD", "REPLACE", lib);
    fcall = median(
      await repeat(3, () =>
        usPerCall(c, "fcall", n, () => c.fcall("floodgate_bench_gate", 3, ...keys, ...args)),
      ),
    );
  }
  return [
    "the gate script, no calls in it",
    evalsha.toFixed(1),
    Number.isNaN(fcall) ? "n/a" : fcall.toFixed(1),
  ];
}

const MAX = 2 ** 31 - 1;
const GATES: [string, (b: RedisBackend) => Stage[]][] = [
  ["semaphore alone", (b) => [b.semaphore("sem", { limit: 1_000_000 })]],
  [
    "fused: bucket, interval gate, semaphore, AIMD",
    (b) => [
      b.tokenBucket("rate", { capacity: MAX, refillPerSecond: 1e9 }),
      b.intervalGate("hosts", { minIntervalMs: 0 }),
      b.semaphore("sem", { limit: 1_000_000 }),
      b.aimd("aimd", { initial: 1_000_000, min: 1, max: 1_000_000 }),
    ],
  ],
];

/**
 * Per admission (admit and release) through `gate.run`, by `callers` callers at once (`about`
 * admissions in all, rounded up to a multiple of `callers`): script calls, their time, the
 * commands inside.
 */
async function perAdmission(c: Redis, url: string, about: number, callers: number): Promise<string[][]> {
  const rows: string[][] = [];
  const each = Math.ceil(about / callers);
  const n = each * callers;
  for (const [label, stages] of GATES) {
    const client = await connect(url);
    const backend = redis(client, { prefix: freshPrefix("cost") });
    const gate = new Gate(stages(backend));
    const task = () => undefined;
    const run = async (times: number) => {
      for (let i = 0; i < times; i++) await gate.run(task, { host: "api.example" });
    };
    const all = (times: number) => Promise.all(Array.from({ length: callers }, () => run(times)));
    await all(Math.ceil(50 / callers));
    await c.config("RESETSTAT");
    await all(each);
    const stats = await commandStats(c);
    await gate.close();
    await backend.close();
    client.disconnect();
    let scripts = 0;
    let usec = 0;
    let inner = 0;
    const byCommand: [string, number][] = [];
    for (const [name, s] of stats) {
      if (OWN.has(name)) continue;
      if (name === "evalsha" || name === "eval") {
        scripts += s.calls;
        usec += s.usec;
      } else {
        inner += s.calls;
        byCommand.push([name, s.calls / n]);
      }
    }
    byCommand.sort((a, b) => b[1] - a[1]);
    rows.push([
      label,
      (scripts / n).toFixed(2),
      (usec / n).toFixed(1),
      (inner / n).toFixed(1),
      byCommand.map(([name, per]) => `${name} ${per.toFixed(1)}`).join(", "),
    ]);
  }
  return rows;
}

export const scriptCost: Benchmark = {
  name: "script-cost",
  title:
    "where a script call's time goes inside Redis: Lua building blocks, EVALSHA against FCALL, commands per admission",
  redis: true,
  async run(args: BenchArgs) {
    const url = await args.redisUrl();
    const c = await connect(url);
    try {
      const version = /redis_version:(\d+)/.exec(await c.info("server"))?.[1];
      const functions = Number(version) >= 7;
      const n = args.quick ? 300 : 3000;
      const rows = [...(await blocks(c, n, functions)), await gateFixed(c, n, functions)];
      table(
        `What a script call costs inside Redis ${version ?? "?"}.x, µs per call (median of 3 × ${n} calls, one caller)`,
        ["script", "EVALSHA µs", "FCALL µs (a Redis Function)"],
        rows,
        [
          functions
            ? "A Function's library is loaded once; its top-level definitions (the prelude, each step's body as a function) are not made again per call."
            : "Redis Functions need Redis 7; this server has none.",
        ],
      );
      for (const callers of [1, 64]) {
        const admissions = (args.quick ? 300 : 2000) * (callers === 1 ? 1 : 5);
        const per = await perAdmission(c, url, admissions, callers);
        table(
          `Per admission through gate.run (admit and release), ${callers === 1 ? "one caller" : `${callers} callers`}, ${admissions} admissions`,
          ["gate", "script calls", "script µs", "commands inside", "commands inside, per admission"],
          per,
          callers === 1
            ? [
                "Inside a script, each command costs a few µs of its own (the table above): the fused gate's time follows its count of commands.",
              ]
            : [
                "Calls made in one turn go together at the end of that turn: one script call decides a turn's admissions (or releases), each stage's script running once for them while nobody waits in the gate's lines.",
              ],
        );
      }
    } finally {
      c.disconnect();
    }
  },
};
