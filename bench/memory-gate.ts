/**
 * The full memory Gate: queue, token bucket, interval gate, semaphore and AIMD, none of them
 * binding, so the figure is the bookkeeping cost of five stages per call. Also the same gate
 * measured by `floodgate/otel`: on the global meter with no SDK registered (what the diagnostics
 * channels cost), and on an SDK MeterProvider (what the metrics cost).
 */
import { MeterProvider, MetricReader } from "@opentelemetry/sdk-metrics";
import { Gate, memory } from "floodgate";
import { instrument } from "floodgate/otel";
import pLimit from "p-limit";
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
const task = async (): Promise<number> => 1;

const rate = (n: number, started: number) => n / ((performance.now() - started) / 1000);

/** A reader the SDK collects through only when asked: nothing is exported during a round. */
class QuietReader extends MetricReader {
  protected async onShutdown(): Promise<void> {}
  protected async onForceFlush(): Promise<void> {}
}

/**
 * A gate of all five memory stages with limits no benchmark reaches (but the semaphore's, when
 * given); with `fuse: false`, taken one after another instead of decided together.
 */
export function fullGate(semaphoreLimit = MAX, fuse = true): Gate {
  const backend = memory();
  return new Gate(
    [
      backend.queue("jobs", { maxSize: MAX, whenFull: "block" }),
      backend.semaphore("inflight", { limit: semaphoreLimit }),
      backend.aimd("adaptive", { initial: MAX, min: 1, max: MAX }),
      backend.tokenBucket("rate", { capacity: MAX, refillPerSecond: 1e9 }),
      backend.intervalGate("hosts", { minIntervalMs: 0, defaultHost: "api" }),
    ],
    { fuse },
  );
}

export const memoryGate: Benchmark = {
  name: "gate",
  title: "full memory Gate, five stages, none binding",
  redis: false,
  async run(args: BenchArgs) {
    const n = args.tasks ?? (args.quick ? 5_000 : 200_000);
    const count = args.rounds ?? (args.quick ? 1 : 5);
    // A loop of its own per contender: no call site shared between libraries.
    const contenders: Contender[] = [
      {
        name: "Promise.all (floor)",
        async run() {
          const started = performance.now();
          const pending = new Array<Promise<number>>(n);
          for (let i = 0; i < n; i++) pending[i] = task();
          await Promise.all(pending);
          return rate(n, started);
        },
      },
      {
        name: "floodgate Gate, 5 stages",
        async run() {
          const gate = fullGate();
          const started = performance.now();
          const pending = new Array<Promise<number>>(n);
          for (let i = 0; i < n; i++) pending[i] = gate.run(task);
          await Promise.all(pending);
          return rate(n, started);
        },
      },
      {
        name: "floodgate Gate, 5 stages, taken in turn (fuse: false)",
        async run() {
          const gate = fullGate(MAX, false);
          const started = performance.now();
          const pending = new Array<Promise<number>>(n);
          for (let i = 0; i < n; i++) pending[i] = gate.run(task);
          await Promise.all(pending);
          return rate(n, started);
        },
      },
      {
        name: "floodgate Gate, 5 stages, instrumented, no SDK",
        async run() {
          const gate = fullGate();
          using _ = instrument(gate);
          const started = performance.now();
          const pending = new Array<Promise<number>>(n);
          for (let i = 0; i < n; i++) pending[i] = gate.run(task);
          await Promise.all(pending);
          return rate(n, started);
        },
      },
      {
        name: "floodgate Gate, 5 stages, instrumented, SDK MeterProvider",
        async run() {
          const gate = fullGate();
          const reader = new QuietReader();
          const meterProvider = new MeterProvider({ readers: [reader] });
          const metrics = instrument(gate, { meterProvider });
          const started = performance.now();
          const pending = new Array<Promise<number>>(n);
          for (let i = 0; i < n; i++) pending[i] = gate.run(task);
          await Promise.all(pending);
          const figure = rate(n, started);
          // One collection, as an exporter would make, outside the timing.
          await reader.collect();
          metrics.close();
          await meterProvider.shutdown();
          return figure;
        },
      },
      {
        name: "p-limit (concurrency ∞)",
        async run() {
          const limit = pLimit(Number.POSITIVE_INFINITY);
          const started = performance.now();
          const pending = new Array<Promise<number>>(n);
          for (let i = 0; i < n; i++) pending[i] = limit(task);
          await Promise.all(pending);
          return rate(n, started);
        },
      },
    ];
    const figures = await rounds(contenders, count);
    const pl = figures.get("p-limit (concurrency ∞)")!;
    const floor = figures.get("Promise.all (floor)")!;
    const rows = contenders.map((c) => {
      const f = figures.get(c.name)!;
      const [med, range] = spread(f, si);
      return [c.name, `${med}/s`, range, times(pairedRatio(f, pl)), times(pairedRatio(f, floor))];
    });
    const r = pairedRatio(figures.get("floodgate Gate, 5 stages")!, pl);
    table(
      `Full memory Gate (queue, semaphore, AIMD, token bucket, interval gate; none binding), ${si(n)} tasks (median of ${count} rounds)`,
      ["contender", "tasks/s (median)", "min – max", "vs p-limit", "vs floor"],
      rows,
      [`Target ≥ 1× p-limit: ${verdict(r >= 1, times(r))}.`],
    );
  },
};
