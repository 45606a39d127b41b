/**
 * The fleet: 12 worker processes × 2 callers share a cap of 8 on a local provider (127.0.0.1)
 * that holds each request for the service time and answers 429 above 8 in flight. Service time
 * 50 ms and 5 ms, each without and with client-side think time equal to the service time after
 * every job. Contenders: floodgate's Redis semaphore, the llm scenario's five-stage gate (fused,
 * and its stages taken one after another), redis-semaphore (default 10 ms poll), a
 * lease semaphore polling every 200 ms, a handoff floor (a Redis list of 8 tokens taken with BLPOP:
 * the fastest way for a process to learn of another's release through Redis, with none of a
 * limiter's safety), and no gate; the ceiling is exactly 8 ungated callers.
 * Admission waits are compared with those of a perfect FIFO queue fed the same service and think
 * times (a simulation of 24 callers on 8 permits with zero handoff cost). The handoff is the time
 * from a release to the grant it lets in: with every permit busy, the k-th release of the run
 * (in any process) lets in its (k + 8)-th grant, on the monotonic clock all processes share.
 *
 * With `--chart FILE.svg` (see `drawFleetChart`) it draws the first round of the first variant,
 * one line per contender: the provider's requests in flight against the cap and its 429s over
 * time, and the callers waiting for admission, which the workers count every 20 ms in that round.
 */

import { writeFile } from "node:fs/promises";
import { type ChartPoint, ChartRecorder, renderChart } from "../examples/chart.js";
import { startProvider } from "../examples/provider.js";
import type { Mode, RunMessage, RunReport } from "./fleet-worker.js";
import {
  type BenchArgs,
  type Benchmark,
  type Contender,
  mean,
  median,
  ms,
  pairedRatio,
  pct,
  percentile,
  rounds,
  sorted,
  spread,
  table,
  times,
  verdict,
} from "./lib.js";
import { freshPrefix } from "./redis-clients.js";
import { BenchWorker, stopWorkers } from "./worker.js";

const WORKERS = 12;
const PER_WORKER = 2;
const CAP = 8;
const nowMs = () => Number(process.hrtime.bigint()) / 1e6;
/** Milliseconds between a chart's samples (`--chart`): the runs last 0.5 to 3 s. */
const CHART_MS = 20;

type Reply = RunReport | { kind: "ready" };

let chartFile: string | undefined;

/** Draw the fleet's runs to `file` (an SVG) on its next run: `bench/index.ts fleet --chart FILE.svg`. */
export function drawFleetChart(file: string): void {
  chartFile = file;
}

const newWorker = (redisUrl: string) =>
  new BenchWorker<Reply>(new URL("./fleet-worker.ts", import.meta.url), [redisUrl], "fleet worker");

/** Deterministic pseudo-random numbers for the simulation. */
function lcg(seed: number) {
  let s = seed >>> 0;
  return () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
}

/**
 * Waits (sorted, ms) of a perfect FIFO queue: `callers` callers in a closed loop on `cap` permits,
 * handoff at no cost, service and think times drawn from the measured samples, for `durationMs`.
 */
export function perfectFifo(
  callers: number,
  cap: number,
  durationMs: number,
  services: readonly number[],
  thinks: readonly number[],
  thinkMs: number,
): number[] {
  if (services.length === 0) return [];
  const rnd = lcg(7);
  const service = () => services[Math.floor(rnd() * services.length)]!;
  const think = () =>
    thinkMs === 0 ? 0 : thinks.length > 0 ? thinks[Math.floor(rnd() * thinks.length)]! : thinkMs;
  const queue: number[] = []; // arrival times, FIFO
  let qHead = 0;
  const busyEnds: number[] = []; // completion times of jobs in service
  const arrivals: number[] = []; // future arrival times (callers thinking)
  for (let i = 0; i < callers; i++) queue.push(0);
  const waits: number[] = [];
  let t = 0;
  while (t <= durationMs) {
    while (busyEnds.length < cap && qHead < queue.length) {
      waits.push(t - queue[qHead++]!);
      busyEnds.push(t + service());
    }
    // Next event: a completion or an arrival.
    let next = Number.POSITIVE_INFINITY;
    let which = -1;
    let isArrival = false;
    for (let i = 0; i < busyEnds.length; i++) {
      if (busyEnds[i]! < next) {
        next = busyEnds[i]!;
        which = i;
        isArrival = false;
      }
    }
    for (let i = 0; i < arrivals.length; i++) {
      if (arrivals[i]! < next) {
        next = arrivals[i]!;
        which = i;
        isArrival = true;
      }
    }
    if (which < 0 || next > durationMs) break;
    t = next;
    if (isArrival) {
      arrivals.splice(which, 1);
      queue.push(t);
    } else {
      busyEnds.splice(which, 1);
      const th = think();
      if (th === 0) queue.push(t);
      else arrivals.push(t + th);
    }
  }
  // Callers still in line at the end waited at least this long, as in the measured runs.
  for (let i = qHead; i < queue.length; i++) waits.push(durationMs - queue[i]!);
  return sorted(waits);
}

