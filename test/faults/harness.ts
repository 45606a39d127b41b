import { once } from "node:events";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { isFloodgateError, type Stage, type Ticket } from "floodgate";
import { type RedisBackend, type RedisClient, redis, stageKey } from "floodgate/redis";
import type { Redis } from "ioredis";
import { expect } from "vitest";
import type { ProviderGroup } from "../../examples/provider.js";
import { type Child, sleep, until, within } from "../redis/helpers.js";
import { freePort, haveRedisServer, INSTALL_HINT, RedisProcess } from "../setup/redis-server.js";

/** Longest wait for one Redis reply in the fault scenarios, ms. */
export const COMMAND_TIMEOUT_MS = 300;
/** Longest a waiter goes without asking Redis again, ms (jittered ×0.5–1.5). */
export const POLL_MS = 100;
/**
 * Slack on every timing bound, ms: timers and replies on a busy two-core machine shared with
 * other test files and benchmarks run late by this much at worst (measured well below it).
 */
export const SLACK_MS = 700;
/** A new call fails closed within this: one command timeout (the first stage's), plus slack. */
export const NEW_CALL_BOUND_MS = COMMAND_TIMEOUT_MS + SLACK_MS;
/**
 * A call already out when the fault starts settles within this: a waiter may sleep one jittered
 * poll before it asks again, and a gate that fails part-way waits for its refund (a second
 * command timeout) before it rejects.
 */
export const IN_FLIGHT_BOUND_MS = POLL_MS * 1.5 + 2 * COMMAND_TIMEOUT_MS + SLACK_MS;
/** From the fault's end to the first admitted call: a reconnect (50 ms apart) and one round trip, plus slack. */
export const RECOVERY_BOUND_MS = 3_000;

/**
 * How many NOSCRIPT replies Redis has sent since it started (its error statistics, Redis 6.2 and
 * later). A server without error statistics (Redis 6.0) cannot count them: there it is how many
 * scripts were sent by their body (`EVAL`), which a client does after NOSCRIPT, and once for
 * each script on each new connection. Take it after every script has run once, then again.
 */
export async function noscriptReplies(admin: Redis): Promise<number> {
  const info = await admin.info("errorstats");
  if (/^# Errorstats/m.test(info)) {
    return Number(/errorstat_NOSCRIPT:count=(\d+)/.exec(info)?.[1] ?? 0);
  }
  const stats = await admin.info("commandstats");
  return Number(/^cmdstat_eval:calls=(\d+)/m.exec(stats)?.[1] ?? 0);
}

/** A redis-server of this file's own on a free loopback port; fails with an install hint when there is none. */
export async function startRedis(port: number, extraArgs: string[] = []): Promise<RedisProcess> {
  // These scenarios stop, hang and restart a server of their own, so they need the binary even with REDIS_URL.
  if (!haveRedisServer()) throw new Error(`redis-server was not found on the PATH. ${INSTALL_HINT}`);
  const server = new RedisProcess(port, extraArgs);
  await server.start();
  return server;
}

/** A redis-server like `startRedis`'s that keeps its data across restarts, in an append-only file. */
export async function startPersistentRedis(): Promise<{ server: RedisProcess; remove(): Promise<void> }> {
  const dir = await mkdtemp(join(tmpdir(), "floodgate-aof-"));
  try {
    // The file is rewritten once past 1 MB, so loading it on a restart stays quick (ioredis waits
    // a second before it asks again if it connects while Redis is still loading).
    const aof = ["--appendonly", "yes", "--auto-aof-rewrite-min-size", "1mb", "--dir", dir];
    const server = await startRedis(await freePort(), aof);
    return {
      server,
      async remove() {
        await server.stop();
        await rm(dir, { recursive: true, force: true });
      },
    };
  } catch (error) {
    await rm(dir, { recursive: true, force: true });
    throw error;
  }
}

/**
 * Stop redis-server (SIGTERM lets it finish its append-only file; SIGKILL is a crash) and start
 * it again on the same port `downMs` later. Returns how long it was away: from the stop to ready
 * again, ms.
 */
export async function restartRedis(server: RedisProcess, graceful: boolean, downMs: number): Promise<number> {
  const from = epochNow();
  const child = server.child;
  if (graceful && child && child.exitCode === null && child.signalCode === null) {
    const gone = once(child, "exit");
    child.kill("SIGTERM");
    await Promise.race([gone, sleep(5_000)]);
  }
  await server.stop();
  await sleep(downMs);
  await server.start();
  return epochNow() - from;
}

/** Milliseconds since the epoch, with a fraction; comparable between processes of one machine. */
export const epochNow = (): number => performance.timeOrigin + performance.now();

/**
 * The provider's `group` hook, tapped: the time of every arrival (`epochNow()`) and the requests
 * in flight counting it, so an arrival above the cap (a breach) is known to the millisecond.
 */
