import { type ChildProcess, spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { once } from "node:events";
import type { Clock, ClockTimer } from "floodgate";
import { Redis, type RedisOptions } from "ioredis";
import { bundleEntry, ROOT } from "../setup/bundle.js";

export { ROOT };

/** A key prefix no other test uses. */
export function randomPrefix(label: string): string {
  return `test-redis:${label}:${randomUUID()}:`;
}

/**
 * A connected client that fails fast: no retries per request, no offline queue. Pass
 * `retryStrategy` (and anything else) through `extra`. An `error` listener is attached so a
 * dropped connection is not reported as an unhandled error event.
 */
export async function connectedClient(url: string, extra: RedisOptions = {}): Promise<Redis> {
  const client = new Redis(url, {
    maxRetriesPerRequest: 0,
    enableOfflineQueue: false,
    lazyConnect: true,
    ...extra,
  });
  client.on("error", () => {});
  await client.connect();
  return client;
}

/** Quit politely when connected, else drop the connection; never throws. */
export async function closeClient(client: Redis | undefined): Promise<void> {
  if (!client) return;
  try {
    if (client.status === "ready") await client.quit();
    else client.disconnect();
  } catch {
    client.disconnect();
  }
}

/** A seeded generator of numbers in [0, 1) (mulberry32), so a failing random sequence can be replayed. */
export function seeded(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/**
 * Poll `check` until it returns a value other than `undefined`/`false`, or throw `message` once
 * `timeoutMs` of real time has passed. For waiting on something real (a process, a reconnect).
 */
export async function until<T>(
  check: () => T | undefined | false | Promise<T | undefined | false>,
  { timeoutMs, intervalMs = 25, message }: { timeoutMs: number; intervalMs?: number; message: string },
): Promise<T> {
  const deadline = performance.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value !== undefined && value !== false) return value;
    if (performance.now() > deadline) throw new Error(`${message} (gave up after ${timeoutMs} ms)`);
    await sleep(intervalMs);
  }
}

/** Settle `promise` within `timeoutMs` of real time, or reject saying what hung. */
export function within<T>(promise: Promise<T>, timeoutMs: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const limit = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} did not settle within ${timeoutMs} ms`)), timeoutMs);
  });
  return Promise.race([promise, limit]).finally(() => clearTimeout(timer));
}

/** The rejection of `promise` (fails if it resolves). */
export async function rejectionOf(promise: Promise<unknown>): Promise<unknown> {
  try {
    await promise;
  } catch (error) {
    return error;
  }
  throw new Error("expected a rejection, but the promise resolved");
}

/** The system clock shifted by `offsetMs`: a host whose clock is wrong, with timers that run normally. */
export function skewedClock(offsetMs: number, base: () => number = () => performance.now()): Clock {
  return {
    now: () => base() + offsetMs,
    setTimeout: (callback, ms) => setTimeout(callback, ms),
    clearTimeout: (timer) => clearTimeout(timer as ReturnType<typeof setTimeout>),
  };
}

interface StallTimer {
  handle: ReturnType<typeof setTimeout> | undefined;
  callback: () => void;
  cancelled: boolean;
}

/**
 * The system clock, except that its timers can be held back: while stalled, due callbacks wait
 * and run in order on `resume()`. It stands for a holder whose event loop stopped (a long GC
 * pause, a stopped VM) while the rest of the fleet carries on.
 */
export class StallableClock implements Clock {
  #stalled = false;
  #held: StallTimer[] = [];

  now(): number {
    return performance.now();
  }

  setTimeout(callback: () => void, ms: number): ClockTimer {
    const timer: StallTimer = { handle: undefined, callback, cancelled: false };
    timer.handle = setTimeout(() => {
      timer.handle = undefined;
      if (timer.cancelled) return;
      if (this.#stalled) this.#held.push(timer);
      else callback();
    }, ms);
    return timer;
  }

  clearTimeout(timer: ClockTimer): void {
    const t = timer as StallTimer;
    t.cancelled = true;
    if (t.handle !== undefined) clearTimeout(t.handle);
  }

  stall(): void {
    this.#stalled = true;
  }

  resume(): void {
    this.#stalled = false;
    const held = this.#held;
    this.#held = [];
    for (const timer of held) if (!timer.cancelled) timer.callback();
  }
}

/**
 * A child process running one of `test/redis/fixtures/*.ts` (bundled with the library's sources:
 * see `bundleEntry`), talking in JSON lines: the test writes commands to its stdin and reads
 * events from its stdout.
 */
export class Child {
  readonly process: ChildProcess;
  readonly messages: Record<string, unknown>[] = [];
  stderr = "";
  #buffer = "";
  #listeners = new Set<() => void>();