/**
 * Release-to-grant times (ms, sorted) of a run on `cap` permits: the k-th release (in time, in
 * any process) against the (k + cap)-th grant. While every permit is busy and callers wait, each
 * grant after the first `cap` is let in by the release before it in that order; a permit idle
 * with nobody waiting counts its idle time too, so the median is the figure to read.
 */
export function handoffs(grants: readonly number[], releases: readonly number[], cap: number): number[] {
  const g = sorted(grants);
  const r = sorted(releases);
  const out: number[] = [];
  for (let k = 0; k + cap < g.length && k < r.length; k++) {
    const gap = g[k + cap]! - r[k]!;
    if (gap >= 0) out.push(gap);
  }
  return sorted(out);
}

/** A run's handoffs leg by leg (`--legs`), ms, each list sorted: see `handoffLegs`. */
export interface HandoffLegs {
  /** From a release (as called) to the next command its process wrote to Redis. */
  written: number[];
  /** From that command to the grant heard in the waiter's process (a message, or its BLPOP's reply). */
  heard: number[];
  /** From that to the waiter's admission returning to its caller. */
  admitted: number[];
}

/**
 * The legs of the handoffs `handoffs` pairs (the k-th release against the (k + cap)-th grant),
 * from the reports' `written` and `heard` (`--legs`). A leg is left out of a pair where a time it
 * needs is missing, or where the grant was heard before the release's command went out (heard
 * for another's wait, or a wake-up rather than the grant).
 */
export function handoffLegs(reports: readonly RunReport[], cap: number): HandoffLegs {
  const pairs = (at: readonly number[], aux: readonly (number | null)[] | undefined) =>
    at.map((t, i) => [t, aux?.[i] ?? null] as const);
  const g = reports.flatMap((r) => pairs(r.grants, r.heard)).sort((a, b) => a[0] - b[0]);
  const rel = reports.flatMap((r) => pairs(r.releases, r.written)).sort((a, b) => a[0] - b[0]);
  const legs: HandoffLegs = { written: [], heard: [], admitted: [] };
  for (let k = 0; k + cap < g.length && k < rel.length; k++) {
    const [granted, heard] = g[k + cap]!;
    const [released, written] = rel[k]!;
    if (granted < released) continue;
    if (written !== null) legs.written.push(written - released);
    if (heard !== null && written !== null && heard >= written) legs.heard.push(heard - written);
    if (heard !== null && heard >= released) legs.admitted.push(granted - heard);
  }
  return { written: sorted(legs.written), heard: sorted(legs.heard), admitted: sorted(legs.admitted) };
}

/** The median of each of a run's handoff legs, ms. */
type LegMedians = Record<keyof HandoffLegs, number>;

/** The median of each of a run's handoff legs (NaN for a leg with none). */
function legMedians(legs: HandoffLegs): LegMedians {
  const p50 = (l: number[]) => (l.length === 0 ? Number.NaN : percentile(l, 50));
  return { written: p50(legs.written), heard: p50(legs.heard), admitted: p50(legs.admitted) };
}

/** Whether callers of `mode` wait for an admission (the ceiling and no gate do not). */
function gated(mode: Mode): boolean {
  return mode !== "none" && mode !== "ceiling";
}

interface Variant {
  serviceMs: number;
  thinkMs: number;
}

interface RunStats {
  throughput: number;
  peak: number;
  r429: number;
  /**
   * Requests the provider got beyond those the fleet's callers sent (another process on its
   * port): its peak and 429s count them, so a breach with these above zero is not the gate's alone.
   */
  outside: number;
  errors: number;
  waitP99: number;
  fifoP99: number;
  /** Release to the grant it lets in (see `handoffs`), ms: median and mean. */
  handoffP50: number;
  handoffMean: number;
  /** With `--legs`: the medians of the handoffs' legs (see `HandoffLegs`), ms. */
  legs?: LegMedians;
  jobs: number;
  cutOff: number;
  /** Callers that got no job done in the run, and the fewest jobs any caller got. */
  starved: number;
  fewest: number;
}

