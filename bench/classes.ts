/**
 * Traffic classes: interactive calls arriving while bulk work saturates the limit, through one
 * semaphore with classes, one shared semaphore, and a static split (two semaphores). Real time:
 * each call holds its permit for a fixed service time. In one process on memory (`classes`), and
 * on Redis with the bulk producers spread over worker processes and the interactive calls made
 * by one more (`redis-classes`, bench/classes-worker.ts).
 */
import { type Backend, memory } from "floodgate";
import type { ClassesRun } from "./classes-worker.js";
import {
  type BenchArgs,
  type Benchmark,
  type Contender,
  median,
  ms,
  pct,
  percentile,
  rounds,
  si,
  sleep,
  sleepUnless,
  sorted,
  table,
  verdict,
} from "./lib.js";
import { freshPrefix } from "./redis-clients.js";
import { BenchWorker, stopWorkers } from "./worker.js";

const LIMIT = 10;
const SERVICE_MS = 20;
/** Bulk producers, each calling again as soon as its call ends: enough to keep the limit full. */
const BULK_PRODUCERS = 40;
/** One interactive call every this many milliseconds (0.8 permits busy on average). */
const INTERACTIVE_EVERY_MS = 25;

/** Admission as the set-ups offer it: the class's `admit`. */
export type Admit = (
  cls: "interactive" | "bulk",
) => Promise<{ readonly signal: AbortSignal; release(outcome?: "success"): Promise<void> }>;

/** The three set-ups, each built on a backend: one per process, or one per process on Redis. */
export const SETUPS = {
  classes: (b: Backend): Admit => {
    const sem = b.semaphore("classes", {
      limit: LIMIT,
      classes: { interactive: { share: 8, priority: 1 }, bulk: { share: 2 } },
    });
    return (cls) => sem.admit({ class: cls });
  },
  "classes, reclaim": (b: Backend): Admit => {
    const sem = b.semaphore("reclaim", {
      limit: LIMIT,
      classes: { interactive: { share: 8, priority: 1 }, bulk: { share: 2 } },
      reclaim: "signal",
    });
    return (cls) => sem.admit({ class: cls });
  },
  "one shared semaphore": (b: Backend): Admit => {
    const sem = b.semaphore("shared", { limit: LIMIT });
    return () => sem.admit();
  },
  "static split (8 + 2)": (b: Backend): Admit => {
    const interactive = b.semaphore("interactive", { limit: 8 });
    const bulk = b.semaphore("bulk", { limit: 2 });
    return (cls) => (cls === "interactive" ? interactive : bulk).admit();
  },
};
export type SetupName = keyof typeof SETUPS;

/** What runs in one place: `producers` bulk loops, or interactive arrivals every INTERACTIVE_EVERY_MS. */
export type Role = { kind: "bulk"; producers: number } | { kind: "interactive" };

/** Interactive waits (ms), and bulk calls done before the deadline. */
export interface RoleReport {
  waits: number[];
  bulkDone: number;
}

/** Run `role` through `admit` until `endAt` (on the clock `now`). */
export async function runRole(
  admit: Admit,
  role: Role,
  endAt: number,
  now: () => number,
): Promise<RoleReport> {
  let bulkDone = 0;
  const waits: number[] = [];
  if (role.kind === "bulk") {
    await Promise.all(
      Array.from({ length: role.producers }, async () => {
        while (now() < endAt) {
          const t = await admit("bulk");
          // A bulk call asked back (reclaim "signal") wraps up at once, its work not done.
          await sleepUnless(SERVICE_MS, t.signal);
          const asked = t.signal.aborted;
          await t.release("success");
          // Calls admitted before the end but finished after it do not count.
          if (now() <= endAt && !asked) bulkDone++;
        }
      }),
    );
    return { waits, bulkDone };
  }
  const calls: Promise<void>[] = [];
  while (now() < endAt) {
    const asked = now();
    calls.push(
      admit("interactive").then(async (t) => {
        waits.push(now() - asked);
        await sleep(SERVICE_MS);
        await t.release("success");
      }),
    );
    await sleep(INTERACTIVE_EVERY_MS);
  }
  await Promise.all(calls);
  return { waits, bulkDone };
}

