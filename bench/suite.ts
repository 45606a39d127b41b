/** The suite: the benchmarks, the flags, and the run of a selection. */
import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { cpus, loadavg, totalmem } from "node:os";
import { parseArgs } from "node:util";
import { fleet } from "./fleet.js";
import { handoff } from "./handoff.js";
import { idleKeys } from "./idle-keys.js";
import type { BenchArgs, Benchmark } from "./lib.js";
import { memoryGate } from "./memory-gate.js";
import { memorySemaphore } from "./memory-semaphore.js";
import { memoryTokenBucket } from "./memory-token-bucket.js";
import { redisCommands } from "./redis-commands.js";
import { benchRedis } from "./redis-server.js";
import { redisSemaphore, redisTokenBucket } from "./redis-throughput.js";
import { versions } from "./versions.js";
import { waiters } from "./waiters.js";

export const BENCHMARKS: readonly Benchmark[] = [
  memorySemaphore,
  memoryGate,
  waiters,
  memoryTokenBucket,
  idleKeys,
  redisSemaphore,
  redisTokenBucket,
  redisCommands,
  handoff,
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

/** Run the benchmarks `argv` names (all when none) with its flags. */
export async function runSuite(argv: string[]): Promise<void> {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      quick: { type: "boolean", default: false },
      rounds: { type: "string" },
      tasks: { type: "string" },
      seconds: { type: "string" },
      handoffs: { type: "string" },
      keys: { type: "string" },
      list: { type: "boolean", default: false },
    },
  });
  if (values.list) {
    for (const b of BENCHMARKS) console.log(`${b.name.padEnd(16)} ${b.title}`);
    return;
  }
  const num = (v: string | undefined, name: string, min: number) => {
    if (v === undefined) return undefined;
    const n = Number(v);
    if (!(n >= min) || !Number.isFinite(n)) throw new RangeError(`--${name} must be a number >= ${min}`);
    return n;
  };
  const groups: Record<string, (b: Benchmark) => boolean> = {
    memory: (b) => !b.redis,
    redis: (b) => b.redis,
  };
  const selected =
    positionals.length === 0
      ? BENCHMARKS
      : BENCHMARKS.filter((b) => positionals.some((p) => p === b.name || groups[p]?.(b)));
  const unknown = positionals.filter((p) => !groups[p] && !BENCHMARKS.some((b) => b.name === p));
  if (unknown.length > 0 || selected.length === 0) {
    console.error(
      `unknown benchmark: ${unknown.join(", ")}; known: ${BENCHMARKS.map((b) => b.name).join(", ")}`,
    );
    process.exitCode = 2;
    return;
  }

  let server: Awaited<ReturnType<typeof benchRedis>> | undefined;
  const args: BenchArgs = {
    quick: values.quick,
    rounds: num(values.rounds, "rounds", 1),
    tasks: num(values.tasks, "tasks", 1),
    seconds: num(values.seconds, "seconds", 0.05),
    handoffs: num(values.handoffs, "handoffs", 1),
    keys: num(values.keys, "keys", 1),
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
      `code at ${commit()}` +
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
