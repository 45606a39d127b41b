/**
 * Traffic classes: interactive calls arriving while bulk work saturates the limit, through one
 * semaphore with classes, one shared semaphore, and a static split (two semaphores). Real time:
 * each call holds its permit for a fixed service time.
 */
import { memory } from "floodgate";
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
  sorted,
  table,
  verdict,
} from "./lib.js";

const LIMIT = 10;
const SERVICE_MS = 20;
/** Bulk producers, each calling again as soon as its call ends: enough to keep the limit full. */
const BULK_PRODUCERS = 40;
/** One interactive call every this many milliseconds (0.8 permits busy on average). */
const INTERACTIVE_EVERY_MS = 25;

/** Admission as the three set-ups offer it: the class's `admit`. */
type Admit = (cls: "interactive" | "bulk") => Promise<{ release(outcome?: "success"): Promise<void> }>;

const SETUPS: Record<string, () => Admit> = {
  classes: () => {
    const sem = memory().semaphore("classes", {
      limit: LIMIT,
      classes: { interactive: { share: 8, priority: 1 }, bulk: { share: 2 } },
    });
    return (cls) => sem.admit({ class: cls });
  },
  "one shared semaphore": () => {
    const sem = memory().semaphore("shared", { limit: LIMIT });
    return () => sem.admit();
  },
  "static split (8 + 2)": () => {
    const b = memory();
    const interactive = b.semaphore("interactive", { limit: 8 });
    const bulk = b.semaphore("bulk", { limit: 2 });
    return (cls) => (cls === "interactive" ? interactive : bulk).admit();
  },
};

/** One run of `seconds`: bulk producers (if any) and interactive arrivals (if any). */
async function scenario(
  admit: Admit,
  seconds: number,
  bulk: boolean,
  interactive: boolean,
): Promise<{ waits: number[]; bulkDone: number }> {
  const end = performance.now() + seconds * 1000;
  let bulkDone = 0;
  const producers = bulk
    ? Array.from({ length: BULK_PRODUCERS }, async () => {
        while (performance.now() < end) {
          const t = await admit("bulk");
          await sleep(SERVICE_MS);
          await t.release("success");
          // Calls admitted before the end but finished after it do not count.
          if (performance.now() <= end) bulkDone++;
        }
      })
    : [];
  const waits: number[] = [];
  const calls: Promise<void>[] = [];
  if (interactive) {
    // Let bulk fill the limit first.
    await sleep(bulk ? 3 * SERVICE_MS : 0);
    while (performance.now() < end) {
      const asked = performance.now();
      calls.push(
        admit("interactive").then(async (t) => {
          waits.push(performance.now() - asked);
          await sleep(SERVICE_MS);
          await t.release("success");
        }),
      );
      await sleep(INTERACTIVE_EVERY_MS);
    }
  }
  await Promise.all([...producers, ...calls]);
  return { waits, bulkDone: bulkDone / seconds };
}

export const classesBench: Benchmark = {
  name: "classes",
  title: "traffic classes",
  redis: false,
  async run(args: BenchArgs) {
    const seconds = args.seconds ?? (args.quick ? 1 : 3);
    const count = args.rounds ?? (args.quick ? 1 : 3);
    const p95 = new Map<string, number[]>();
    const p50 = new Map<string, number[]>();
    const contenders: Contender[] = [];
    for (const [name, make] of Object.entries(SETUPS)) {
      p95.set(name, []);
      p50.set(name, []);
      contenders.push({
        name: `${name}: interactive under bulk`,
        async run() {
          const { waits } = await scenario(make(), seconds, true, true);
          const s = sorted(waits);
          p95.get(name)!.push(percentile(s, 95));
          p50.get(name)!.push(percentile(s, 50));
          return percentile(s, 95);
        },
      });
      contenders.push({
        name: `${name}: bulk alone`,
        async run() {
          return (await scenario(make(), seconds, true, false)).bulkDone;
        },
      });
    }
    contenders.push({
      name: "idle: interactive alone",
      async run() {
        const { waits } = await scenario(SETUPS.classes!(), seconds, false, true);
        return percentile(sorted(waits), 95);
      },
    });
    const figures = await rounds(contenders, count, { warmup: false });
    const idle = median(figures.get("idle: interactive alone")!);
    // The whole limit's throughput, as measured: one semaphore of the whole limit, bulk alone.
    const whole = median(figures.get("one shared semaphore: bulk alone")!);
    const ideal = (LIMIT * 1000) / SERVICE_MS;
    const rows = Object.keys(SETUPS).map((name) => {
      const bulkAlone = median(figures.get(`${name}: bulk alone`)!);
      return [
        name,
        ms(median(p50.get(name)!), 1),
        ms(median(p95.get(name)!), 1),
        `${si(bulkAlone)}/s`,
        pct(bulkAlone / whole),
      ];
    });
    const classesP95 = median(p95.get("classes")!);
    const classesBulk = median(figures.get("classes: bulk alone")!) / whole;
    const splitBulk = median(figures.get("static split (8 + 2): bulk alone")!) / whole;
    table(
      `Traffic classes: limit ${LIMIT}, ${SERVICE_MS} ms a call, ${BULK_PRODUCERS} bulk producers, interactive every ${INTERACTIVE_EVERY_MS} ms (median of ${count} rounds of ${seconds} s)`,
      ["set-up", "interactive wait p50", "interactive wait p95", "bulk alone", "of one semaphore's"],
      rows,
      [
        `Interactive alone on an idle system: wait p95 ${ms(idle, 2)}.`,
        `Target: interactive p95 under bulk within one service time (${SERVICE_MS} ms) of idle: ${verdict(classesP95 <= idle + SERVICE_MS, `${ms(classesP95, 1)} against ${ms(idle + SERVICE_MS, 1)}`)}.`,
        `Target: bulk alone ≥ 95% of the whole limit's throughput (one semaphore of ${LIMIT}, bulk alone: ${si(whole)}/s, ${pct(whole / ideal)} of ${si(ideal)}/s, timers being late): ${verdict(classesBulk >= 0.95, pct(classesBulk))}; the static split reaches ${pct(splitBulk)}.`,
      ],
    );
  },
};