  constructor(fixture: string, env: Record<string, string>) {
    const entry = bundleEntry(`test/redis/fixtures/${fixture}`);
    this.process = spawn(process.execPath, ["--enable-source-maps", entry], {
      cwd: ROOT,
      env: { ...process.env, ...env },
      stdio: ["pipe", "pipe", "pipe"],
    });
    this.process.stdout!.setEncoding("utf8");
    this.process.stdout!.on("data", (chunk: string) => {
      this.#buffer += chunk;
      for (let at = this.#buffer.indexOf("\n"); at >= 0; at = this.#buffer.indexOf("\n")) {
        const line = this.#buffer.slice(0, at).trim();
        this.#buffer = this.#buffer.slice(at + 1);
        if (!line.startsWith("{")) continue;
        try {
          this.messages.push(JSON.parse(line));
        } catch {
          continue;
        }
        for (const listener of this.#listeners) listener();
      }
    });
    this.process.stderr!.setEncoding("utf8");
    this.process.stderr!.on("data", (chunk: string) => {
      this.stderr = (this.stderr + chunk).slice(-4000);
    });
    this.process.stdin!.on("error", () => {});
    this.process.on("exit", () => {
      for (const listener of this.#listeners) listener();
    });
  }

  get exited(): boolean {
    return this.process.exitCode !== null || this.process.signalCode !== null;
  }

  /** Send one command line. */
  send(message: Record<string, unknown>): void {
    if (!this.exited) this.process.stdin!.write(`${JSON.stringify(message)}\n`);
  }

  /** The first message of type `type`, waiting up to `timeoutMs` for it. */
  message(type: string, timeoutMs: number): Promise<Record<string, unknown>> {
    return new Promise((resolve, reject) => {
      const check = () => {
        const found = this.messages.find((m) => m.type === type);
        if (found) return done(() => resolve(found));
        const failed = this.messages.find((m) => m.type === "error");
        if (failed) return done(() => reject(new Error(`child failed: ${String(failed.message)}`)));
        if (this.exited) {
          return done(() =>
            reject(
              new Error(
                `child exited (${this.process.exitCode ?? this.process.signalCode}) before "${type}": ${this.stderr}`,
              ),
            ),
          );
        }
      };
      const timer = setTimeout(
        () =>
          done(() => reject(new Error(`no "${type}" from the child within ${timeoutMs} ms: ${this.stderr}`))),
        timeoutMs,
      );
      const done = (settle: () => void) => {
        clearTimeout(timer);
        this.#listeners.delete(check);
        settle();
      };
      this.#listeners.add(check);
      check();
    });
  }

  /** Resolves with the exit code once the child has exited, or rejects after `timeoutMs`. */
  async exit(timeoutMs: number): Promise<number | null> {
    if (!this.exited) await within(once(this.process, "exit"), timeoutMs, "child exit");
    return this.process.exitCode;
  }

  /** SIGKILL the child (if still running) and wait for it to be gone. */
  async kill(): Promise<void> {
    if (this.exited) return;
    const gone = once(this.process, "exit");
    this.process.kill("SIGKILL");
    await gone;
  }
}

/**
 * The script calls (EVALSHA and EVAL) whose first key starts with `key`, each as MONITOR on
 * `monitor` shows its arguments (`seen`), for a test whose server other test files share, where
 * the global counts would not do. `shown(admin, n)`: wait until `n` have been seen, and every
 * command sent before it (a PING on `admin` after them comes back only once MONITOR has shown them).
 */
export async function watchScripts(
  monitor: Redis,
  key: string,
): Promise<{ seen: string[][]; shown(admin: Redis, n: number): Promise<void>; stop(): void }> {
  const feed = await monitor.monitor();
  const seen: string[][] = [];
  feed.on("monitor", (_time: string, args: string[]) => {
    const command = args[0]?.toLowerCase();
    if ((command === "evalsha" || command === "eval") && args[3]?.startsWith(key)) seen.push(args);
  });
  return {
    seen,
    async shown(admin, n) {
      await admin.ping();
      await until(() => seen.length >= n, {
        timeoutMs: 5000,
        message: "MONITOR did not show the script calls",
      });
      await admin.ping();
    },
    stop: () => feed.disconnect(),
  };
}

/** Script calls (EVALSHA and EVAL) Redis has run since its statistics were last reset. */
export async function evalCalls(client: Redis): Promise<number> {
  const info = await client.info("commandstats");
  let calls = 0;
  for (const m of info.matchAll(/^cmdstat_(?:evalsha|eval):calls=(\d+)/gm)) calls += Number(m[1]);
  return calls;
}

/** Wait until `client`'s server has run `n` script calls in all (real time, 5 s at most); returns `n`. */
export async function evalCallsReach(client: Redis, n: number, what: string): Promise<number> {
  await until(async () => (await evalCalls(client)) === n, { timeoutMs: 5000, message: what });
  return n;
}

/**
 * Whether `client`'s server guards pub/sub channels by ACL (Redis 6.2 and later): an ACL user
 * there needs `&*` to subscribe at all (7.0 denies channels by default), and Redis 6.0 refuses
 * the rule as unknown.
 */
export async function aclGuardsChannels(client: Redis): Promise<boolean> {
  const [major, minor] = await serverVersion(client);
  return major * 100 + minor >= 602;
}

/** `client`'s server's version as `INFO server` gives it (`redis_version`): major and minor. */
async function serverVersion(client: Redis): Promise<[number, number]> {
  const info = await client.info("server");
  const version = /^redis_version:(\d+)\.(\d+)\./m.exec(info);
  if (!version) throw new Error(`no redis_version in INFO server: ${info.slice(0, 200)}`);
  return [Number(version[1]), Number(version[2])];
}

/**
 * Whether `client`'s server gives scripts its version (`redis.REDIS_VERSION_NUM`, Redis 7.0 and
 * later): a gate's script decides a turn of alike admissions in its first pass, and puts a turn's
 * leases into a permit stage with one command, only where it can tell the server has `ZMSCORE`.
 */
export async function scriptsKnowVersion(client: Redis): Promise<boolean> {
  const [major] = await serverVersion(client);
  return major >= 7;
}
