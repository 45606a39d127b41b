/**
 * What the examples share: their command line, the backend (memory, or Redis when `REDIS_URL` is set), a live
 * progress line on stderr, a deadline, and a few numbers helpers.
 */
import { randomBytes } from "node:crypto";
import { type Backend, memory } from "floodgate";
import { redis } from "floodgate/redis";
import { Redis } from "ioredis";
import { CHART_FLAG } from "./chart.js";
import { type Command, command, type Flags, parseCommandLine, usage, type Values } from "./cli.js";

/** The flag every example takes: a short run. */
const SMALL = { type: "boolean", help: "a short run (a few seconds)" } as const;

/**
 * An example's command line: `npm run example -- <name> [flags]`, with `--small` and `--chart`
 * added. A flag's `small` is its default under `--small`; `--chart FILE.svg` names the file the
 * example draws its run to (see `chart.ts`).
 */
export function exampleCommand<const F extends Flags>(
  name: string,
  about: string,
  flags: F,
  notes: readonly string[] = [],
): Command<F & { small: typeof SMALL; chart: typeof CHART_FLAG }> {
  return command({
    name,
    synopsis: `npm run example -- ${name} [flags]`,
    about: `${about[0]!.toUpperCase()}${about.slice(1)}.`,
    flags: { small: SMALL, ...flags, chart: CHART_FLAG },
    notes,
    hint: `try: npm run example -- ${name} --help`,
  });
}

/**
 * Parse an example's flags. On `--help` it prints the usage and returns `undefined` (the example
 * then exits 0); anything it cannot use throws `UsageError` (the runner prints it, exit 2).
 */
export function parseFlags<F extends Flags>(c: Command<F>, argv: readonly string[]): Values<F> | undefined {
  const parsed = parseCommandLine(c, argv);
  if (parsed === undefined) {
    process.stdout.write(usage(c as Command));
    return undefined;
  }
  return parsed.values;
}

/** A backend and how to let go of it. */
export interface BackendHandle {
  backend: Backend;
  mode: "memory" | "redis";
  /** Key prefix on Redis (every process of the example uses the same one). */
  prefix: string;
  /** Redis URL, when on Redis. */
  url: string | undefined;
  /** Close the backend and its connection; on Redis, also delete the example's keys when `clean`. */
  close(clean?: boolean): Promise<void>;
}

/** A fresh key prefix for one run: `<example>:<random>:`. */
export function newPrefix(example: string): string {
  return `${example}:${randomBytes(4).toString("hex")}:`;
}

/** Memory by default; Redis, shared through `prefix`, when `REDIS_URL` is set. */
export async function openBackend(prefix: string): Promise<BackendHandle> {
  const url = process.env.REDIS_URL;
  if (!url) {
    const backend = memory();
    return { backend, mode: "memory", prefix, url: undefined, close: () => backend.close() };
  }
  const client = await connectRedis(url);
  const backend = redis(client, { prefix });
  return {
    backend,
    mode: "redis",
    prefix,
    url,
    async close(clean = false) {
      await backend.close();
      if (clean) await deleteKeys(client, prefix).catch(() => {});
      await client.quit().catch(() => client.disconnect());
    },
  };
}

/**
 * An ioredis client as the README recommends it: no offline queue, so an outage fails calls at
 * once instead of queueing a burst to replay later. Resolves once it is ready.
 */
export async function connectRedis(url: string): Promise<Redis> {
  const client = new Redis(url, { enableOfflineQueue: false });
  let lastError: Error | undefined;
  // ioredis reports connection trouble as "error" events; the stages turn it into
  // BackendUnavailableError for the call that needed Redis.
  client.on("error", (error: Error) => {
    lastError = error;
  });
  const ready =
    client.status === "ready" ||
    (await new Promise<boolean>((resolve) => {
      const onReady = () => {
        clearTimeout(timer);
        resolve(true);
      };
      const timer = setTimeout(() => {
        client.off("ready", onReady);
        resolve(false);
      }, 5000);
      client.once("ready", onReady);
    }));
  if (!ready) {
    client.disconnect();
    throw new Error(`Redis at ${url} did not answer within 5 s${lastError ? `: ${lastError.message}` : ""}`);
  }
  return client;
}

/** Delete every key under `prefix` (a run's leftovers; permits and buckets expire on their own too). */
export async function deleteKeys(client: Redis, prefix: string): Promise<void> {
  let cursor = "0";
  do {
    const [next, keys] = await client.scan(cursor, "MATCH", `${prefix}*`, "COUNT", 500);
    cursor = next;
    if (keys.length > 0) await client.del(...keys);
  } while (cursor !== "0");
}

/** Where the example runs, for the first line of output. */
export function where(handle: BackendHandle): string {
  return handle.mode === "redis" ? `redis ${handle.url} (prefix ${handle.prefix})` : "memory";
}

/** A live progress line on stderr: rewritten in place on a terminal, one line a second otherwise. */
export function progress(render: () => string): { stop(): void } {
  const tty = process.stderr.isTTY === true;
  const draw = () => process.stderr.write(tty ? `\r${render()}\x1b[K` : `${render()}\n`);
  const ticker = setInterval(draw, tty ? 100 : 1000);
  return {
    stop() {
      clearInterval(ticker);
      draw();
      if (tty) process.stderr.write("\n");
    },
  };
}

/** An AbortSignal that aborts after `ms`, so a run always stops. */
export function deadline(name: string, ms: number): { signal: AbortSignal; clear(): void } {
  const controller = new AbortController();
  const timer = setTimeout(
    () => controller.abort(new Error(`${name}: gave up after ${(ms / 1000).toFixed(0)} s`)),
    ms,
  );
  return { signal: controller.signal, clear: () => clearTimeout(timer) };
}

/** Resolve after `ms`, or reject with the signal's reason when it aborts first. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal!.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** The `p` quantile (0..1) of `values`, or NaN when empty. */
export function quantile(values: readonly number[], p: number): number {
  if (values.length === 0) return Number.NaN;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))]!;
}

/** Seconds with one decimal: `3.2 s`. */
export const secs = (ms: number): string => `${(ms / 1000).toFixed(1)} s`;

/** A rate with one decimal: `41.3/s`. */
export const perSec = (n: number, ms: number): string => `${(n / (ms / 1000)).toFixed(1)}/s`;

/** Whole milliseconds: `12 ms`. */
export const msText = (ms: number): string => `${Math.round(ms)} ms`;

/** Time-weighted mean of a level (in flight) that moves up and down. */
export class LevelMeter {
  #level = 0;
  #area = 0;
  #since = performance.now();
  #from = this.#since;
  peak = 0;

  #advance(): void {
    const t = performance.now();
    this.#area += this.#level * (t - this.#since);
    this.#since = t;
  }

  up(): void {
    this.#advance();
    this.#level++;
    if (this.#level > this.peak) this.peak = this.#level;
  }

  down(): void {
    this.#advance();
    this.#level--;
  }

  get level(): number {
    return this.#level;
  }

  /** Mean level since the start or the last `restart()`. */
  mean(): number {
    this.#advance();
    const span = this.#since - this.#from;
    return span > 0 ? this.#area / span : 0;
  }

  /** Start a new averaging period (the level carries over). */
  restart(): void {
    this.#advance();
    this.#area = 0;
    this.#from = this.#since;
    this.peak = this.#level;
  }
}
