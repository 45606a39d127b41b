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
 *
 * Flags: --quick, --rounds N, --tasks N, --seconds S, --handoffs N, --keys N (--help says more).
 * Redis benchmarks start their own redis-server on a free loopback port unless REDIS_URL is set.
 */
import { spawn } from "node:child_process";
import { parseOrExit } from "../examples/cli.js";
import { COMMAND, runSuite } from "./suite.js";

// Help and a command line it cannot use end here, before a child is started.
parseOrExit(COMMAND);

// Collections between contenders keep one contender's garbage out of the next one's figure.
if (typeof (globalThis as { gc?: unknown }).gc !== "function" && !process.env.FLOODGATE_BENCH_CHILD) {
  const child = spawn(
    process.execPath,
    [...process.execArgv, "--expose-gc", process.argv[1]!, ...process.argv.slice(2)],
    { stdio: "inherit", env: { ...process.env, FLOODGATE_BENCH_CHILD: "1" } },
  );
  const forward = (signal: NodeJS.Signals) => () => child.kill(signal);
  process.on("SIGINT", forward("SIGINT"));
  process.on("SIGTERM", forward("SIGTERM"));
  child.on("exit", (code, signal) => process.exit(code ?? (signal ? 1 : 0)));
} else {
  await runSuite(process.argv.slice(2));
}
