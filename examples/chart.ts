/**
 * Charts of a run, for the demo, the examples and the benchmarks (`--chart FILE.svg`): a
 * recorder samples the stages' snapshots and the provider's counters over time, and a renderer
 * draws them as three panels sharing the time axis: calls in flight against the cap, callers
 * waiting, and 429s and sheds per interval, one line per stage, traffic class or provider.
 *
 *   const chart = startChart(values.chart, { title: "demo", cap: 8 });
 *   chart?.watch(gate);          // its stages; a stage with classes gives one line per class
 *   chart?.watchProvider(provider);
 *   // … the run …
 *   await chart?.write();        // stops sampling and writes the SVG
 *
 * Drawing uses vega-lite, compiled to a vega spec and rendered to SVG in Node (no browser, no
 * native build). vega is a development dependency of this repository, loaded only when a chart
 * is written; floodgate itself never loads it. Without `--chart` nothing is built, sampled or
 * loaded.
 */
import { writeFile } from "node:fs/promises";
import type { Snapshot } from "floodgate";
import { chartSpec, renderChart } from "./chart-render.js";

/** The three panels, top to bottom. */
export type ChartPanel = "in flight" | "waiting" | "refused";

/** One reading of one line at one moment. */
export interface ChartPoint {
  /** Seconds since the recording started. */
  t: number;
  panel: ChartPanel;
  /** The line's name, and its color in every panel: a stage, `stage · class`, or a provider. */
  series: string;
  /**
   * What the value is: `in flight` or `limit` (dashed) in the first panel, `waiting` in the
   * second, `429s` or `sheds` (counts in the interval that ends at `t`) in the third.
   */
  measure: "in flight" | "limit" | "waiting" | "429s" | "sheds";
  value: number;
}

/** What `renderChart` draws. */
export interface ChartData {
  /** The chart's title: the example's name, and what it ran. */
  title: string;
  /** Lines under the title (totals, the sampling interval). */
  subtitle?: string | readonly string[] | undefined;
  points: readonly ChartPoint[];
  /** The provider's cap: a dotted gray rule across the first panel. */
  cap?: number | undefined;
  /** Milliseconds between samples, for the third panel's title. @default 50 */
  intervalMs?: number | undefined;
  /** The legend's title: what the lines are. @default "stage, class or provider" */
  legend?: string | undefined;
}

/** Options of a recorder. */
export interface ChartOptions {
  /** The chart's title, e.g. the example's name and its backend. */
  title: string;
  /** The provider's cap, drawn as a dotted rule (omit when the provider has none). */
  cap?: number | undefined;
  /** Milliseconds between samples. An integer >= 10. @default 50 */
  intervalMs?: number;
  /** Where `write()` puts the SVG when it is given no path. */
  file?: string | undefined;
}

/** Anything with a snapshot: a stage, or a `Gate` (whose `stages` are watched one by one). */
export interface Watched {
  readonly name: string;
  snapshot(): Snapshot;
  readonly stages?: readonly Watched[];
}

/** What the recorder reads from a provider: `examples/provider.ts`'s `stats()` has all three. */
export interface ProviderCounters {
  stats(): { inFlight: number; rejected429: number; peak: number };
}

/** The `--chart` flag, for a program's flags (the examples get it from `exampleCommand`). */
export const CHART_FLAG = {
  type: "string",
  value: "FILE.svg",
  help: "write a chart of the run to FILE.svg: in flight against the cap, waiting, 429s and sheds over time",
} as const;

/**
 * Samples stages and providers every `intervalMs` (on an unref'd timer, so it never keeps a
 * process alive) into `ChartPoint`s. Stages of the same name (one per process of a fleet, or the
 * same stage reached through several gates) are summed into one line, each object counted once.
 */
export class ChartRecorder {
  readonly title: string;
  readonly cap: number | undefined;
  readonly intervalMs: number;
  readonly file: string | undefined;
  readonly points: ChartPoint[] = [];
  #stages = new Map<string, Set<Watched>>();
  #gates = new Map<string, Set<Watched>>();
  #providers = new Map<string, ProviderCounters>();
  #last = new Map<string, number>();
  #t0 = performance.now();
  #timer: ReturnType<typeof setInterval> | undefined;

  constructor(options: ChartOptions) {
    this.title = options.title;
    this.cap = options.cap;
    this.intervalMs = options.intervalMs ?? 50;
    this.file = options.file;
    if (!Number.isInteger(this.intervalMs) || this.intervalMs < 10) {
      throw new RangeError(`chart: intervalMs must be an integer >= 10 (got ${this.intervalMs})`);
    }
  }

  /**
   * Watch stages. A gate's stages are watched one by one (nested gates included), and the gate
   * itself for the callers waiting in its own line (a gate of memory stages queues its callers
   * there, not at the stages): a line named `gate <name>` in the second panel.
   */
  watch(...stages: Watched[]): this {
    for (const s of stages) {
      const into = s.stages ? this.#gates : this.#stages;
      const same = into.get(s.name) ?? new Set<Watched>();
      same.add(s);
      into.set(s.name, same);
      if (s.stages) this.watch(...s.stages);
    }
    return this;
  }

