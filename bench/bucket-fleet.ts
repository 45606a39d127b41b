/**
 * Fairness across a fleet on one Redis token bucket: 8 worker processes share a bucket of 200
 * tokens a second (capacity 20), each caller asking for one token after another. Evenly, 4
 * callers a process; skewed, two of the processes have 16 callers each. A fair bucket serves
 * callers, not processes: Jain's index over the callers' admissions near 1, and the waits of the
 * crowded processes' callers like everyone else's. floodgate (every caller's place reserved in
 * Redis in arrival order), the same bucket in a fused gate (its callers in the gate's lane), against
 * rate-limiter-flexible's RateLimiterRedis (200 points a second;
 * a refused caller sleeps the msBeforeNext it is told and asks again), in the same run.
 */
import type { FairContender, FairReport, FairRun } from "./bucket-fleet-worker.js";
import { type BenchArgs, type Benchmark, median, ms, percentile, sorted, table, verdict } from "./lib.js";
import { freshPrefix } from "./redis-clients.js";
import { BenchWorker, stopWorkers } from "./worker.js";

const PROCESSES = 8;
const RATE = 200;
const CAPACITY = 20;
const LAYOUTS = {
  even: Array.from({ length: PROCESSES }, () => 4),
  skewed: Array.from({ length: PROCESSES }, (_, i) => (i < 2 ? 16 : 4)),
};
type Layout = keyof typeof LAYOUTS;
const CONTENDERS: FairContender[] = ["floodgate", "floodgate-gate", "rate-limiter-flexible"];
const nowMs = () => Number(process.hrtime.bigint()) / 1e6;

type Reply = FairReport | { kind: "ready" };

/** Jain's fairness index of `xs`: 1 when all are equal, 1/n when one has everything. */
export function jain(xs: readonly number[]): number {
  let sum = 0;
  let squares = 0;
  for (const x of xs) {
    sum += x;
    squares += x * x;
  }
  return squares === 0 ? 1 : (sum * sum) / (xs.length * squares);
}

interface Figures {
  jain: number;
  /** Admissions per second, all callers. */
  rate: number;
  /** Median admissions of a caller in a crowded process and in another. */
  crowdedCount: number;
  otherCount: number;
  /** Wait p99 of the crowded processes' callers and of the others', ms. */
  crowdedP99: number;
  otherP99: number;
}

async function once(
  workers: BenchWorker<Reply>[],
  contender: FairContender,
  layout: Layout,
  seconds: number,
): Promise<Figures> {
  const callers = LAYOUTS[layout];
  const prefix = freshPrefix("fair");
  const startAt = nowMs() + 300;
  const endAt = startAt + seconds * 1000;
  workers.forEach((w, i) => {
    w.child.send({
      kind: "run",
      contender,
      prefix,
      callers: callers[i]!,
      rate: RATE,
      capacity: CAPACITY,
      startAt,
      endAt,
    } satisfies FairRun);
  });
  const reports = (await Promise.all(workers.map((w) => w.next(seconds * 1000 + 30_000)))) as FairReport[];
  const crowded = (i: number) => callers[i]! > 4;
  const all = reports.flatMap((r) => r.counts);
  const pick = (want: boolean) => ({
    counts: sorted(reports.flatMap((r, i) => (crowded(i) === want ? r.counts : []))),
    waits: sorted(reports.flatMap((r, i) => (crowded(i) === want ? r.waits : []))),
  });
  const o = pick(false);
  // Evenly, nobody is crowded: the crowded figures are everyone's.
  const c = layout === "skewed" ? pick(true) : o;
  return {
    jain: jain(all),
    rate: all.reduce((a, b) => a + b, 0) / seconds,
    crowdedCount: median(c.counts),
    otherCount: median(o.counts),
    crowdedP99: percentile(c.waits, 99),
    otherP99: percentile(o.waits, 99),
  };
}

export const bucketFleet: Benchmark = {
  name: "bucket-fleet",
  title: "fairness of a Redis token bucket across a fleet",
  redis: true,
  async run(args: BenchArgs) {
    const seconds = args.seconds ?? (args.quick ? 0.5 : 5);
    const count = args.rounds ?? (args.quick ? 1 : 3);
    const url = await args.redisUrl();
    const workers = Array.from(
      { length: PROCESSES },
      () =>
        new BenchWorker<Reply>(new URL("./bucket-fleet-worker.ts", import.meta.url), [url], "fair worker"),
    );
    try {
      await Promise.all(workers.map((w) => w.next(30_000)));
      const results = new Map<string, Figures[]>();
      for (let round = 0; round < count; round++) {
        for (const layout of Object.keys(LAYOUTS) as Layout[]) {
          // Rotate who goes first, so neither always runs on a warmer machine.
          const order = round % 2 === 0 ? CONTENDERS : [...CONTENDERS].reverse();
          for (const contender of order) {
            const key = `${contender}|${layout}`;
            const list = results.get(key) ?? [];
            list.push(await once(workers, contender, layout, seconds));
            results.set(key, list);
          }
        }
      }
      const med = (key: string, f: (x: Figures) => number) => median(results.get(key)!.map(f));
      const rows: string[][] = [];
      for (const layout of Object.keys(LAYOUTS) as Layout[]) {
        for (const contender of CONTENDERS) {
          const key = `${contender}|${layout}`;
          rows.push([
            contender,
            layout === "even" ? "8 × 4 callers" : "2 × 16 + 6 × 4 callers",
            med(key, (x) => x.jain).toFixed(3),
            `${med(key, (x) => x.rate).toFixed(0)}/s`,
            layout === "skewed"
              ? `${med(key, (x) => x.crowdedCount).toFixed(0)} / ${med(key, (x) => x.otherCount).toFixed(0)}`
              : `${med(key, (x) => x.otherCount).toFixed(0)}`,
            layout === "skewed"
              ? `${ms(
                  med(key, (x) => x.crowdedP99),
                  0,
                )} / ${ms(
                  med(key, (x) => x.otherP99),
                  0,
                )}`
              : ms(
                  med(key, (x) => x.otherP99),
                  0,
                ),
          ]);
        }
      }
      const target = (contender: string) => {
        const key = `${contender}|skewed`;
        const j = med(key, (x) => x.jain);
        const p99Ratio = med(key, (x) => x.crowdedP99 / x.otherP99);
        return `${contender}: Jain ≥ 0.95 per caller ${verdict(j >= 0.95, j.toFixed(3))}; wait p99 of the crowded processes within 1.5× of the others' ${verdict(p99Ratio <= 1.5, `${p99Ratio.toFixed(2)}×`)}`;
      };
      table(
        `Fairness across a fleet, one Redis token bucket (${RATE}/s, capacity ${CAPACITY}), ${PROCESSES} processes, ${seconds} s, median of ${count} round(s)`,
        [
          "contender",
          "callers",
          "Jain (per caller)",
          "admitted",
          "admissions per caller (crowded / other)",
          "wait p99 (crowded / other)",
        ],
        rows,
        [
          `Targets, skewed: ${target("floodgate")}; ${target("floodgate-gate")}.`,
          "floodgate-gate is the same bucket in a fused gate with a semaphore that never binds: its callers wait in the gate's lane.",
          "rate-limiter-flexible counts 200 points in fixed one-second windows; a refused caller sleeps msBeforeNext and asks again.",
        ],
      );
    } finally {
      await stopWorkers(workers);
    }
  },
};