export class ProviderTap implements ProviderGroup {
  readonly at: number[] = [];
  readonly level: number[] = [];
  /** The `x-call-id` of every call in flight at the provider at each arrival (this one included). */
  readonly ids: string[][] = [];
  peak = 0;
  #inFlight = 0;
  readonly #there = new Set<string>();
  get inFlight(): number {
    return this.#inFlight;
  }
  set inFlight(value: number) {
    if (value > this.#inFlight) {
      this.at.push(epochNow());
      this.level.push(value);
      this.ids.push([...this.#there]);
    }
    this.#inFlight = value;
  }
  arrived(id: string | undefined): void {
    if (id !== undefined) this.#there.add(id);
  }
  left(id: string | undefined): void {
    if (id !== undefined) this.#there.delete(id);
  }
}

/** The first message of `type` a child sent at index `from` or later; undefined after `timeoutMs` or an exit. */
export async function nextMessage(
  child: Child,
  type: string,
  from: number,
  timeoutMs: number,
): Promise<Record<string, unknown> | undefined> {
  const deadline = performance.now() + timeoutMs;
  while (performance.now() < deadline && !child.exited) {
    for (let i = from; i < child.messages.length; i++)
      if (child.messages[i]!.type === type) return child.messages[i];
    await sleep(5);
  }
  return undefined;
}

/** Records every unhandled rejection of this process until `stop()`. */
export function recordUnhandled(): { seen: unknown[]; stop(): void } {
  const seen: unknown[] = [];
  const onRejection = (reason: unknown) => seen.push(reason);
  process.on("unhandledRejection", onRejection);
  return { seen, stop: () => process.off("unhandledRejection", onRejection) };
}

/** The ioredis offline queue: commands held while not connected, to replay later. */
export function offlineQueueLength(client: Redis): number {
  return (client as unknown as { offlineQueue: { length: number } }).offlineQueue.length;
}

/** Commands sent on the connection and still waiting for a reply. */
export function commandQueueLength(client: Redis): number {
  return client.commandQueue.length;
}

/** The value below which `q` of the sorted `values` fall (nearest rank). */
export function percentile(values: readonly number[], q: number): number {
  if (values.length === 0) return Number.NaN;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))]!;
}

/** `p50 x ms, max y ms (n)`, for the printed figures. */
export function spread(values: readonly number[]): string {
  const f = (n: number) => n.toFixed(0);
  return `p50 ${f(percentile(values, 0.5))} ms, max ${f(Math.max(...values))} ms (n=${values.length})`;
}

/** One call made by `Load`: when it started and ended (performance.now()), and how it went. */
export interface Call {
  startedAt: number;
  endedAt: number;
  ok: boolean;
  error?: unknown;
}

/**
 * Callers that loop through `run` until stopped, each call doing `serviceMs` of pretend work
 * inside the admission, while an oracle counts the work running at once (what a provider would
 * see). A caller refused because Redis is away backs off `backoffMs` before the next call.
 */
export class Load {
  readonly calls: Call[] = [];
  /** Work running now, and the most ever at once. */
  readonly oracle = { now: 0, peak: 0 };
  #stopped = false;
  #callers: Promise<void>[] = [];

  constructor(
    readonly run: (work: (ticket: Ticket) => Promise<void>) => Promise<unknown>,
    readonly callers: number,
    readonly serviceMs = 20,
    readonly backoffMs = 20,
  ) {}

  start(): this {
    for (let i = 0; i < this.callers; i++) this.#callers.push(this.#caller());
    return this;
  }

  async #caller(): Promise<void> {
    const work = async () => {
      this.oracle.peak = Math.max(this.oracle.peak, ++this.oracle.now);
      try {
        await sleep(this.serviceMs);
      } finally {
        this.oracle.now--;
      }
    };
    while (!this.#stopped) {
      const call: Call = { startedAt: performance.now(), endedAt: 0, ok: false };
      try {
        await this.run(work);
        call.ok = true;
      } catch (error) {
        call.error = error;
      }
      call.endedAt = performance.now();
      this.calls.push(call);
      if (!call.ok) await sleep(this.backoffMs);
    }
  }

  /** Calls that started in [from, to). */
  between(from: number, to = Number.POSITIVE_INFINITY): Call[] {
    return this.calls.filter((c) => c.startedAt >= from && c.startedAt < to);
  }

  /** Calls that failed, other than with `BackendUnavailableError`. */
  otherFailures(): Call[] {
    return this.calls.filter((c) => !c.ok && !isFloodgateError(c.error, "BACKEND_UNAVAILABLE"));
  }

  /** Wait for the first success of a call started at or after `from`; its end time. */
  async firstSuccessAfter(from: number, timeoutMs: number): Promise<number> {
    const found = await until(() => this.calls.find((c) => c.ok && c.startedAt >= from), {
      timeoutMs,
      message: "no call succeeded after the fault was healed",
    });
    return found.endedAt;
  }

  async stop(): Promise<void> {
    this.#stopped = true;
    await Promise.all(this.#callers);
  }
}

/** Describe a failure for an assertion message. */
export function describeError(error: unknown): string {
  if (error instanceof Error) return `${error.name}: ${error.message}`;
  return String(error);
}

/**
 * Make each of `probes` (a name, and the call) at once while a fault is on, and expect every one
 * to fail closed, typed (`BackendUnavailableError`), within NEW_CALL_BOUND_MS. Returns how long
 * each took, ms.
 */
