/**
 * The benchmark suite. Every table row is measured in the same run as its peers: each round runs
 * every contender once (in rotating order), the figure is the median of the rounds, and ratios
 * are the median of the per-round ratios.
 *
 *   npm run bench                                  every benchmark, full size
 *   npx tsx bench/index.ts --quick                 every benchmark, short form (CI)
 *   npm run bench -- semaphore --quick             one benchmark
 *   npx tsx bench/index.ts semaphore --rounds 3 --tasks 20000
 *   npx tsx bench/index.ts --list                  the benchmarks' names
 *   npx tsx bench/index.ts redis --quick           a group: `memory` or `redis`
 *   npm run bench -- redis-gate --built            the built package (dist/), built first
 *
 * Flags: --quick, --rounds N, --tasks N, --seconds S, --handoffs N, --keys N, --only IDS (the
 * fleet's contenders: `fleet --only floodgate-gate,floodgate`) (--help says more).
 * Redis benchmarks start their own redis-server on a free loopback port unless REDIS_URL is set.
 *
 * `--chart FILE.svg` draws the fleet benchmark's first round (`npx tsx bench/index.ts fleet
 * --quick --chart fleet.svg`): the provider's requests in flight against the cap, the callers
 * waiting and the 429s over time, one line per contender. It is taken off the command line here, before the suite
 * reads its flags.
 */
import { spawn, spawnSync } from "node:child_process";
import { resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { parseOrExit, refusal, UsageError } from "../examples/cli.js";
import { drawFleetChart } from "./fleet.js";
import { COMMAND, runSuite } from "./suite.js";

/** `argv` without `--chart FILE` (or `--chart=FILE`), and the file. */
function takeChart(argv: readonly string[]): { argv: string[]; chart: string | undefined } {
  const rest: string[] = [];
  let chart: string | undefined;
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    if (a === "--chart" || a.startsWith("--chart=")) {
      const value = a === "--chart" ? argv[++i] : a.slice("--chart=".length);
      if (value === undefined || value === "" || value.startsWith("-")) {
        process.stderr.write(refusal(COMMAND, new UsageError("--chart needs a value")));
        process.exit(2);
      }
      chart = value;
    } else rest.push(a);
  }
  return { argv: rest, chart };
}

const { argv, chart } = takeChart(process.argv.slice(2));
// Help and a command line it cannot use end here, before a child is started.
const { values, args: names } = parseOrExit(COMMAND, argv);
if (chart !== undefined) {
  if (names.length > 0 && !names.includes("fleet") && !names.includes("redis")) {
    process.stderr.write(
      refusal(COMMAND, new UsageError("--chart draws the fleet benchmark; name it (fleet)")),
    );
    process.exit(2);
  }
  drawFleetChart(resolve(chart));
}

// Collections between contenders keep one contender's garbage out of the next one's figure. With
// --built, the package is built first and "floodgate" resolves to dist/ (the build's tsconfig maps
// no paths), here and in every process a benchmark starts.
const built = values.built === true;
const tsconfig = fileURLToPath(new URL("../tsconfig.build.json", import.meta.url));
const needsChild =
  typeof (globalThis as { gc?: unknown }).gc !== "function" ||
  (built && process.env.TSX_TSCONFIG_PATH !== tsconfig);
if (needsChild && !process.env.FLOODGATE_BENCH_CHILD) {
  if (built) {
    const build = spawnSync("npm", ["run", "build"], { stdio: "inherit", cwd: resolve(tsconfig, "..") });
    if (build.status !== 0) process.exit(build.status ?? 1);
  }
  const env = {
    ...process.env,
    FLOODGATE_BENCH_CHILD: "1",
    ...(built ? { TSX_TSCONFIG_PATH: tsconfig } : {}),
  };
  const child = spawn(
    process.execPath,
    [...process.execArgv, "--expose-gc", process.argv[1]!, ...process.argv.slice(2)],
    { stdio: "inherit", env },
  );
  const forward = (signal: NodeJS.Signals) => () => child.kill(signal);
  process.on("SIGINT", forward("SIGINT"));
  process.on("SIGTERM", forward("SIGTERM"));
  child.on("exit", (code, signal) => process.exit(code ?? (signal ? 1 : 0)));
} else {
  await runSuite(argv);
}