const MODES: { mode: Mode; name: string }[] = [
  { mode: "ceiling", name: "ceiling: 8 ungated callers, no think" },
  { mode: "floodgate", name: "floodgate redis semaphore" },
  { mode: "floodgate-gate", name: "floodgate fused gate (llm: 2 buckets, semaphore, AIMD, interval)" },
  { mode: "floodgate-chained", name: "floodgate gate, the same stages taken in turn (not fused)" },
  { mode: "redis-semaphore", name: "redis-semaphore (10 ms poll)" },
  { mode: "poll200", name: "200 ms-polling lease semaphore" },
  { mode: "blpop", name: "handoff floor: BLPOP token list (no lease)" },
  { mode: "none", name: "no gate (24 callers)" },
];

/** The ids `--only` takes: the fleet's contenders but its ceiling, which always runs. */
export const FLEET_IDS: readonly string[] = MODES.filter((m) => m.mode !== "ceiling").map((m) => m.mode);

/**
 * The contenders `only` names (by mode), after the ceiling, in the table's order; all of them
 * when `only` is undefined. Throws naming an id that is no contender's.
 */
export function fleetModes(only: readonly string[] | undefined): { mode: Mode; name: string }[] {
  if (only === undefined) return MODES;
  const ids = MODES.map((m) => m.mode as string);
  const unknown = only.find((id) => !ids.includes(id));
  if (unknown !== undefined) {
    throw new Error(`fleet: --only names "${unknown}", which is no contender; they are ${ids.join(", ")}`);
  }
  return MODES.filter((m) => m.mode === "ceiling" || only.includes(m.mode));
}

