/**
 * Seed 001 — a worker fleet that autoscales, with bulk and interactive traffic on one provider
 * allowance.
 *
 * The provider allows `--allowance` requests per one-second window and reports what is left on
 * every response (`x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests`). A backlog of
 * bulk items is drained by a fleet of replicas, each running `--per-replica` jobs at once. The
 * fleet starts with one replica; once a quarter of the backlog is done the autoscaler sizes the
 * fleet by backlog, capped at its ceiling: fleet-wide bound / per-replica bound (above that a
 * replica could not get a permit to use). Every replica's bulk calls pass one fleet-wide gate:
 *
 *   semaphore (the fleet-wide in-flight bound) → token bucket (the per-second rate shared by
 *   all replicas) → interval gate (no spacing; it holds bulk back while it yields)
 *
 * Stages that hold a call come first, those that meter its start after them (see
 * examples/README.md). A bulk call holds its permit while it waits for its token or for a pause
 * to end; every permit is a bulk job's, so that costs nothing here.
 *
 * Interactive requests (a user waiting) arrive meanwhile, with a spike in the middle, through
 * their own small semaphore. Bulk yields to them: when a response shows fewer than `--reserve`
 * requests left in the window, bulk pauses until the window resets, on every replica at once, so
 * the reserve stays free for interactive traffic.
 *
 * On Redis each replica has its own connection and its own stage objects, sharing the bucket,
 * the semaphore and the pause through Redis, as separate processes would.
 *
 * The summary checks Little's law for each phase: throughput × service time = calls in flight,
 * compared with the concurrency the fleet had. Equal: the fleet is the constraint (scale out).
 * Less: the shared rate is the constraint (more replicas will not help).
 *
 * Fails (exit 1) when an interactive request was refused, the fleet had more bulk calls in
 * flight than its bound, the provider saw more than its cap, or work was not done.
 */
