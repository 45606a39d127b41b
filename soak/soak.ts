/**
 * A bounded soak of the Redis backend: thousands of admissions through a Redis Gate (semaphore,
 * AIMD, token bucket) from three connections (standing for three processes), with random aborts
 * and timeouts, while Redis is hit with faults (SCRIPT FLUSH, killed client connections, a paused
 * server). At the end no lease, waiter or listener may be left behind, the cap must have held,
 * and memory must be flat.
 *
 *   npm run soak -- --seconds 180     (CI runs --seconds 10)
 */
import { once } from "node:events";
import { Gate, isFloodgateError, type Stage } from "floodgate";
import { redis } from "floodgate/redis";
import { Redis } from "ioredis";
import { benchRedis } from "../bench/redis-server.js";
import { command, parseOrExit } from "../examples/cli.js";

const { values } = parseOrExit(
  command({
    name: "soak",
    synopsis: "npm run soak -- [flags]",
    about:
      "A bounded soak of the Redis backend: admissions through a Redis gate (semaphore, AIMD, token\n" +
      "bucket) from three connections with random aborts and timeouts, while Redis is hit with faults.\n" +
      "Starts its own redis-server (or uses REDIS_URL). Exits 1 when the cap broke, a lease, waiter or\n" +
      "listener was left behind, or memory grew.",
    flags: {
      seconds: { type: "number", default: 60, min: 1, help: "how long the callers run" },
      limit: { type: "int", default: 4, help: "the semaphore's permits (and AIMD's ceiling)" },
      faults: {
        type: "boolean",
        default: true,
        negatable: true,
        help: "inject SCRIPT FLUSH, CLIENT KILL and CLIENT PAUSE while the callers run",
      },
    },
  }),
);
const { seconds, limit } = values;
const server = await benchRedis();
const prefix = `soak:${process.pid}:`;
const options = { enableOfflineQueue: false, maxRetriesPerRequest: 0, retryStrategy: () => 20 } as const;

const clients: Redis[] = [];
const gates: Gate[] = [];
const inflight = { now: 0, peak: 0 };
for (let i = 0; i < 3; i++) {
  const client = new Redis(server.url, options);
  client.on("error", () => {});
  await once(client, "ready");
  clients.push(client);
  const b = redis(client, { prefix, commandTimeoutMs: 500, pollMs: 200 });
  // Stages that hold a call first, the one that meters its start last.
  const stages: Stage[] = [
    b.semaphore("inflight", { limit, leaseMs: 2_000 }),
    b.aimd("adaptive", { initial: limit, max: limit }),
    b.tokenBucket("rate", { capacity: 50, refillPerSecond: 2000 }),
  ];
  gates.push(new Gate(stages, { name: `gate-${i}` }));
}
const admin = new Redis(server.url, { retryStrategy: () => 20 });
admin.on("error", () => {});

const counts = { ok: 0, aborted: 0, timedOut: 0, unavailable: 0, other: 0, listenersLeft: 0 };
let stop = false;
const deadline = performance.now() + seconds * 1000;

