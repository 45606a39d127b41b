/**
 * Memory semaphore: N trivial tasks at concurrency 1, 16 and 256 through floodgate's semaphore
 * and its peers, against plain `Promise.all` with no limit at all.
 */
import Bottleneck from "bottleneck";
import { bulkhead } from "cockatiel";
import { Gate, memory } from "floodgate";
import pLimit from "p-limit";
import PQueue from "p-queue";
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

/** The task every contender runs: resolves at once. */
const task = async (): Promise<number> => 1;

const rate = (n: number, started: number) => n / ((performance.now() - started) / 1000);

/**
 * Bottleneck yields to a timer for every job it registers (about 2.5 ms a job here whatever the
 * concurrency), so it runs a smaller count: its rate is the same, and 200k jobs would take minutes.
 */
export function bottleneckTasks(n: number, quick: boolean): number {
  return Math.min(n, quick ? 50 : 1000);
}

// Each contender starts its `n` tasks at once from a loop of its own (no call site shared, and
// made polymorphic, between libraries), then waits for all of them; the figure is tasks per second.
export function semaphoreContenders(n: number, concurrency: number, quick = false): Contender[] {
  const nb = bottleneckTasks(n, quick);
  return [
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
      name: "floodgate semaphore.run",
      async run() {
        const sem = memory().semaphore("bench", { limit: concurrency });
        const started = performance.now();
        const pending = new Array<Promise<number>>(n);
        for (let i = 0; i < n; i++) pending[i] = sem.run(task);
        await Promise.all(pending);
        return rate(n, started);
      },
    },
    {
      name: "floodgate semaphore",
      async run() {
        const sem = memory().semaphore("bench", { limit: concurrency });
        const started = performance.now();
        const pending = new Array<Promise<number>>(n);
        for (let i = 0; i < n; i++) {
          pending[i] = (async () => {
            const ticket = await sem.admit();
            try {
              return await task();
            } finally {
              ticket.release("success");
            }
          })();
        }
        await Promise.all(pending);
        return rate(n, started);
      },
    },
    {
      name: "floodgate Gate([semaphore]).run",
      async run() {
        const gate = new Gate([memory().semaphore("bench", { limit: concurrency })]);
        const started = performance.now();
        const pending = new Array<Promise<number>>(n);
        for (let i = 0; i < n; i++) pending[i] = gate.run(task);
        await Promise.all(pending);
        return rate(n, started);
      },
    },
    {
      name: "p-limit",
      async run() {
        const limit = pLimit(concurrency);
        const started = performance.now();
        const pending = new Array<Promise<number>>(n);
        for (let i = 0; i < n; i++) pending[i] = limit(task);
        await Promise.all(pending);
        return rate(n, started);
      },
    },
    {
      name: "p-queue",
      async run() {
        const queue = new PQueue({ concurrency });
        const started = performance.now();
        const pending = new Array<Promise<number>>(n);
        for (let i = 0; i < n; i++) pending[i] = queue.add(task) as Promise<number>;
        await Promise.all(pending);
        return rate(n, started);
      },
    },
    {
      name: "cockatiel bulkhead",
      async run() {
        const policy = bulkhead(concurrency, Number.POSITIVE_INFINITY);
        const started = performance.now();
        const pending = new Array<Promise<number>>(n);
        for (let i = 0; i < n; i++) pending[i] = policy.execute(task);
        await Promise.all(pending);
        return rate(n, started);
      },
    },
    {
      name: `bottleneck (${si(nb)} tasks)`,
      async run() {
        const limiter = new Bottleneck({ maxConcurrent: concurrency });
        const started = performance.now();
        const pending = new Array<Promise<number>>(nb);
        for (let i = 0; i < nb; i++) pending[i] = limiter.schedule(task);
        await Promise.all(pending);
        return rate(nb, started);
      },
    },
  ];
}

export const memorySemaphore: Benchmark = {
  name: "semaphore",
  title: "memory semaphore",
  redis: false,
  async run(args: BenchArgs) {
    const n = args.tasks ?? (args.quick ? 5_000 : 200_000);
    const count = args.rounds ?? (args.quick ? 1 : 5);
    for (const concurrency of [1, 16, 256]) {
      const contenders = semaphoreContenders(n, concurrency, args.quick);
      const figures = await rounds(contenders, count);
      const pl = figures.get("p-limit")!;
      const floor = figures.get("Promise.all (floor)")!;
      const rows = contenders.map((c) => {
        const f = figures.get(c.name)!;
        const [med, range] = spread(f, si);
        return [c.name, `${med}/s`, range, times(pairedRatio(f, pl)), times(pairedRatio(f, floor))];
      });
      const run = pairedRatio(figures.get("floodgate semaphore.run")!, pl);
      const sem = pairedRatio(figures.get("floodgate semaphore")!, pl);
      const gate = pairedRatio(figures.get("floodgate Gate([semaphore]).run")!, pl);
      table(
        `Memory semaphore, ${si(n)} trivial tasks, concurrency ${concurrency} (median of ${count} rounds)`,
        ["contender", "tasks/s (median)", "min – max", "vs p-limit", "vs floor"],
        rows,
        [
          `Target ≥ 2× p-limit: semaphore.run (the form the README recommends) ${verdict(run >= 2, `${times(run)}`)}; ` +
            `admit → run → release ${verdict(sem >= 2, `${times(sem)}`)}; ` +
            `Gate([semaphore]).run ${verdict(gate >= 2, `${times(gate)}`)}.`,
          '"floodgate semaphore" is `await sem.admit()`, the task, then `ticket.release()` in `finally`.',
          `bottleneck runs ${si(bottleneckTasks(n, args.quick))} tasks per round: it waits on a timer for every ` +
            "job it registers, so its rate does not depend on the count and the full count would take minutes.",
        ],
      );
    }
  },
};
