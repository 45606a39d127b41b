/**
 * Where a fused gate's admission spends its time inside Redis: one admission captured from a
 * four-stage gate (a lone call, and a turn of a crowd's calls), replayed alone with the `gate`
 * script cut short at successive points of its first pass, lua/gate-first.lua, which decides both
 * (an `error` put in there, so the script stops and Redis still times it; less what stopping that
 * way costs). Each point's time less the one before is what that part costs. Figures from
 * SLOWLOG, which times each command inside Redis; the leases a replay took are taken out before
 * the next, so every replay decides as the first did.
 */
import { Gate } from "floodgate";
import { redis, scriptSource } from "floodgate/redis";
import type { Redis } from "ioredis";
import { type BenchArgs, type Benchmark, median, table } from "./lib.js";
import { connect, freshPrefix } from "./redis-clients.js";
import { GATES } from "./redis-throughput.js";

/** The four stages #14 counts, none binding, as the redis-gate benchmark builds them. */
const fourStages = GATES["4: + AIMD"]!;

/** One `gate` script call as sent: its keys and arguments. */
interface Captured {
  keys: string[];
  args: string[];
  /** How many calls it decides (ARGV[5]). */
  calls: number;
}

/**
 * The admission (`op` "all") with the most calls that a four-stage gate sends while `callers`
 * callers run `gate.run` for `ms`: caught on its way out of the client.
 */
async function capture(url: string, callers: number, ms: number): Promise<Captured> {
  const client = await connect(url);
  let best: Captured | undefined;
  const send = client.sendCommand.bind(client);
  client.sendCommand = ((command: { name: string; args: unknown[] }, ...rest: unknown[]) => {
    if (command.name === "evalsha") {
      const numkeys = Number(command.args[1]);
      const args = command.args.slice(2 + numkeys).map(String);
      const calls = Number(args[4]);
      if (args[1] === "all" && (best === undefined || calls > best.calls)) {
        best = { keys: command.args.slice(2, 2 + numkeys).map(String), args, calls };
      }
    }
    return (send as (...a: unknown[]) => unknown)(command, ...rest);
  }) as typeof client.sendCommand;
  const backend = redis(client, { prefix: freshPrefix("cuts") });
  const gate = new Gate(fourStages(backend));
  const until = performance.now() + ms;
  const loop = async () => {
    do await gate.run(() => undefined, { host: "api.example" });
    while (performance.now() < until);
  };
  await Promise.all(Array.from({ length: callers }, loop));
  await gate.close();
  await backend.close();
  client.disconnect();
  if (best === undefined) throw new Error("gate-cuts: no admission of the gate was seen");
  return best;
}

/** Points to stop at: a label, and the text of the script the stop goes in front of. */
type Cuts = readonly (readonly [string, string])[];

/** A lone call: lua/gate-first.lua decides it. */
const LONE: Cuts = [
  ["the script called, nothing done", "do\n  local op = ARGV[2]"],
  ["+ the call's JSON decoded", "    local n = decoded and type(f)"],
  ["+ its steps checked", "      local clear = n and redis.call('EXISTS', unpack(probe)) == 0"],
  [
    "+ the lines looked at (EXISTS)",
    "          now = now or floodgate_now(ARGV[1])\n          -- Each step's state",
  ],
  ["+ TIME", "          -- Each step's state, read once"],
  ["+ each stage's state read", "          -- Each call in turn, on what the ones before it took"],
  ["+ the call looked at", "          -- A turn's leases all new"],
];

/** A turn of alike calls: lua/gate-first.lua decides them too, the same way. */
const TURN: Cuts = [
  LONE[0]!,
  ["+ the first call's JSON decoded, its steps checked", "      -- The turn's other calls: each a repeat"],
  ["+ the other calls' JSON decoded", LONE[2]![1]],
  ...LONE.slice(3, 6),
  ["+ each call looked at in turn", LONE[6]![1]],
  ["+ the leases checked new (ZMSCORE)", "          if n then\n            -- All admitted"],
];

/** `source` stopped just before `at` (an error, so that Redis still times the call). */
function cutAt(source: string, at: string): string {
  const i = source.indexOf(at);
  if (i < 0)
    throw new Error(`gate-cuts: ${JSON.stringify(at.trim().slice(0, 60))} is no longer in the gate script`);
  return `${source.slice(0, i)}if true then error('cut') end\n${source.slice(i)}`;
}

