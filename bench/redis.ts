/**
 * The Redis figures alone, short: throughput of the semaphore and the token bucket against their
 * peers and floors, round trips per admission, and the handoff between processes. The same
 * benchmarks as `bench/index.ts redis-semaphore redis-bucket redis-commands handoff --quick`.
 *
 *   npx tsx bench/redis.ts [--seconds 0.5] [--rounds 20]
 *
 * `--seconds`: seconds per throughput figure; `--rounds`: handoffs per round.
 */
import { parseArgs } from "node:util";
import { runSuite } from "./suite.js";

const { values } = parseArgs({
  options: {
    seconds: { type: "string", default: "0.5" },
    rounds: { type: "string", default: "20" },
  },
});
await runSuite([
  "redis-semaphore",
  "redis-bucket",
  "redis-commands",
  "handoff",
  "--quick",
  "--seconds",
  values.seconds,
  "--handoffs",
  values.rounds,
]);
