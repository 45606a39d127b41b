/** Shared helpers of the benchmark suite: rounds, statistics and tables. */

/** Settings every benchmark receives from the command line. */
export interface BenchArgs {
  /** Short form: fewer tasks, shorter runs, for a quick check. */
  quick: boolean;
  /** Rounds per benchmark; each round measures every contender once. */
  rounds: number | undefined;
  /** Tasks (or operations) per contender per round, where a benchmark counts them. */
  tasks: number | undefined;
  /** Seconds per contender per round, where a benchmark runs for a time. */
  seconds: number | undefined;
  /** Handoffs per contender per round (handoff benchmark). */
  handoffs: number | undefined;
  /** Keys (idle-keys benchmark). */
  keys: number | undefined;
  /** The contenders to run, by their ids (fleet benchmark: its ceiling row always runs); all when undefined. */
  only: readonly string[] | undefined;
  /** Time each handoff leg by leg (fleet benchmark): see bench/fleet.ts, `HandoffLegs`. */
  legs: boolean;
  /** Redis URL of the shared server, once started. */
  redisUrl: () => Promise<string>;
}

/** A benchmark of the suite. */
export interface Benchmark {
  readonly name: string;
  readonly title: string;
  readonly redis: boolean;
  run(args: BenchArgs): Promise<void>;
}

export const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** Sleep `ms`, or less when `signal` aborts first (a call that wraps up when asked to). */
export function sleepUnless(ms: number, signal: AbortSignal): Promise<void> {
  if (signal.aborted) return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal.addEventListener("abort", done, { once: true });
  });
}

/** A full collection between contenders, when the process runs with `--expose-gc`. */
export function collect(): void {
  (globalThis as { gc?: () => void }).gc?.();
}

export function sorted(values: readonly number[]): number[] {
  return [...values].sort((a, b) => a - b);
}

/** The mean of `values`; NaN when there are none. */
export function mean(values: readonly number[]): number {
  if (values.length === 0) return Number.NaN;
  let sum = 0;
  for (const v of values) sum += v;
  return sum / values.length;
}

export function median(values: readonly number[]): number {
  const s = sorted(values);
  if (s.length === 0) return Number.NaN;
  const mid = s.length >> 1;
  return s.length % 2 === 1 ? s[mid]! : (s[mid - 1]! + s[mid]!) / 2;
}

/** Nearest-rank percentile of already sorted numbers. */
export function percentile(sortedValues: readonly number[], p: number): number {
  if (sortedValues.length === 0) return Number.NaN;
  const rank = Math.ceil((p / 100) * sortedValues.length);
  return sortedValues[Math.min(sortedValues.length - 1, Math.max(0, rank - 1))]!;
}

/** A contender of a round: returns its figure for that round. */
export interface Contender {
  readonly name: string;
  run(round: number): Promise<number>;
}

/**
 * Run `rounds` rounds; each round runs every contender once, in an order that rotates from round
 * to round so no contender always goes first. Returns each contender's figure per round.
 */
export async function rounds(
  contenders: readonly Contender[],
  count: number,
  options: { warmup?: boolean; onRound?: (round: number) => void } = {},
): Promise<Map<string, number[]>> {
  const figures = new Map<string, number[]>(contenders.map((c) => [c.name, []]));
  if (options.warmup !== false) {
    for (const c of contenders) {
      collect();
      await c.run(-1);
    }
  }
  for (let r = 0; r < count; r++) {
    for (let i = 0; i < contenders.length; i++) {
      const c = contenders[(i + r) % contenders.length]!;
      collect();
      figures.get(c.name)!.push(await c.run(r));
    }
    options.onRound?.(r);
  }
  return figures;
}

/** Per-round ratios a[r] / b[r] of two contenders measured in the same rounds. */
export function ratios(a: readonly number[], b: readonly number[]): number[] {
  return a.map((v, i) => v / b[i]!);
}

/** Median of the per-round ratios: a paired figure that a noisy round does not swing. */
export function pairedRatio(a: readonly number[], b: readonly number[]): number {
  return median(ratios(a, b));
}

/** 1234567 → "1.23 M", 51234 → "51.2 k". */
export function si(value: number): string {
  if (!Number.isFinite(value)) return String(value);
  if (Number.isInteger(value) && Math.abs(value) < 1000) return String(value);
  const abs = Math.abs(value);
  const fmt = (v: number) => (v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2));
  if (abs >= 1e6) return `${fmt(value / 1e6)} M`;
  if (abs >= 1e3) return `${fmt(value / 1e3)} k`;
  return fmt(value);
}

export function ms(value: number, digits = 2): string {
  return Number.isFinite(value) ? `${value.toFixed(digits)} ms` : "—";
}

export function times(value: number): string {
  if (!Number.isFinite(value)) return "—";
  return `${value >= 0.1 || value === 0 ? value.toFixed(2) : value.toPrecision(2)}×`;
}

export function pct(value: number): string {
  return Number.isFinite(value) ? `${(value * 100).toFixed(1)}%` : "—";
}

/** "median (min–max)" of per-round figures, each through `fmt`. */
export function spread(values: readonly number[], fmt: (v: number) => string): [string, string] {
  const s = sorted(values);
  return [fmt(median(s)), `${fmt(s[0]!)} – ${fmt(s[s.length - 1]!)}`];
}

/** Print a Markdown table with aligned columns, under a heading and with notes after it. */
export function table(title: string, headers: string[], rows: string[][], notes: string[] = []): void {
  const widths = headers.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? "").length)));
  const line = (cells: string[]) => `| ${cells.map((c, i) => c.padEnd(widths[i]!)).join(" | ")} |`;
  const out = [`### ${title}`, "", line(headers), `| ${widths.map((w) => "-".repeat(w)).join(" | ")} |`];
  for (const r of rows) out.push(line(r));
  if (notes.length > 0) out.push("", ...notes);
  console.log(`${out.join("\n")}\n`);
}

/** "met" or "MISSED" with the measured figure, for a target line. */
export function verdict(met: boolean, detail: string): string {
  return `${met ? "met" : "MISSED"} (${detail})`;
}