/** One caller: loop admissions with random aborts and timeouts until the deadline. */
async function caller(gate: Gate): Promise<void> {
  while (!stop && performance.now() < deadline) {
    const controller = new AbortController();
    let listeners = 0;
    const signal = controller.signal;
    const add = signal.addEventListener.bind(signal);
    const remove = signal.removeEventListener.bind(signal);
    signal.addEventListener = ((t: string, l: never, o?: never) => {
      listeners++;
      add(t, l, o);
    }) as typeof signal.addEventListener;
    signal.removeEventListener = ((t: string, l: never, o?: never) => {
      listeners--;
      remove(t, l, o);
    }) as typeof signal.removeEventListener;
    const r = Math.random();
    const abortTimer = r < 0.1 ? setTimeout(() => controller.abort(), Math.random() * 20) : undefined;
    try {
      await gate.run(
        async () => {
          inflight.now++;
          inflight.peak = Math.max(inflight.peak, inflight.now);
          await new Promise((res) => setTimeout(res, Math.random() * 5));
          inflight.now--;
          return Math.random() < 0.02 ? { status: 429 } : { status: 200 };
        },
        { signal, timeoutMs: r > 0.9 ? 5 : 2_000 },
      );
      counts.ok++;
    } catch (error) {
      if (signal.aborted && error === signal.reason) counts.aborted++;
      else if (isFloodgateError(error, "ADMIT_TIMEOUT")) counts.timedOut++;
      else if (isFloodgateError(error, "BACKEND_UNAVAILABLE")) {
        counts.unavailable++;
        await new Promise((r) => setTimeout(r, 20)); // a caller backs off while Redis is away
      } else {
        counts.other++;
        if (counts.other < 5) console.error(error);
      }
    } finally {
      clearTimeout(abortTimer);
      if (!signal.aborted && listeners !== 0) counts.listenersLeft++;
    }
  }
}

/** Faults, one every second or so, while the callers run. */
async function faults(): Promise<string[]> {
  const done: string[] = [];
  while (values.faults && !stop && performance.now() < deadline - 3000) {
    await new Promise((r) => setTimeout(r, 700 + Math.random() * 600));
    const f = Math.floor(Math.random() * 3);
    try {
      if (f === 0) await admin.script("FLUSH");
      else if (f === 1) await admin.client("KILL", "TYPE", "normal", "SKIPME", "yes");
      else await admin.client("PAUSE", 300);
      done.push(["SCRIPT FLUSH", "CLIENT KILL", "CLIENT PAUSE 300"][f]!);
    } catch {
      // The admin connection was killed too; it reconnects.
    }
  }
  return done;
}

global.gc?.();
const heapStart = process.memoryUsage().heapUsed;
const started = performance.now();
const [injected] = await Promise.all([
  faults(),
  ...gates.flatMap((g) => [caller(g), caller(g), caller(g), caller(g)]),
]);
stop = true;
const elapsed = (performance.now() - started) / 1000;
// Let leases of calls cut off by faults run out, then check what Redis still holds.
await new Promise((r) => setTimeout(r, 2_500));
for (const g of gates) await g.close();
global.gc?.();
const heapEnd = process.memoryUsage().heapUsed;
const holders = await admin.zcard(`${prefix}{inflight}:holders`);
// Waiters cut off mid-fault leave entries that expire (and are dropped at the next contention).
const queue = await admin.zcount(`${prefix}{inflight}:qexp`, `(${Date.now()}`, "+inf");
// Leases left by calls cut off mid-fault are only reaped when they stand in the way.
const live = await admin.zcount(`${prefix}{inflight}:holders`, `(${Date.now()}`, "+inf");
const total = counts.ok + counts.aborted + counts.timedOut + counts.unavailable + counts.other;
console.log(
  `soak ${elapsed.toFixed(0)} s: ${total} calls (${counts.ok} ok, ${counts.aborted} aborted, ${counts.timedOut} timed out, ` +
    `${counts.unavailable} failed closed, ${counts.other} other) · faults ${injected.length} ` +
    `(${[...new Set(injected)].join(", ")}) · peak in flight ${inflight.peak}/${limit} · ` +
    `live leases left ${live}, waiters left ${queue} · listeners left ${counts.listenersLeft} · ` +
    `heap ${(heapStart / 1e6).toFixed(1)} → ${(heapEnd / 1e6).toFixed(1)} MB`,
);
for (const c of clients) c.disconnect();
admin.disconnect();
await server.stop();
const failed =
  inflight.peak > limit ||
  live > 0 ||
  queue > 0 ||
  counts.listenersLeft > 0 ||
  counts.other > 0 ||
  counts.ok === 0 ||
  (global.gc !== undefined && heapEnd > heapStart * 1.5 + 5e6);
if (holders > 0)
  console.log(`(${holders} expired leases of cut-off calls wait to be reaped at the next full house)`);
process.exit(failed ? 1 : 0);