/** One run in this process of `seconds`: bulk producers (if any) and interactive arrivals (if any). */
async function scenario(
  admit: Admit,
  seconds: number,
  bulk: boolean,
  interactive: boolean,
): Promise<RoleReport> {
  const now = () => performance.now();
  const end = now() + seconds * 1000;
  const roles: Promise<RoleReport>[] = [];
  if (bulk) roles.push(runRole(admit, { kind: "bulk", producers: BULK_PRODUCERS }, end, now));
  if (interactive) {
    // Let bulk fill the limit first.
    roles.push(
      sleep(bulk ? 3 * SERVICE_MS : 0).then(() => runRole(admit, { kind: "interactive" }, end, now)),
    );
  }
  const reports = await Promise.all(roles);
  return {
    waits: reports.flatMap((r) => r.waits),
    bulkDone: reports.reduce((sum, r) => sum + r.bulkDone, 0) / seconds,
  };
}

/** Runs one set-up with bulk and/or interactive traffic for `seconds`. */
export type Scenario<N extends string = SetupName> = (
  setup: N,
  seconds: number,
  bulk: boolean,
  interactive: boolean,
) => Promise<RoleReport>;

/** What a classes benchmark measures and how it words its table. */
export interface ClassesTable<N extends string> {
  /** The set-ups, in the table's order: the one with classes, the shared one, the static split. */
  classes: N;
  shared: N;
  split: N;
  /** More set-ups measured beside them, in the table after the one with classes. */
  more?: readonly N[];
  title: string;
  /** The unit the shared set-up stands for: "semaphore", "bucket". */
  unit: string;
  /** What an interactive call may wait more than on an idle system, ms, and its name. */
  boundMs: number;
  bound: string;
  /** A note on the shared set-up's bulk throughput (`perSecond`). */
  whole: (perSecond: number) => string;
}

/**
 * Every set-up with bulk and interactive traffic and with bulk alone, and the set-up with
 * classes with interactive alone, measured in rounds, and the table with the two targets.
 */
export async function measure<N extends string>(
  t: ClassesTable<N>,
  run: Scenario<N>,
  seconds: number,
  count: number,
): Promise<void> {
  const names = [t.classes, ...(t.more ?? []), t.shared, t.split];
  const p95 = new Map<string, number[]>(names.map((n) => [n, []]));
  const p50 = new Map<string, number[]>(names.map((n) => [n, []]));
  const contenders: Contender[] = [];
  for (const name of names) {
    contenders.push({
      name: `${name}: interactive under bulk`,
      async run() {
        const s = sorted((await run(name, seconds, true, true)).waits);
        p95.get(name)!.push(percentile(s, 95));
        p50.get(name)!.push(percentile(s, 50));
        return percentile(s, 95);
      },
    });
    contenders.push({
      name: `${name}: bulk alone`,
      async run() {
        return (await run(name, seconds, true, false)).bulkDone;
      },
    });
  }
  contenders.push({
    name: "idle: interactive alone",
    async run() {
      return percentile(sorted((await run(t.classes, seconds, false, true)).waits), 95);
    },
  });
  const figures = await rounds(contenders, count, { warmup: false });
  const idle = median(figures.get("idle: interactive alone")!);
  // The whole throughput, as measured: the shared set-up, bulk alone.
  const whole = median(figures.get(`${t.shared}: bulk alone`)!);
  const rows = names.map((name) => {
    const bulkAlone = median(figures.get(`${name}: bulk alone`)!);
    return [
      name,
      ms(median(p50.get(name)!), 1),
      ms(median(p95.get(name)!), 1),
      `${si(bulkAlone)}/s`,
      pct(bulkAlone / whole),
    ];
  });
  const classesP95 = median(p95.get(t.classes)!);
  const classesBulk = median(figures.get(`${t.classes}: bulk alone`)!) / whole;
  const splitBulk = median(figures.get(`${t.split}: bulk alone`)!) / whole;
  table(
    `${t.title} (median of ${count} rounds of ${seconds} s)`,
    ["set-up", "interactive wait p50", "interactive wait p95", "bulk alone", `of one ${t.unit}'s`],
    rows,
    [
      `Interactive alone on an idle system: wait p95 ${ms(idle, 2)}.`,
      `Target: interactive p95 under bulk within ${t.bound} (${t.boundMs} ms) of idle: ${verdict(classesP95 <= idle + t.boundMs, `${ms(classesP95, 1)} against ${ms(idle + t.boundMs, 1)}`)}.`,
      `Target: bulk alone ≥ 95% of the whole ${t.unit}'s throughput (${t.whole(whole)}): ${verdict(classesBulk >= 0.95, pct(classesBulk))}; the static split reaches ${pct(splitBulk)}.`,
    ],
  );
}