import { setMaxListeners } from "node:events";
import { type Backend, Gate, memory } from "floodgate";
import { redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import {
  connectRedis,
  deadline,
  deleteKeys,
  exampleCommand,
  LevelMeter,
  msText,
  newPrefix,
  parseFlags,
  perSec,
  progress,
  quantile,
  secs,
  sleep,
} from "./common.js";
import { startProvider } from "./provider.js";

export const about =
  "autoscaled fleet: fleet-wide bound and rate, bulk yielding to interactive, Little's law check";

const COMMAND = exampleCommand(
  "autoscale",
  about,
  {
    items: { type: "int", default: 600, small: 200, help: "bulk items in the backlog" },
    allowance: { type: "int", default: 100, help: "provider requests per one-second window" },
    bound: { type: "int", default: 16, help: "fleet-wide bulk calls in flight" },
    "per-replica": { type: "int", default: 4, help: "jobs each replica runs at once" },
    reserve: {
      type: "int",
      default: 40,
      min: 0,
      help: "requests left in the window below which bulk yields",
    },
    "interactive-rate": {
      type: "number",
      default: 10,
      min: 0.1,
      help: "interactive requests per second; four times that during the spike",
    },
    "service-ms": {
      type: "int",
      default: 100,
      min: 0,
      help: "provider answer time, plus up to half of it at random",
    },
    "no-ceiling": { type: "boolean", help: "let the autoscaler go past bound / per-replica" },
  },
  ["REDIS_URL=redis://host:port: the replicas share the bucket, bound and pauses through Redis."],
);

interface Phase {
  name: string;
  from: number;
  to: number;
  done: number;
  serviceMs: number[];
  concurrency: number;
  meanInFlight: number;
}

export async function main(argv: string[]): Promise<number> {
  const f = parseFlags(COMMAND, argv);
  if (!f) return 0;
  const { items, allowance, bound, "per-replica": perReplica, reserve } = f;
  const { "interactive-rate": interactiveRate, "service-ms": serviceMs, "no-ceiling": noCeiling } = f;
  const cap = 3 * bound;
  const ceiling = Math.max(1, Math.floor(bound / perReplica));

  const provider = await startProvider({
    cap,
    serviceMs,
    serviceJitterMs: serviceMs / 2,
    requestLimit: { limit: allowance, windowMs: 1000, kind: "fixed" },
  });
  const host = new URL(provider.url).host;

  // One backend per replica on Redis (a connection each, as separate processes would have); in
  // memory every replica shares the one backend of this process.
  const url = process.env.REDIS_URL;
  const prefix = newPrefix("autoscale");
  const clients: Redis[] = [];
  const shared = memory();
  const backendFor = async (): Promise<Backend> => {
    if (!url) return shared;
    const client = await connectRedis(url);
    clients.push(client);
    return redis(client, { prefix });
  };
  const backends: Backend[] = [];
  const bulkGate = (b: Backend, name: string) =>
    new Gate(
      [
        // Stages that hold the call first, then those that meter its start: the rate token is
        // taken by a call that already holds its permit, so nothing after the bucket but the
        // pause can make it wait, and the fleet's rate holds for the calls' starts.
        b.semaphore("fleet-inflight", { limit: bound }),
        b.tokenBucket("fleet-rate", { capacity: 10, refillPerSecond: allowance }),
        // Last, right before the call, so that a pause holds back every bulk call about to leave.
        b.intervalGate("bulk-yield", { minIntervalMs: 0 }),
      ],
      { name },
    );

  const interactiveBackend = await backendFor();
  backends.push(interactiveBackend);
  const interactiveGate = new Gate([interactiveBackend.semaphore("interactive-inflight", { limit: 8 })], {
    name: "interactive",
  });

  process.stderr.write(
    `autoscale: ${url ? `redis ${url} (prefix ${prefix}); each replica has its own connection` : "memory; replicas share this process's backend"}` +
      `; provider ${allowance} requests per 1 s window, reports what is left; fleet bound ${bound}` +
      ` in flight, ${perReplica} jobs per replica, autoscaler ceiling ${ceiling}${noCeiling ? " (ignored)" : ""}` +
      `; bulk yields below ${reserve} left\n`,
  );

  const stop = new AbortController();
  setMaxListeners(0, stop.signal);
  const limit = deadline("autoscale", Math.max(40_000, (items / (allowance / 2)) * 1000 * 5));
  limit.signal.addEventListener("abort", () => stop.abort(limit.signal.reason), { once: true });

  const backlog = Array.from({ length: items }, (_, i) => i);
  const bulkMeter = new LevelMeter();
  let bulkPeak = 0;
  let bulkDone = 0;
  let bulk429 = 0;
  let yields = 0;
  let yieldingUntil = 0;
  let errors = 0;
  const gates: Gate[] = [];
  const workers: Promise<void>[] = [];
  let replicas = 0;
  let wanted = 1;

  const phases: Phase[] = [];
  let phase: Phase = {
    name: "1 replica",
    from: performance.now(),
    to: 0,
    done: 0,
    serviceMs: [],
    concurrency: perReplica,
    meanInFlight: 0,
  };

  async function bulkJob(gate: Gate): Promise<void> {
    while (!stop.signal.aborted) {
      const item = backlog.shift();
      if (item === undefined) return;
      try {
        const res = await gate.run(
          async (ticket) => {
            bulkMeter.up();
            bulkPeak = Math.max(bulkPeak, bulkMeter.level);
            const t = performance.now();
            try {
              const r = await fetch(`${provider.url}/bulk/${item}`, {
                signal: AbortSignal.any([ticket.signal, stop.signal]),
              });
              await r.arrayBuffer();
              const tookMs = performance.now() - t;
              const left = Number(r.headers.get("x-ratelimit-remaining-requests"));
              const resetMs = Number.parseInt(r.headers.get("x-ratelimit-reset-requests") ?? "", 10);
              if (Number.isFinite(left) && left < reserve && resetMs > 0) {
                // Yield to interactive traffic: no bulk call on any replica until the window resets.
                const until = performance.now() + resetMs;
                if (until > yieldingUntil + 10) yields++;
                yieldingUntil = Math.max(yieldingUntil, until);
                await gate.pause(host, resetMs);
              }
              return { status: r.status, tookMs };
            } finally {
              bulkMeter.down();
            }
          },
          { host, signal: stop.signal },
        );
        if (res.status === 200) {
          bulkDone++;
          phase.done++;
          phase.serviceMs.push(res.tookMs);
        } else {
          if (res.status === 429) bulk429++;
          else errors++;
          backlog.unshift(item);
        }
      } catch (error) {
        if (stop.signal.aborted) return;
        errors++;
        backlog.push(item);
        process.stderr.write(`\nautoscale: bulk ${item} failed: ${(error as Error).message}\n`);
        await sleep(100);
      }
    }
  }

  async function addReplica(): Promise<void> {
    const b = await backendFor();
    if (url) backends.push(b);
    const gate = bulkGate(b, `replica-${replicas}`);
    gates.push(gate);
    replicas++;
    for (let j = 0; j < perReplica; j++) workers.push(bulkJob(gate));
  }

  // Interactive traffic: Poisson arrivals, four times faster while bulk is 40–60% done.
  let interactiveSent = 0;
  let interactiveOk = 0;
  let interactive429 = 0;
  const interactiveMs: number[] = [];
  const interactiveCalls: Promise<void>[] = [];
  const spiking = () => bulkDone >= items * 0.4 && bulkDone < items * 0.6;
  const interactive = (async () => {
    while (!stop.signal.aborted && bulkDone < items) {
      const rate = spiking() ? 4 * interactiveRate : interactiveRate;
      await sleep(-Math.log(1 - Math.random()) * (1000 / rate), stop.signal).catch(() => {});
      if (stop.signal.aborted || bulkDone >= items) break;
      const n = interactiveSent++;
      const t = performance.now();
      interactiveCalls.push(
        interactiveGate
          .run(
            async () => {
              const r = await fetch(`${provider.url}/interactive/${n}`, { signal: stop.signal });
              await r.arrayBuffer();
              return { status: r.status };
            },
            { signal: stop.signal },
          )
          .then(
            ({ status }) => {
              if (status === 200) {
                interactiveOk++;
                interactiveMs.push(performance.now() - t);
              } else if (status === 429) interactive429++;
              else errors++;
            },
            () => {
              if (!stop.signal.aborted) errors++;
            },
          ),
      );
    }
  })();

  const started = performance.now();
  const ticker = progress(() => {
    const p = provider.stats();
    return (
      `bulk ${String(bulkDone).padStart(String(items).length)}/${items} · replicas ${replicas}` +
      ` · bulk in flight ${bulkMeter.level} (peak ${bulkPeak}/${bound}) · interactive ${interactiveOk}` +
      `${spiking() ? " (spike)" : ""} · yields ${yields} · 429s ${p.rejected429}` +
      ` · ${secs(performance.now() - started)}`
    );
  });

  // The autoscaler: one replica until a quarter is done, then size by backlog, capped.
  await addReplica();
  let scaledTo = "";
  const autoscaler = (async () => {
    while (!stop.signal.aborted && bulkDone < items * 0.25) await sleep(50);
    if (stop.signal.aborted) return;
    const desired = Math.ceil(backlog.length / 25);
    wanted = noCeiling ? desired : Math.min(desired, ceiling);
    phase.to = performance.now();
    phase.meanInFlight = bulkMeter.mean();
    phases.push(phase);
    bulkMeter.restart();
    while (replicas < wanted) await addReplica();
    scaledTo = `1→${replicas} (backlog ${backlog.length} asks for ${desired}; ceiling ${bound}/${perReplica} = ${ceiling}${noCeiling ? ", ignored" : ""})`;
    phase = {
      name: `${replicas} replicas`,
      from: performance.now(),
      to: 0,
      done: 0,
      serviceMs: [],
      concurrency: Math.min(bound, replicas * perReplica),
      meanInFlight: 0,
    };
  })();

  await autoscaler;
  // Workers finish once the backlog is empty (a worker started during scaling is in the list).
  for (let i = 0; i < workers.length; i++) await workers[i];
  phase.to = performance.now();
  phase.meanInFlight = bulkMeter.mean();
  phases.push(phase);
  const elapsedMs = performance.now() - started;
  await interactive;
  await Promise.all(interactiveCalls);
  ticker.stop();
  limit.clear();

  const p = provider.stats();
  await interactiveGate.close();
  for (const g of gates) await g.close();
  await provider.close();
  if (url) {
    for (const b of backends) await b.close();
    for (const c of clients) await c.quit().catch(() => c.disconnect());
    const client = await connectRedis(url);
    await deleteKeys(client, prefix);
    await client.quit();
  } else {
    await shared.close();
  }

  const failures: string[] = [];
  if (interactive429 > 0) failures.push(`${interactive429} interactive requests refused (429)`);
  if (bulkPeak > bound) failures.push(`${bulkPeak} bulk calls in flight, above the fleet bound of ${bound}`);
  if (p.peak > cap) failures.push(`provider saw ${p.peak} at once, above its cap of ${cap}`);
  if (bulkDone < items) failures.push(`${items - bulkDone} bulk items not done`);
  if (interactiveOk < interactiveSent)
    failures.push(`${interactiveSent - interactiveOk} interactive requests not served`);
  if (!noCeiling && replicas > ceiling)
    failures.push(`${replicas} replicas, above the ceiling of ${ceiling}`);
  if (errors > 0) failures.push(`${errors} calls failed`);
  if (stop.signal.aborted) failures.push((stop.signal.reason as Error).message);

  const little = phases.map((ph) => {
    const spanMs = ph.to - ph.from;
    const lambda = ph.done / (spanMs / 1000);
    const w = ph.serviceMs.reduce((n, x) => n + x, 0) / Math.max(1, ph.serviceMs.length) / 1000;
    const l = lambda * w;
    const bound =
      l >= 0.85 * ph.concurrency
        ? "fleet-bound: more replicas help"
        : "rate-bound: more replicas will not help";
    return (
      `${ph.name}: ${lambda.toFixed(1)}/s × ${w.toFixed(3)} s = ${l.toFixed(1)} in flight` +
      ` (measured ${ph.meanInFlight.toFixed(1)}) of ${ph.concurrency} → ${bound}`
    );
  });

  process.stdout.write(
    `autoscale [${url ? "redis" : "memory"}]: bulk ${bulkDone}/${items} in ${secs(elapsedMs)} (${perSec(bulkDone, elapsedMs)})` +
      ` · interactive ${interactiveOk}/${interactiveSent}, p95 ${msText(quantile(interactiveMs, 0.95))}` +
      ` · provider peak ${p.peak}/${cap}, bulk peak ${bulkPeak}/${bound} · 429s ${p.rejected429}` +
      ` (interactive ${interactive429}, bulk ${bulk429}) · sheds 0 · bulk yielded ${yields}× below ${reserve} left` +
      ` · replicas ${scaledTo ? scaledTo.split(" ")[0] : "1"}` +
      ` · ${failures.length === 0 ? "OK" : `FAILED: ${failures.join("; ")}`}\n` +
      `  autoscaler: ${scaledTo || "did not scale"}\n` +
      `  Little's law: ${little.join(" · ")}\n`,
  );
  return failures.length === 0 ? 0 : 1;
}
