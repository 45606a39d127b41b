/** The suite: the benchmarks, the flags, and the run of a selection. */
import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { cpus, loadavg, totalmem } from "node:os";
import { command, parseOrExit, refusal, UsageError } from "../examples/cli.js";
import { bucketClassesBench, redisBucketClassesBench } from "./bucket-classes.js";
import { bucketFleet } from "./bucket-fleet.js";
import { classesBench, redisClassesBench } from "./classes.js";
import { clientLibraries } from "./client-libraries.js";
import { FLEET_IDS, fleet, fleetModes } from "./fleet.js";
import { gateCuts } from "./gate-cuts.js";
import { handoff } from "./handoff.js";
import { idleKeys } from "./idle-keys.js";
import type { BenchArgs, Benchmark } from "./lib.js";
import { memoryGate } from "./memory-gate.js";
import { memorySemaphore } from "./memory-semaphore.js";
import { memoryTokenBucket } from "./memory-token-bucket.js";
import { oneCaller } from "./one-caller.js";
import { redisAway } from "./redis-away.js";
import { redisCommands } from "./redis-commands.js";
import { benchRedis } from "./redis-server.js";
import { redisGate, redisSemaphore, redisTokenBucket } from "./redis-throughput.js";
import { scriptCost } from "./script-cost.js";
import { versions } from "./versions.js";
import { waiters } from "./waiters.js";

export const BENCHMARKS: readonly Benchmark[] = [
  memorySemaphore,
  memoryGate,
  waiters,
  memoryTokenBucket,
  classesBench,
  bucketClassesBench,
  idleKeys,
  redisSemaphore,
  redisTokenBucket,
  redisGate,
  oneCaller,
  redisAway,
  scriptCost,
  gateCuts,
  redisCommands,
  handoff,
  clientLibraries,
  redisClassesBench,
  redisBucketClassesBench,
  bucketFleet,
  fleet,
];

/** The commit the code under test comes from, and whether src/ or lua/ differ from it. */
function commit(): string {
  try {
    const git = (...a: string[]) =>
      execFileSync("git", a, { cwd: new URL("..", import.meta.url).pathname, encoding: "utf8" }).trim();
    const dirty = git("status", "--porcelain", "src", "lua") !== "";
    return `${git("rev-parse", "--short", "HEAD")}${dirty ? " with uncommitted changes in src/ or lua/" : ""}`;
  } catch {
    return "unknown (not a git checkout)";
  }
}

/** The 1, 5 and 15 minute load averages: other work on the machine shows here. */
const load = () =>
  loadavg()
    .map((l) => l.toFixed(2))
    .join(" / ");

const GROUPS: Record<string, (b: Benchmark) => boolean> = {
  memory: (b) => !b.redis,
  redis: (b) => b.redis,
};

const EACH_OWN = "set by each benchmark";

/** The suite's command line. */
export const COMMAND = command({
  name: "bench",
  synopsis: "npm run bench -- [NAME…] [flags]",
  about:
    "The benchmark suite: each round runs every contender once (in rotating order); a figure is the\n" +
    "median of the rounds. Prints Markdown tables (bench/RESULTS.md is one full run).",
  args: {
    name: "NAME…",
    what: "benchmark",
    help: "benchmarks to run, or a group (memory, redis); default: all (--list names them)",
    choices: [...Object.keys(GROUPS), ...BENCHMARKS.map((b) => b.name)],
  },
  flags: {
    quick: { type: "boolean", help: "the short form: fewer tasks, shorter runs" },
    rounds: { type: "int", defaultText: EACH_OWN, help: "rounds per benchmark" },
    tasks: { type: "int", defaultText: EACH_OWN, help: "tasks (or operations) per contender per round" },
    seconds: {
      type: "number",
      min: 0.05,
      defaultText: EACH_OWN,
      help: "seconds per contender per round, where a benchmark runs for a time",
    },
    handoffs: { type: "int", defaultText: EACH_OWN, help: "handoffs per contender per round (handoff)" },
    keys: { type: "int", defaultText: EACH_OWN, help: "keys (idle-keys)" },
    built: {
      type: "boolean",
      help: "measure the built package (dist/, what an install gets: built first) rather than the sources through tsx",
    },
    only: {
      type: "string",
      value: "IDS",
      help: `run only these contenders, comma-separated (fleet only: ${FLEET_IDS.join(", ")}; its ceiling row always runs)`,
    },
    legs: {
      type: "boolean",
      help: "fleet only: time each handoff leg by leg (release → command written → grant heard → admitted)",
    },
    list: { type: "boolean", help: "name the benchmarks and exit" },
    chart: {
      type: "string",
      value: "FILE.svg",
      help: "draw the fleet benchmark's first round to FILE.svg: in flight against the cap, waiting, 429s (fleet only)",
    },
  },
  notes: [
    "Redis benchmarks start their own redis-server on a free loopback port unless REDIS_URL is set.",
    "e.g. npm run bench -- semaphore --quick · npx tsx bench/index.ts redis --rounds 3",
  ],
});

/** Which floodgate the benchmarks run: the built package (--built) or the sources. */
function measured(): string {
  return import.meta.resolve("floodgate").includes("/dist/")
    ? "the built package (dist/)"
    : "the sources (src/, through tsx)";
}

/** Run the benchmarks `argv` names (all when none) with its flags. */
export async function runSuite(argv: string[]): Promise<void> {
  const { values, args: names } = parseOrExit(COMMAND, argv);
  if (values.list) {
    for (const b of BENCHMARKS) console.log(`${b.name.padEnd(16)} ${b.title}`);
    return;
  }
  const selected =
    names.length === 0
      ? BENCHMARKS
      : BENCHMARKS.filter((b) => names.some((p) => p === b.name || GROUPS[p]?.(b)));

  const only = values.only?.split(",").map((id) => id.trim());
  if (only !== undefined) {
    try {
      fleetModes(only);
    } catch (error) {
      process.stderr.write(refusal(COMMAND, new UsageError((error as Error).message)));
      process.exit(2);
    }
  }
  let server: Awaited<ReturnType<typeof benchRedis>> | undefined;
  const args: BenchArgs = {
    quick: values.quick,
    rounds: values.rounds,
    tasks: values.tasks,
    seconds: values.seconds,
    handoffs: values.handoffs,
    keys: values.keys,
    only,
    legs: values.legs,
    redisUrl: async () => {
      server ??= await benchRedis();
      return server.url;
    },
  };

  const started = performance.now();
  const cpu = /model name\s*:\s*(.*)/.exec(readFileSync("/proc/cpuinfo", "utf8"))?.[1] ?? cpus()[0]?.model;
  console.log(
    `# floodgate benchmarks\n\n${new Date().toISOString()} · ${cpus().length} CPUs (${cpu}) · ` +
      `${(totalmem() / 2 ** 30).toFixed(1)} GiB · Node ${process.version} · load average ${load()} · ` +
      `code at ${commit()}, ${measured()}` +
      `${values.quick ? " · --quick" : ""}\n`,
  );
  try {
    const needRedis = selected.some((b) => b.redis);
    console.log(`${await versions(needRedis ? await args.redisUrl() : undefined)}\n`);
    for (const b of selected) {
      const t0 = performance.now();
      await b.run(args);
      console.log(`_${b.name}: ${((performance.now() - t0) / 1000).toFixed(1)} s; load average ${load()}_\n`);
    }
  } finally {
    await server?.stop();
  }
  console.log(
    `Total ${((performance.now() - started) / 1000).toFixed(1)} s; load average at the end ${load()}; ` +
      `code at ${commit()}.`,
  );
}
