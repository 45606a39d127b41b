/**
 * One worker process of the fleet benchmark. On `run` it starts its callers at the given moment
 * (monotonic clock, shared by every process of the machine), each of which loops: admit, call the
 * provider, release, think; until the deadline. Then it reports counts and timings. It leaves by
 * itself when the parent says `exit` or goes away.
 */
import { Gate } from "floodgate";
import { redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { Semaphore } from "redis-semaphore";
import { Agent, request } from "undici";
import { PollingSemaphore } from "./poll-semaphore.js";
import { nowMs, serve, sleep, workerClient } from "./worker-child.js";

export type Mode =
  | "ceiling"
  | "none"
  | "floodgate"
  | "floodgate-gate"
  | "floodgate-chained"
  | "redis-semaphore"
  | "poll200"
  | "blpop";

export interface RunMessage {
  kind: "run";
  mode: Mode;
  providerUrl: string;
  prefix: string;
  /** Monotonic ms (process.hrtime) at which callers start, and how long they run. */
  startAt: number;
  durationMs: number;
  thinkMs: number;
  callers: number;
  cap: number;
  /** When set, count the callers waiting for admission every `sampleMs` from `startAt` (for a chart). */
  sampleMs?: number;
  /** When set (`--legs`), time each handoff's legs: see `RunReport.written` and `RunReport.heard`. */
  legs?: boolean;
}

export interface RunReport {
  kind: "done";
  /** Requests the callers sent the provider in the run, however they ended. */
  sent: number;
  ok: number;
  r429: number;
  errors: number;
  /** Admission waits, ms: of grants before the deadline, and of waits cut off by it (deadline − asked). */
  waits: number[];
  /** Waits cut off by the deadline (included in `waits` as lower bounds). */
  cutOff: number;
  /** Jobs answered 200 before the deadline, per caller. */
  perCaller: number[];
  /** Request durations (send to full answer) of 200s, ms. */
  services: number[];
  /** Think times slept, ms. */
  thinks: number[];
  /** With `sampleMs`: callers waiting for admission at `startAt + i × sampleMs`. */
  waiting?: number[];
  /**
   * Monotonic ms (shared by every process of the machine) of each grant before the deadline, and
   * of each release as it was called: the parent pairs them into handoffs.
   */
  grants: number[];
  releases: number[];
  /**
   * With `legs`: for each of `releases`, when this process wrote its next command to Redis (the
   * release's own, unless the other caller's went first; null when none did within 50 ms).
   */
  written?: (number | null)[];
  /**
   * With `legs`: for each of `grants`, when this process last heard from Redis on a connection it
   * waits on (a pub/sub message, or the BLPOP's reply) while its caller waited; null when none
   * came (the caller's own ask was answered with the grant).
   */
  heard?: (number | null)[];
}

const client = await workerClient();

/**
 * Handoff legs (`RunMessage.legs`): once a run asks for them, each command this process writes on
 * its client answers the releases waiting for one (`written`), and each message a connection of
 * its hears (pub/sub, on any ioredis client of the process) is the latest heard. (Not watched
 * before: runs without them measure the client as it is.)
 */
const legs = {
  /** The report of the run that times legs, while it runs. */
  report: undefined as RunReport | undefined,
  lastHeard: Number.NaN,
  /** Releases (their places in `report.written`) whose next command is still to be written. */
  pending: [] as number[],
};
let legsWatched = false;
function watchLegs(): void {
  if (legsWatched) return;
  legsWatched = true;
  const send = client.sendCommand.bind(client);
  client.sendCommand = ((...args: Parameters<typeof client.sendCommand>) => {
    const report = legs.report;
    if (report !== undefined && legs.pending.length > 0) {
      const at = nowMs();
      // (A command written more than 50 ms after a release is another's: that release wrote none.)
      for (const i of legs.pending) if (at - report.releases[i]! <= 50) report.written![i] = at;
      legs.pending.length = 0;
    }
    return send(...args);
  }) as typeof client.sendCommand;
  const proto = Object.getPrototypeOf(client) as { emit: (event: string, ...args: unknown[]) => boolean };
  const emit = proto.emit;
  proto.emit = function (this: unknown, event: string, ...args: unknown[]): boolean {
    if (event === "message" && legs.report !== undefined) legs.lastHeard = nowMs();
    return emit.call(this, event, ...args);
  };
}
const agent = new Agent({ keepAliveTimeout: 30_000, connections: 4 });

type Release = (status: number) => Promise<unknown>;
let backend: ReturnType<typeof redis> | undefined;

/** The admission of a mode: resolves to a release, or rejects when `signal` aborts first. */
function admission(m: RunMessage): {
  admit: (signal: AbortSignal) => Promise<Release>;
  close: () => Promise<void>;
} {
  switch (m.mode) {
    case "ceiling":
    case "none":
      return { admit: async () => async () => {}, close: async () => {} };
    case "floodgate": {
      // One backend for the worker's life, as a service keeps it; each run names a fresh stage.
      backend ??= redis(client, { prefix: "bench-fleet:" });
      const sem = backend.semaphore(m.prefix, { limit: m.cap, leaseMs: 15_000 });
      return {
        admit: async (signal) => {
          const t = await sem.admit({ signal });
          return (status) => t.release(status === 429 ? "dropped" : "success");
        },
        close: () => sem.close(),
      };
    }
    case "floodgate-gate":
    case "floodgate-chained": {
      // The llm scenario's gate: rpm and tpm buckets, the semaphore, AIMD, an interval gate.
      // Only the semaphore and AIMD bind (the buckets leave room above what 8 callers can do at
      // 5 ms calls, about 1,300 a second: 10,000 requests and 3,333 calls of 300 tokens a
      // second). The interval gate spaces calls 0 ms apart: any spacing binds when a release
      // grants several waiters at one instant, and each after the first then pays a round trip
      // (bench/RESULTS.md: at 5 ms calls, 43% of the ceiling with 0.1 ms, 53% with none).
      // Fused, in the scenario's order; "floodgate-chained" takes the stages one after another,
      // as a gate did before fusing, in the order docs/gate.md gives for that (the stages that
      // hold a call first, then the buckets, the interval gate last).
      backend ??= redis(client, { prefix: "bench-fleet:" });
      const rpm = backend.tokenBucket(`${m.prefix}rpm`, { capacity: 10_000, refillPerSecond: 10_000 });
      const tpm = backend.tokenBucket(`${m.prefix}tpm`, { capacity: 1_000_000, refillPerSecond: 1_000_000 });
      const sem = backend.semaphore(m.prefix, { limit: m.cap, leaseMs: 15_000 });
      const aimd = backend.aimd(`${m.prefix}aimd`, { initial: m.cap, min: 1, max: m.cap });
      const hosts = backend.intervalGate(`${m.prefix}hosts`, { minIntervalMs: 0, defaultHost: "provider" });
      const fused = m.mode === "floodgate-gate";
      const gate = new Gate(fused ? [rpm, tpm, sem, aimd, hosts] : [sem, aimd, rpm, tpm, hosts], {
        name: m.prefix,
        fuse: fused,
      });
      return {
        admit: async (signal) => {
          const t = await gate.admit({ signal, costs: { [`${m.prefix}tpm`]: 300 } });
          return (status) => t.release(status === 429 ? "dropped" : "success");
        },
        close: () => gate.close(),
      };
    }
    case "redis-semaphore":
      return {
        admit: async (signal) => {
          const sem = new Semaphore(client, `${m.prefix}fleet`, m.cap, {
            lockTimeout: 15_000,
            acquireTimeout: 600_000,
          });
          await sem.acquire(signal);
          return () => sem.release();
        },
        close: async () => {},
      };
    case "blpop": {
      // The handoff floor: a list of `cap` tokens in Redis, taken with BLPOP and given back with
      // LPUSH, each caller on a connection of its own (BLPOP holds it): Redis hands a freed token
      // to the longest-blocked caller in the same command. No lease, no fencing, nothing back
      // from a dead holder: what no Redis-coordinated limiter can beat on this machine.
      const list = `${m.prefix}tokens`;
      const idle: Redis[] = Array.from({ length: m.callers }, () => client.duplicate());
      const all = [...idle];
      const ready = Promise.all([
        ...all.map((c) => (c.status === "ready" ? undefined : new Promise((r) => c.once("ready", r)))),
        // (One worker puts the tokens in; the keys go an hour after the run: see close.)
        client.set(`${list}:made`, "1", "PX", 3_600_000, "NX").then(async (made) => {
          if (made === null) return;
          await client.rpush(list, ...Array.from({ length: m.cap }, (_, i) => String(i)));
          await client.pexpire(list, 3_600_000);
        }),
      ]);
      return {
        admit: async (signal) => {
          await ready;
          const conn = idle.pop()!;
          // (At the run's end a blocked caller's connection is cut: the list is the run's own.)
          const cut = () => conn.disconnect();
          signal.addEventListener("abort", cut, { once: true });
          let token: string;
          try {
            const got = await conn.blpop(list, 0);
            if (legs.report !== undefined) legs.lastHeard = nowMs();
            token = got![1];
          } catch (error) {
            throw signal.aborted ? signal.reason : error;
          } finally {
            signal.removeEventListener("abort", cut);
          }
          return async () => {
            await client.lpush(list, token);
            idle.push(conn);
          };
        },
        close: async () => {
          for (const c of all) c.disconnect();
          // (A list emptied during the run came back with a release, without its expiry.)
          await client.pexpire(list, 3_600_000);
        },
      };
    }
    case "poll200": {
      const sem = new PollingSemaphore(client, `${m.prefix}fleet`, m.cap);
      return {
        admit: (signal) => sem.acquire(signal),
        close: async () => {},
      };
    }
  }
}

async function run(m: RunMessage): Promise<RunReport> {
  const report: RunReport = {
    kind: "done",
    sent: 0,
    ok: 0,
    r429: 0,
    errors: 0,
    waits: [],
    cutOff: 0,
    perCaller: [],
    services: [],
    thinks: [],
    grants: [],
    releases: [],
    ...(m.legs ? { written: [], heard: [] } : {}),
  };
  if (m.legs) watchLegs();
  legs.report = m.legs ? report : undefined;
  legs.pending.length = 0;
  const gate = admission(m);
  // (Ungated callers have no admission to wait for, and no handoff.)
  const gated = m.mode !== "none" && m.mode !== "ceiling";
  const deadline = m.startAt + m.durationMs;
  const stop = new AbortController();
  await sleep(Math.max(0, m.startAt - nowMs()));
  const timer = setTimeout(() => stop.abort(new Error("deadline")), Math.max(0, deadline - nowMs()));
  let waiting = 0;
  if (m.sampleMs !== undefined) report.waiting = [];
  const sampler =
    m.sampleMs === undefined
      ? undefined
      : setInterval(() => {
          report.waiting![Math.round((nowMs() - m.startAt) / m.sampleMs!)] = waiting;
        }, m.sampleMs);
  const caller = async (index: number) => {
    report.perCaller[index] = 0;
    while (nowMs() < deadline) {
      const asked = nowMs();
      let release: Release;
      waiting++;
      try {
        release = await gate.admit(stop.signal);
      } catch (error) {
        if (!stop.signal.aborted) throw error;
        report.waits.push(deadline - asked);
        report.cutOff++;
        break;
      } finally {
        waiting--;
      }
      const granted = nowMs();
      if (gated) {
        report.waits.push(granted - asked);
        if (granted <= deadline) {
          report.grants.push(granted);
          report.heard?.push(legs.lastHeard >= asked ? legs.lastHeard : null);
        }
      }
      let status = 0;
      try {
        report.sent++;
        const res = await request(`${m.providerUrl}/work`, { dispatcher: agent });
        await res.body.dump();
        status = res.statusCode;
      } catch {
        report.errors++;
      }
      const done = nowMs();
      if (gated) {
        report.releases.push(done);
        if (report.written) {
          legs.pending.push(report.written.length);
          report.written.push(null);
        }
      }
      await release(status);
      if (done <= deadline) {
        if (status === 200) {
          report.ok++;
          report.perCaller[index]!++;
          report.services.push(done - granted);
        } else if (status === 429) report.r429++;
      }
      if (m.thinkMs > 0) {
        const t0 = nowMs();
        await sleep(m.thinkMs);
        report.thinks.push(nowMs() - t0);
      }
    }
  };
  try {
    await Promise.all(Array.from({ length: m.callers }, (_, i) => caller(i)));
  } finally {
    clearTimeout(timer);
    clearInterval(sampler);
    await gate.close();
    legs.report = undefined;
  }
  return report;
}

serve(run, () => Promise.all([agent.close(), backend?.close()]).finally(() => client.disconnect()));
