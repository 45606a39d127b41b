/**
 * Memory token bucket take: N takes, one awaited after another, spread over 1 key or 10k keys,
 * with buckets large enough never to refuse. floodgate's `admit` + `release` (and `tryAdmit`, and
 * `run` with a function that returns at once) against rate-limiter-flexible's
 * `RateLimiterMemory.consume` and limiter's `RateLimiter.removeTokens` (one limiter per key, in a
 * Map, as limiter has no keys of its own).
 */
import { memory } from "floodgate";
import { RateLimiter } from "limiter";
import { RateLimiterMemory } from "rate-limiter-flexible";
import {
  type BenchArgs,
  type Benchmark,
  type Contender,
  pairedRatio,
  rounds,
  si,
  spread,
  table,
  times,
  verdict,
} from "./lib.js";

const MAX = 2 ** 31 - 1;

const rate = (n: number, started: number) => n / ((performance.now() - started) / 1000);

// Each contender has a loop of its own, so no call site is shared (and made polymorphic) between
// libraries: every loop is as the library's own user would write it.
function contenders(n: number, keys: readonly string[]): Contender[] {
  const k = keys.length;
  return [
    {
      name: "floodgate tokenBucket admit + release",
      async run() {
        const bucket = memory().tokenBucket("rate", { keyed: true, capacity: MAX, refillPerSecond: 1e9 });
        const started = performance.now();
        for (let i = 0; i < n; i++) {
          const ticket = await bucket.admit({ key: keys[i % k]! });
          await ticket.release("success");
        }
        return rate(n, started);
      },
    },
    {
      name: "floodgate tokenBucket.run",
      async run() {
        const bucket = memory().tokenBucket("rate", { keyed: true, capacity: MAX, refillPerSecond: 1e9 });
        const call = () => 1;
        const started = performance.now();
        for (let i = 0; i < n; i++) await bucket.run(call, { key: keys[i % k]! });
        return rate(n, started);
      },
    },
    {
      name: "floodgate tokenBucket tryAdmit",
      async run() {
        const bucket = memory().tokenBucket("rate", { keyed: true, capacity: MAX, refillPerSecond: 1e9 });
        const started = performance.now();
        for (let i = 0; i < n; i++) await bucket.tryAdmit({ key: keys[i % k]! });
        return rate(n, started);
      },
    },
    {
      name: "rate-limiter-flexible RateLimiterMemory.consume",
      async run() {
        const limiter = new RateLimiterMemory({ points: MAX, duration: 1 });
        const started = performance.now();
        for (let i = 0; i < n; i++) await limiter.consume(keys[i % k]!, 1);
        return rate(n, started);
      },
    },
    {
      name: "limiter RateLimiter.removeTokens",
      async run() {
        const limiters = new Map<string, RateLimiter>();
        const started = performance.now();
        for (let i = 0; i < n; i++) {
          const key = keys[i % k]!;
          let l = limiters.get(key);
          if (!l) {
            l = new RateLimiter({ tokensPerInterval: 1e9, interval: "second" });
            limiters.set(key, l);
          }
          await l.removeTokens(1);
        }
        return rate(n, started);
      },
    },
  ];
}

export const memoryTokenBucket: Benchmark = {
  name: "bucket",
  title: "memory token bucket take, 1 key and 10k keys",
  redis: false,
  async run(args: BenchArgs) {
    const n = args.tasks ?? (args.quick ? 20_000 : 200_000);
    const count = args.rounds ?? (args.quick ? 1 : 5);
    for (const k of [1, 10_000]) {
      const keys = Array.from({ length: k }, (_, i) => `key-${i}`);
      const list = contenders(n, keys);
      const figures = await rounds(list, count);
      const rlf = figures.get("rate-limiter-flexible RateLimiterMemory.consume")!;
      const rows = list.map((c) => {
        const f = figures.get(c.name)!;
        const [med, range] = spread(f, si);
        return [c.name, `${med}/s`, range, times(pairedRatio(f, rlf))];
      });
      const admit = pairedRatio(figures.get("floodgate tokenBucket admit + release")!, rlf);
      const tryAdmit = pairedRatio(figures.get("floodgate tokenBucket tryAdmit")!, rlf);
      const run = pairedRatio(figures.get("floodgate tokenBucket.run")!, rlf);
      table(
        `Memory token bucket take, ${si(n)} takes over ${si(k)} key${k === 1 ? "" : "s"} (median of ${count} rounds)`,
        ["contender", "takes/s (median)", "min – max", "vs rate-limiter-flexible"],
        rows,
        [
          `Target ≥ 1.5× rate-limiter-flexible: admit + release ${verdict(admit >= 1.5, times(admit))}; ` +
            `tryAdmit ${verdict(tryAdmit >= 1.5, times(tryAdmit))}; ` +
            `run (with a function that returns at once) ${verdict(run >= 1.5, times(run))}.`,
        ],
      );
    }
  },
};