/**
 * Median µs inside Redis of each of `scripts` run `n` times with `captured`'s keys and arguments,
 * the permit stages' leases taken out before each run; the scripts take turns in blocks of 50, so
 * that the machine's drift falls on all of them alike.
 */
async function timed(c: Redis, scripts: readonly string[], captured: Captured, n: number): Promise<number[]> {
  const shas: string[] = [];
  for (const script of scripts) shas.push((await c.script("LOAD", script)) as string);
  const holders = captured.keys.filter((k) => k.endsWith(":holders"));
  const times = shas.map((): number[] => []);
  for (let done = 0; done < n; done += 50) {
    for (const [s, sha] of shas.entries()) {
      // (The commands a script runs are logged too: the log is read and emptied after each block.)
      await c.slowlog("RESET");
      await c.config("SET", "slowlog-log-slower-than", "0");
      for (let i = 0; i < Math.min(50, n - done); i++) {
        if (holders.length > 0) await c.del(...holders);
        await c.evalsha(sha, captured.keys.length, ...captured.keys, ...captured.args).catch(() => undefined);
      }
      await c.config("SET", "slowlog-log-slower-than", "-1");
      for (const e of (await c.slowlog("GET", -1)) as [number, number, number, string[]][]) {
        if (e[3][0]?.toLowerCase() === "evalsha" && e[3][1] === sha) times[s]!.push(e[2]);
      }
    }
  }
  return times.map((t) => median(t));
}

/**
 * One table row per cut, and the whole script: µs a script call, and a call. A cut's time is
 * less what stopping with an error costs (a script stopped at once that way, against one that
 * returns at once).
 */
async function rows(c: Redis, cuts: Cuts, captured: Captured, n: number): Promise<string[][]> {
  const source = scriptSource("gate");
  const [errorAtOnce, returnAtOnce, whole, ...cut] = await timed(
    c,
    [
      `if true then error('cut') end\n${source}`,
      `do return 1 end\n${source}`,
      source,
      ...cuts.map(([, at]) => cutAt(source, at)),
    ],
    captured,
    n,
  );
  const stopping = errorAtOnce! - returnAtOnce!;
  const times = [...cut.map((us) => us - stopping), whole!];
  return [...cuts.map(([label]) => label), "the whole admission"].map((label, i) => [
    label,
    times[i]!.toFixed(0),
    i === 0 ? "" : (times[i]! - times[i - 1]!).toFixed(0),
    (times[i]! / captured.calls).toFixed(1),
  ]);
}

export const gateCuts: Benchmark = {
  name: "gate-cuts",
  title: "a fused gate's admission inside Redis, cut short part by part (a lone call, a crowd's turn)",
  redis: true,
  async run(args: BenchArgs) {
    const url = await args.redisUrl();
    const c = await connect(url);
    const [threshold, length] = [
      (await c.config("GET", "slowlog-log-slower-than")) as string[],
      (await c.config("GET", "slowlog-max-len")) as string[],
    ];
    await c.config("SET", "slowlog-max-len", "10000");
    try {
      const n = args.quick ? 100 : 1000;
      for (const [callers, cuts, what] of [
        [1, LONE, "a lone call (lua/gate-first.lua)"],
        [64, TURN, "a turn of 64 callers' calls (lua/gate-first.lua)"],
      ] as const) {
        const captured = await capture(url, callers, args.quick ? 200 : 1000);
        table(
          `A four-stage gate's admission inside Redis, ${what}: ${captured.calls} call${captured.calls === 1 ? "" : "s"}, median of ${n} replays`,
          ["stopped after", "µs a script call", "µs of this part", "µs a call"],
          await rows(c, cuts, captured, n),
          [
            "Each row is the script stopped at that point (an error put in there, less what stopping that way costs), replayed alone with the same keys and arguments; the permit stages' leases are taken out between replays.",
          ],
        );
      }
    } finally {
      await c.config("SET", "slowlog-log-slower-than", threshold[1] ?? "10000");
      await c.config("SET", "slowlog-max-len", length[1] ?? "128");
      c.disconnect();
    }
  },
};