  /** Watch a provider: its requests in flight (first panel) and its 429s (third panel). */
  watchProvider(provider: ProviderCounters, name = "provider"): this {
    this.#providers.set(name, provider);
    return this;
  }

  /**
   * Start sampling now (time 0), and take the first sample. Called again (when the run proper
   * begins after a slow setup), it starts the time over and drops the points taken so far.
   */
  start(): this {
    this.#t0 = performance.now();
    this.points.length = 0;
    this.sample();
    this.#timer ??= setInterval(() => this.sample(), this.intervalMs);
    this.#timer.unref();
    return this;
  }

  /** Take the last sample and stop. Calling it again does nothing. */
  stop(): void {
    if (this.#timer === undefined) return;
    clearInterval(this.#timer);
    this.#timer = undefined;
    this.sample();
  }

  /** Record one sample of every stage and provider now. */
  sample(): void {
    const t = (performance.now() - this.#t0) / 1000;
    const add = (panel: ChartPanel, series: string, measure: ChartPoint["measure"], value: number) =>
      this.points.push({ t, panel, series, measure, value });
    for (const [name, same] of this.#stages) {
      const snaps = [...same].map((s) => s.snapshot());
      const first = snaps[0]!;
      // A stage with a cap (semaphore, AIMD, queue) goes in the first panel; a bucket or an
      // interval gate, whose in-flight count only repeats the others', only in the second.
      const capped = Number.isFinite(first.limit);
      // A line per class where the stage has classes, else one for the stage.
      const lines: [string, (s: Snapshot) => { inFlight: number; waiting: number } | undefined][] =
        first.classes
          ? Object.keys(first.classes).map((cls) => [`${name} · ${cls}`, (s) => s.classes?.[cls]])
          : [[name, (s) => s]];
      for (const [series, part] of lines) {
        if (capped)
          add(
            "in flight",
            series,
            "in flight",
            sum(snaps, (s) => part(s)?.inFlight),
          );
        add(
          "waiting",
          series,
          "waiting",
          sum(snaps, (s) => part(s)?.waiting),
        );
      }
      // Every process of a fleet holds the same limit: draw it once, not summed.
      if (capped) add("in flight", name, "limit", first.limit);
      if (first.kind === "queue") {
        add(
          "refused",
          name,
          "sheds",
          this.#delta(
            `${name} sheds`,
            sum(snaps, (s) => s.shed),
          ),
        );
      }
    }
    for (const [name, same] of this.#gates) {
      const waiting = sum(
        [...same].map((g) => g.snapshot()),
        (s) => s.waiting,
      );
      add("waiting", `gate ${name}`, "waiting", waiting);
    }
    for (const [name, provider] of this.#providers) {
      const stats = provider.stats();
      add("in flight", name, "in flight", stats.inFlight);
      add("refused", name, "429s", this.#delta(`${name} 429s`, stats.rejected429));
    }
  }

  /** The growth of a counter since the last sample (a counter that went back was reset). */
  #delta(key: string, total: number): number {
    const last = this.#last.get(key) ?? 0;
    this.#last.set(key, total);
    return total >= last ? total - last : total;
  }

  /** Totals for the subtitle: each provider's peak and 429s, and the sheds; a line each. */
  summary(): string[] {
    const lines: string[] = [];
    for (const [name, provider] of this.#providers) {
      const s = provider.stats();
      lines.push(
        `${name}: peak ${s.peak}${this.cap === undefined ? "" : `/${this.cap}`} in flight, 429s ${s.rejected429}`,
      );
    }
    const sheds = this.points.filter((p) => p.measure === "sheds").reduce((n, p) => n + p.value, 0);
    lines.push(`sheds ${sheds} · sampled every ${this.intervalMs} ms`);
    return lines;
  }

  /** What `renderChart` takes: the points so far, the title, the cap. */
  data(): ChartData {
    return {
      title: this.title,
      subtitle: this.summary(),
      points: this.points,
      cap: this.cap,
      intervalMs: this.intervalMs,
    };
  }

  /** Stop sampling, render, and write the SVG to `file` (or the one given at construction). */
  async write(file = this.file): Promise<string> {
    if (file === undefined) throw new Error("chart: no file to write to");
    this.stop();
    await writeFile(file, await renderChart(this.data()));
    return file;
  }
}

function sum(snaps: readonly Snapshot[], pick: (s: Snapshot) => number | undefined): number {
  return snaps.reduce((n, s) => n + (pick(s) ?? 0), 0);
}

/**
 * A started recorder when `file` is given (the value of `--chart`), else `undefined`: without
 * the flag nothing is recorded.
 */
export function startChart(
  file: string | undefined,
  options: Omit<ChartOptions, "file">,
): ChartRecorder | undefined {
  if (file === undefined) return undefined;
  return new ChartRecorder({ ...options, file }).start();
}

/** Write the chart of `chart` when there is one, and say where on stderr. */
export async function writeChart(chart: ChartRecorder | undefined): Promise<void> {
  if (chart) process.stderr.write(`chart: ${await chart.write()}\n`);
}

export { chartSpec, renderChart };