export function expectFailClosed(
  probes: readonly (readonly [string, () => Promise<unknown>])[],
): Promise<number[]> {
  return Promise.all(
    probes.map(async ([what, call]) => {
      const startedAt = performance.now();
      const error = await within(
        call().then((v) => new Error(`${what} resolved ${String(v)}`)),
        5_000,
        what,
      ).catch((e) => e);
      const took = performance.now() - startedAt;
      expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), `${what}: ${describeError(error)}`).toBe(true);
      expect(took, `${what} failed closed after ${took.toFixed(0)} ms`).toBeLessThan(NEW_CALL_BOUND_MS);
      return took;
    }),
  );
}

/**
 * Expect the calls of `load` that failed after a fault began at `faultAt` to have failed in
 * time: those made while it lasted (up to `endAt`) within NEW_CALL_BOUND_MS of its start or
 * theirs, those already out when it began within IN_FLIGHT_BOUND_MS.
 */
export function expectFailedInTime(load: Load, faultAt: number, endAt: number): void {
  const late = (c: Call, bound: number) => !c.ok && c.endedAt - Math.max(c.startedAt, faultAt) > bound;
  expect(load.between(faultAt, endAt).filter((c) => late(c, NEW_CALL_BOUND_MS))).toEqual([]);
  const outAtFault = load.calls.filter((c) => c.startedAt < faultAt && c.endedAt > faultAt);
  expect(outAtFault.filter((c) => late(c, IN_FLIGHT_BOUND_MS))).toEqual([]);
}

/** The Redis server's clock in milliseconds, as the scripts read it. */
export async function serverNow(client: Redis): Promise<number> {
  const [seconds, micros] = await client.time();
  return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
}

/**
 * After a fault: wait (within `timeoutMs`, shorter than a lease) until the semaphore's Redis
 * state holds no live lease and no waiter, then prove the count exact: exactly `limit` permits
 * can be taken, not one more, and giving them back leaves nothing held.
 */
export async function expectExactPermits(
  raw: Redis,
  prefix: string,
  name: string,
  sem: Stage,
  limit: number,
  timeoutMs: number,
): Promise<void> {
  const holders = stageKey(prefix, name, "holders");
  const queue = stageKey(prefix, name, "queue");
  const left = async () => {
    const now = await serverNow(raw);
    const [[, live], [, waiting]] = (await raw
      .multi()
      .zcount(holders, `(${now}`, "+inf")
      .zcard(queue)
      .exec()) as [[unknown, number], [unknown, number]];
    return { now, live, waiting };
  };
  try {
    await until(
      async () => {
        const { live, waiting } = await left();
        return live === 0 && waiting === 0;
      },
      { timeoutMs, message: `a lease or a waiter of "${name}" was left behind in Redis after the fault` },
    );
  } catch (error) {
    // What was left, for the failure: each lease and waiter with the ms to its end (negative:
    // ended), and the stage's count.
    const { now } = await left();
    const ends = (flat: string[]) =>
      flat.flatMap((x, i) => (i % 2 === 0 ? [`${x} ${Number(flat[i + 1]) - now} ms`] : []));
    const state = {
      holders: ends(await raw.zrange(holders, 0, -1, "WITHSCORES")),
      queue: await raw.zrange(queue, 0, -1),
      waiterEnds: ends(await raw.zrange(stageKey(prefix, name, "qexp"), 0, -1, "WITHSCORES")),
      meta: await raw.hgetall(stageKey(prefix, name, "meta")),
    };
    throw new Error(`${(error as Error).message}: ${JSON.stringify(state)}`, { cause: error });
  }
  expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
  const taken: Ticket[] = [];
  for (let i = 0; i < limit; i++) {
    const ticket = await sem.tryAdmit();
    expect(ticket, `permit ${i + 1} of ${limit} after the fault`).toBeDefined();
    taken.push(ticket!);
  }
  expect(await sem.tryAdmit(), `a permit beyond the limit of ${limit}`).toBeUndefined();
  const meta = stageKey(prefix, name, "meta");
  expect(await raw.zcard(holders)).toBe(limit);
  expect(await raw.hget(meta, "used")).toBe(String(limit));
  await Promise.all(taken.map((t) => t.release("success")));
  expect(await raw.zcard(holders)).toBe(0);
  expect(await raw.hget(meta, "used")).toBe("0");
  expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
}

/**
 * The Redis backend a fault suite runs its load through: `main` for scripts, `subscriber` for
 * wake-ups, the suite's command timeout and `POLL_MS`; closed by `cleanups` (within 5 s).
 */
export function faultBackend(
  main: RedisClient,
  subscriber: RedisClient,
  prefix: string,
  cleanups: (() => unknown)[],
  commandTimeoutMs = COMMAND_TIMEOUT_MS,
): RedisBackend {
  const backend = redis(main, { prefix, subscriber, commandTimeoutMs, pollMs: POLL_MS });
  cleanups.push(() => within(backend.close(), 5_000, "backend.close()"));
  return backend;
}