export const fleet: Benchmark = {
  name: "fleet",
  title: "fleet: 12 processes × 2 callers, cap 8, local provider",
  redis: true,
  async run(args: BenchArgs) {
    const modes = fleetModes(args.only);
    const url = await args.redisUrl();
    const count = args.rounds ?? (args.quick ? 1 : 5);
    const seconds = args.seconds ?? (args.quick ? 0.5 : 3);
    const warmup = args.quick ? 0.2 : 0.5;
    const variants: Variant[] = args.quick
      ? [{ serviceMs: 50, thinkMs: 0 }]
      : [
          { serviceMs: 50, thinkMs: 0 },
          { serviceMs: 50, thinkMs: 50 },
          { serviceMs: 5, thinkMs: 0 },
          { serviceMs: 5, thinkMs: 5 },
        ];
    const workers = Array.from({ length: WORKERS }, () => newWorker(url));
    try {
      const forked = performance.now();
      for (const w of workers) await w.next(60_000); // ready
      console.error(
        `(fleet: ${WORKERS} workers ready in ${((performance.now() - forked) / 1000).toFixed(1)} s)`,
      );
      for (const v of variants) {
        const provider = await startProvider({ cap: CAP, serviceMs: v.serviceMs });
        const stats = new Map<string, RunStats[]>();
        // The chart: the first variant's first measured round of each contender, on one time axis.
        const charted = chartFile !== undefined && v === variants[0];
        const chartPoints: ChartPoint[] = [];
        const chartTotals: string[] = [];
        try {
          const runOnce = async (mode: Mode, name: string, round: number): Promise<number> => {
            const durationMs = (round < 0 ? Math.min(seconds, warmup) : seconds) * 1000;
            const prefix = freshPrefix(`fleet-${mode}`);
            const startAt = nowMs() + 150;
            provider.reset();
            workers.forEach((w, i) => {
              const callers = mode === "ceiling" ? (i < CAP ? 1 : 0) : PER_WORKER;
              const m: RunMessage = {
                kind: "run",
                mode,
                providerUrl: provider.url,
                prefix,
                startAt,
                durationMs,
                // The ceiling keeps the provider at exactly 8 in flight: no think time.
                thinkMs: mode === "ceiling" ? 0 : v.thinkMs,
                callers,
                cap: CAP,
                ...(charted && round === 0 ? { sampleMs: CHART_MS } : {}),
                ...(args.legs ? { legs: true } : {}),
              };
              w.child.send(m);
            });
            const chart =
              charted && round === 0
                ? new ChartRecorder({ title: mode, cap: CAP, intervalMs: CHART_MS }).watchProvider(
                    provider,
                    mode,
                  )
                : undefined;
            const chartAt = chart && setTimeout(() => chart.start(), Math.max(0, startAt - nowMs()));
            const reports = (await Promise.all(
              workers.map((w) => w.next(durationMs + 120_000)),
            )) as RunReport[];
            if (chart) {
              clearTimeout(chartAt);
              chart.stop();
              chartPoints.push(...chart.points);
              // The callers waiting for admission, summed over the workers' samples.
              const waiting: number[] = [];
              for (const r of reports) {
                for (const [i, n] of (r.waiting ?? []).entries()) waiting[i] = (waiting[i] ?? 0) + (n ?? 0);
              }
              waiting.forEach((n, i) => {
                chartPoints.push({
                  t: (i * CHART_MS) / 1000,
                  panel: "waiting",
                  series: mode,
                  measure: "waiting",
                  value: n,
                });
              });
              const p = provider.stats();
              chartTotals.push(`${mode} peak ${p.peak}, 429s ${p.rejected429}`);
            }
            const p = provider.stats();
            const ok = reports.reduce((n, r) => n + r.ok, 0);
            const waits = sorted(reports.flatMap((r) => r.waits));
            const services = reports.flatMap((r) => r.services);
            const thinks = reports.flatMap((r) => r.thinks);
            const callers = mode === "ceiling" ? CAP : WORKERS * PER_WORKER;
            const fifo = perfectFifo(callers, CAP, durationMs, services, thinks, v.thinkMs);
            const gaps = handoffs(
              reports.flatMap((r) => r.grants),
              reports.flatMap((r) => r.releases),
              CAP,
            );
            const s: RunStats = {
              throughput: ok / (durationMs / 1000),
              peak: p.peak,
              r429: p.rejected429,
              outside: p.requests - reports.reduce((n, r) => n + r.sent, 0),
              errors: reports.reduce((n, r) => n + r.errors, 0),
              waitP99: gated(mode) ? percentile(waits, 99) : Number.NaN,
              fifoP99: gated(mode) ? percentile(fifo, 99) : Number.NaN,
              handoffP50: gaps.length === 0 ? Number.NaN : percentile(gaps, 50),
              handoffMean: mean(gaps),
              ...(args.legs && gated(mode) ? { legs: legMedians(handoffLegs(reports, CAP)) } : {}),
              jobs: ok,
              cutOff: reports.reduce((n, r) => n + r.cutOff, 0),
              starved: reports.reduce((n, r) => n + r.perCaller.filter((x) => x === 0).length, 0),
              fewest: Math.min(...reports.flatMap((r) => r.perCaller)),
            };
            if (round >= 0) stats.set(name, [...(stats.get(name) ?? []), s]);
            return s.throughput;
          };
          const contenders: Contender[] = modes.map(({ mode, name }) => ({
            name,
            run: (round) => runOnce(mode, name, round),
          }));
          const figures = await rounds(contenders, count);
          if (charted) {
            const file = chartFile!;
            await writeFile(
              file,
              await renderChart({
                title:
                  `fleet: ${WORKERS} processes × ${PER_WORKER} callers, cap ${CAP}, ${v.serviceMs} ms ` +
                  `service, ${v.thinkMs} ms think (round 1)`,
                subtitle: [0, 3, 6].map((i) => chartTotals.slice(i, i + 3).join(" · ")),
                legend: "contender",
                points: chartPoints,
                cap: CAP,
                intervalMs: CHART_MS,
              }),
            );
            console.error(`(fleet: chart in ${file})`);
          }
          const ceiling = figures.get(modes[0]!.name)!;
          const rows: string[][] = [];
          const notes: string[] = [];
          for (const { mode, name } of modes) {
            const f = figures.get(name)!;
            const s = stats.get(name)!;
            const [med, range] = spread(f, (x) => x.toFixed(1));
            const vs = pairedRatio(f, ceiling);
            const peak = Math.max(...s.map((x) => x.peak));
            const r429 = s.reduce((n, x) => n + x.r429, 0);
            const waitP99 = median(s.map((x) => x.waitP99));
            const fifoP99 = median(s.map((x) => x.fifoP99));
            const vsFifo = median(s.map((x) => x.waitP99 / x.fifoP99));
            const handoffP50 = median(s.map((x) => x.handoffP50));
            const handoffMean = median(s.map((x) => x.handoffMean));
            const starved = Math.max(...s.map((x) => x.starved));
            if (args.legs && gated(mode)) {
              const leg = (pick: (l: LegMedians) => number) => ms(median(s.map((x) => pick(x.legs!))), 2);
              notes.push(
                `${name}, handoff legs (p50, median of rounds): release → its process's next command written ` +
                  `${leg((l) => l.written)} · written → grant heard in the waiter's process ${leg((l) => l.heard)} · ` +
                  `heard → admitted ${leg((l) => l.admitted)}.`,
              );
            }
            const fewest = Math.min(...s.map((x) => x.fewest));
            const outside = s.reduce((n, x) => n + x.outside, 0);
            const errors = s.reduce((n, x) => n + x.errors, 0);
            if (errors !== 0) {
              notes.push(
                `${name}: ${errors} requests failed at the callers in its runs (each caller's permit went back ` +
                  "while the provider may still have been serving it): its peak and 429s can count them.",
              );
            }
            if (outside !== 0) {
              notes.push(
                `${name}: the provider got ${outside} requests beyond those the fleet's callers sent in ` +
                  "its runs (another process on its port): its peak and 429s count them.",
              );
            }
            rows.push([
              name,
              `${med}/s`,
              range,
              mode === "ceiling" ? "—" : pct(vs),
              String(peak),
              String(r429),
              gated(mode) ? ms(waitP99, 1) : "—",
              gated(mode) ? ms(fifoP99, 1) : "—",
              gated(mode) ? times(vsFifo) : "—",
              gated(mode) ? `${ms(handoffP50, 2)} / ${ms(handoffMean, 2)}` : "—",
              `${fewest} / ${starved}`,
            ]);
            if (mode === "floodgate-gate") {
              notes.push(
                `fused gate targets (#14, at 50 ms service): ≥ 97% of ceiling ${verdict(vs >= 0.97, pct(vs))}; ` +
                  `provider peak ≤ 8 ${verdict(peak <= CAP, String(peak))}; ` +
                  `zero 429s ${verdict(r429 === 0, String(r429))}.`,
              );
            }
            if (mode === "blpop") {
              const gate = figures.get(MODES.find((x) => x.mode === "floodgate-gate")!.name);
              const sem = figures.get(MODES.find((x) => x.mode === "floodgate")!.name);
              const of = [
                gate && `the fused gate makes ${times(pairedRatio(gate, f))}`,
                sem && `the semaphore ${times(pairedRatio(sem, f))}`,
              ].filter(Boolean);
              notes.push(
                `handoff floor (BLPOP token list): ${pct(vs)} of ceiling, what the ceiling less one Redis ` +
                  `handoff per job comes to here${of.length > 0 ? `; ${of.join(" and ")} of it` : ""}.`,
              );
            }
            if (mode === "floodgate") {
              notes.push(
                `floodgate targets: ≥ 98% of ceiling ${verdict(vs >= 0.98, pct(vs))}; ` +
                  `provider peak ≤ 8 ${verdict(peak <= CAP, String(peak))}; ` +
                  `zero 429s ${verdict(r429 === 0, String(r429))}; ` +
                  `wait p99 ≤ 2× perfect FIFO ${verdict(vsFifo <= 2, times(vsFifo))}.`,
              );
            }
          }
          table(
            `Fleet: ${WORKERS} processes × ${PER_WORKER} callers, cap ${CAP}, service ${v.serviceMs} ms, ` +
              `think ${v.thinkMs} ms, ${seconds} s per run (median of ${count} rounds)`,
            [
              "contender",
              "jobs/s (median)",
              "min – max",
              "vs ceiling",
              "provider peak (max)",
              "429s (all rounds)",
              "admission wait p99",
              "perfect FIFO p99",
              "p99 ÷ FIFO",
              "handoff p50 / mean",
              "fewest jobs of a caller / callers with none",
            ],
            rows,
            [
              ...notes,
              "The ceiling is 8 ungated callers with no think time: the provider held at exactly 8 in flight, " +
                "the most this harness can get through at cap 8, in every variant. " +
                "Jobs count when answered 200 before the run's end. Waits are measured from asking to grant in " +
                "each worker; a wait still going at the end counts as the time it had waited. The perfect FIFO " +
                "queue is simulated with the same number of callers, the run's measured request and think times, " +
                "and no handoff cost. The handoff is from a release (as called) to the grant it lets in: the k-th " +
                "release of the run, in any process, against its (k + 8)-th grant, on the monotonic clock the " +
                "processes share (a permit that sat idle counts its idle time: read the median). A semaphore " +
                "with no line (the polling ones) can give a freed permit straight back to the caller that freed " +
                "it, which makes its handoff short and its waits long. " +
                "The last column is per run (worst run): a caller that never got in was starved.",
            ],
          );
        } finally {
          await provider.close();
        }
      }
    } finally {
      await stopWorkers(workers);
    }
  },
};