/** The table of the semaphore set-ups, `where` saying where the bulk producers run. */
function semaphoreTable(label: string, where: string): ClassesTable<SetupName> {
  const ideal = (LIMIT * 1000) / SERVICE_MS;
  return {
    classes: "classes",
    more: ["classes, reclaim"],
    shared: "one shared semaphore",
    split: "static split (8 + 2)",
    title: `${label}: limit ${LIMIT}, ${SERVICE_MS} ms a call, ${BULK_PRODUCERS} bulk producers${where}, interactive every ${INTERACTIVE_EVERY_MS} ms`,
    unit: "semaphore",
    boundMs: SERVICE_MS,
    bound: "one service time",
    whole: (w) =>
      `one semaphore of ${LIMIT}, bulk alone: ${si(w)}/s, ${pct(w / ideal)} of ${si(ideal)}/s, timers being late`,
  };
}

export const classesBench: Benchmark = {
  name: "classes",
  title: "traffic classes",
  redis: false,
  async run(args: BenchArgs) {
    const seconds = args.seconds ?? (args.quick ? 0.5 : 3);
    const count = args.rounds ?? (args.quick ? 1 : 3);
    const inProcess: Scenario = (setup, s, bulk, interactive) =>
      scenario(SETUPS[setup](memory()), s, bulk, interactive);
    await measure(semaphoreTable("Traffic classes in memory", ""), inProcess, seconds, count);
  },
};

/** Bulk worker processes of the Redis forms; one more process sends the interactive calls. */
export const BULK_PROCESSES = 4;

type Reply = ({ kind: "done" } & RoleReport) | { kind: "ready" };

/**
 * A Redis form of a classes benchmark: `BULK_PROCESSES + 1` worker processes
 * (bench/classes-worker.ts, each running a role of the `family`'s set-up), `producers` bulk
 * producers spread over all but the first as evenly as they go, interactive calls from the first
 * starting `interactiveAfterMs` after bulk. `body` measures with the scenario they run.
 */
export async function onWorkers<N extends string>(
  url: string,
  family: "semaphore" | "bucket",
  producers: number,
  interactiveAfterMs: number,
  body: (run: Scenario<N>) => Promise<void>,
): Promise<void> {
  const workers = Array.from(
    { length: BULK_PROCESSES + 1 },
    () => new BenchWorker<Reply>(new URL("./classes-worker.ts", import.meta.url), [url], "classes worker"),
  );
  try {
    for (const w of workers) await w.next(30_000);
    const nowMs = () => Number(process.hrtime.bigint()) / 1e6;
    await body(async (setup, s, bulk, interactive) => {
      const prefix = freshPrefix("classes");
      // Time for every process to build its stages.
      const startAt = nowMs() + 300;
      const endAt = startAt + s * 1000;
      const busy: BenchWorker<Reply>[] = [];
      const send = (w: BenchWorker<Reply>, role: Role, from: number) => {
        const message: ClassesRun = {
          kind: "run",
          family,
          setup: setup as ClassesRun["setup"],
          role,
          prefix,
          startAt: from,
          endAt,
        };
        w.child.send(message);
        busy.push(w);
      };
      if (bulk) {
        workers.slice(1).forEach((w, i) => {
          const each = Math.floor(producers / BULK_PROCESSES) + (i < producers % BULK_PROCESSES ? 1 : 0);
          send(w, { kind: "bulk", producers: each }, startAt);
        });
      }
      if (interactive) send(workers[0]!, { kind: "interactive" }, startAt + (bulk ? interactiveAfterMs : 0));
      const reports = (await Promise.all(busy.map((w) => w.next((s + 30) * 1000)))) as RoleReport[];
      return {
        waits: reports.flatMap((r) => r.waits),
        bulkDone: reports.reduce((sum, r) => sum + r.bulkDone, 0) / s,
      };
    });
  } finally {
    await stopWorkers(workers);
  }
}

export const redisClassesBench: Benchmark = {
  name: "redis-classes",
  title: "traffic classes on Redis, worker processes",
  redis: true,
  async run(args: BenchArgs) {
    const seconds = args.seconds ?? (args.quick ? 0.5 : 3);
    const count = args.rounds ?? (args.quick ? 1 : 3);
    const where = ` in ${BULK_PROCESSES} processes, interactive in another`;
    // Interactive starts once bulk fills the limit.
    await onWorkers<SetupName>(await args.redisUrl(), "semaphore", BULK_PRODUCERS, 3 * SERVICE_MS, (run) =>
      measure(semaphoreTable("Traffic classes on Redis", where), run, seconds, count),
    );
  },
};
