/**
 * Seed 001 — a worker fleet that autoscales, with bulk and interactive traffic on one provider
 * allowance.
 *
 * The provider allows `--allowance` requests per one-second window and reports the window on
 * every response (`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
 * `x-ratelimit-reset-requests`). A backlog of bulk items is drained by a fleet of replicas, each
 * running `--per-replica` jobs at once. The fleet starts with one replica; once a quarter of the
 * backlog is done the autoscaler sizes the fleet by backlog, capped at its ceiling: fleet-wide
 * bound / per-replica bound (above that a replica could not get a permit to use). Interactive
 * requests (a user waiting) arrive meanwhile from an API server, with a spike in the middle.
 *
 * Both kinds of traffic pass the same fleet-wide stages, each divided into two traffic classes:
 *
 *   semaphore (the fleet-wide in-flight bound) → token bucket (the per-second rate shared by
 *   the replicas and the API server) → interval gate, on bulk's side only (it holds bulk back)
 *
 * Interactive is guaranteed `--interactive-share` percent of the bound and of the rate, and goes
 * first when both borrow; bulk is guaranteed the rest. A class lends what it leaves idle, so bulk
 * alone uses the whole bound and the whole rate, and while interactive calls wait, the permits and
 * tokens bulk gives back are theirs. Bulk's share is small on purpose: a class within its
 * guarantee is served in arrival order with the others, so interactive goes ahead of bulk only
 * while bulk borrows. The bucket's burst plus one second of its refill stays under the provider's
 * window, so neither class runs into the provider's limit. Stages that hold a call come first,
 * those that meter its start after them (see examples/README.md).
 *
 * `--reserve N` is for a provider whose allowance is also spent by clients you do not control
 * (another team's service, a console): their calls pass none of your stages, so only the
 * provider's headers show what they took. With it, bulk's `wrapFetch` is given `reserve: {
 * remaining: N }`: once a response shows N or fewer requests left in the window, bulk pauses on
 * every replica until the window resets. A bulk call that the pause holds back keeps its permit,
 * so interactive then keeps half of its guarantee out of bulk's reach (`lendable: 0.5`). Off by
 * default: here every caller passes the classes, and they keep interactive's share without it.
 *
 * On Redis each replica and the API server have their own connection and their own stage
 * objects, sharing the semaphore, the bucket and bulk's pauses through Redis, as separate
 * processes would.
 *
 * The summary prints, for each phase, what the library measured and concluded: Little's law of
 * the fleet bound (`snapshot().flow`: throughput × service time = calls in flight, against the
 * bound) and `diagnose()`'s verdict on the replicas' gates, with the backlog left. The ceiling
 * is `autoscalerCeiling(bound, perReplica)`.
 *
 * Fails (exit 1) when an interactive request was refused, the fleet had more calls in flight than
 * its bound, the provider saw more than its cap, or work was not done.
 */
import { setMaxListeners } from "node:events";
import { autoscalerCeiling, type Backend, type Diagnosis, diagnose, Gate, memory } from "floodgate";
import { parseRateLimit, wrapFetch } from "floodgate/fetch";
import { redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { startChart, writeChart } from "./chart.js";
import { UsageError } from "./cli.js";
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
  "autoscaled fleet: fleet-wide bound and rate shared by interactive and bulk classes, Little's law check";

const COMMAND = exampleCommand(
  "autoscale",
  about,
  {
    items: { type: "int", default: 600, small: 200, help: "bulk items in the backlog" },
    allowance: { type: "int", default: 100, help: "provider requests per one-second window" },
    bound: { type: "int", default: 16, help: "fleet-wide calls in flight, both classes together" },
    "per-replica": { type: "int", default: 4, help: "jobs each replica runs at once" },
    "interactive-share": {
      type: "int",
      default: 80,
      help: "percent of the bound and of the rate guaranteed to interactive (bulk has the rest)",
    },
    reserve: {
      type: "int",
      min: 0,
      help: "bulk pauses until the window resets once a response shows this many requests left or fewer (for an allowance shared with clients you do not control)",
      defaultText: "off",
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
  [
    "REDIS_URL=redis://host:port: the replicas and the API server share the bound, the rate and bulk's pauses through Redis.",
  ],
);

type TrafficClass = "interactive" | "bulk";

/** A phase of the run (one replica, then as many as the autoscaler asked for) and its diagnosis. */
interface Phase {
  name: string;
  from: number;
  to: number;
  done: number;
  /** What `diagnose` said of the replicas' gates at the end of the phase. */
  diagnosis: Diagnosis | undefined;
}

/** What one class did: calls sent, their answers, their waits for admission, calls in flight. */
interface ClassStats {
  sent: number;
  ok: number;
  refused: number;
  waitsMs: number[];
  meter: LevelMeter;
  peak: number;
}

/** One call on its way: when it asked for admission, when it was sent, how long the provider took. */
interface Call {
  askedAt: number;
  sentAt: number;
  tookMs: number;
}

export async function main(argv: string[]): Promise<number> {
  const f = parseFlags(COMMAND, argv);
  if (!f) return 0;
  const { items, allowance, bound, "per-replica": perReplica, reserve } = f;
  const { "interactive-share": interactiveShare, "interactive-rate": interactiveRate } = f;
  const { "service-ms": serviceMs, "no-ceiling": noCeiling } = f;
  if (interactiveShare >= 100) {
    throw new UsageError(`--interactive-share must be a percent from 1 to 99 (got ${interactiveShare})`);
  }
  const cap = 3 * bound;
  const ceiling = autoscalerCeiling(bound, perReplica);
  // At most burst + rate requests start in any second (5 + 90 of a window of 100 by default); the
  // rest is left for calls that leave just before a window turns over and arrive just after.
  const burst = Math.max(1, Math.floor(allowance / 20));
  const rate = allowance * 0.9;

  const provider = await startProvider({
    cap,
    serviceMs,
    serviceJitterMs: serviceMs / 2,
    requestLimit: { limit: allowance, windowMs: 1000, kind: "fixed" },
  });

  // One backend per replica on Redis (a connection each, as separate processes would have); in
  // memory every replica shares the one backend of this process.
  const url = process.env.REDIS_URL;
  const prefix = newPrefix("autoscale");
  const clients: Redis[] = [];
  const shared = memory();
  const backends: Backend[] = [];
  const backendFor = async (): Promise<Backend> => {
    if (!url) return shared;
    const client = await connectRedis(url);
    clients.push(client);
    const b = redis(client, { prefix });
    backends.push(b);
    return b;
  };

  // Every process builds the stages with the same classes, as a fleet must.
  const bucketClasses = {
    interactive: { share: interactiveShare, priority: 1 },
    bulk: { share: 100 - interactiveShare },
  };
  // A bulk call held back by a reserve pause keeps its permit until the window resets: with a
  // reserve, half of interactive's guarantee is never lent: permits it can use while bulk waits.
  const permitClasses =
    reserve === undefined
      ? bucketClasses
      : { ...bucketClasses, interactive: { ...bucketClasses.interactive, lendable: 0.5 } };
  const fleetStages = (b: Backend) => [
    b.semaphore("fleet-inflight", { limit: bound, classes: permitClasses }),
    b.tokenBucket("fleet-rate", { capacity: burst, refillPerSecond: rate, classes: bucketClasses }),
  ];
  // Bulk's gate ends with an interval gate that spaces nothing: a pause on it (a reserve reached, a
  // Retry-After) holds back every bulk call about to leave, on every replica, and no interactive one.
  const replicaGate = (b: Backend, name: string) =>
    new Gate([...fleetStages(b), b.intervalGate("bulk-yield", { minIntervalMs: 0 })], { name });
  const apiGate = new Gate(fleetStages(await backendFor()), { name: "api" });

  process.stderr.write(
    `autoscale: ${url ? `redis ${url} (prefix ${prefix}); each replica and the API server have their own connection` : "memory; replicas and the API server share this process's backend"}` +
      `; provider ${allowance} requests per 1 s window, reports what is left; fleet bound ${bound}` +
      ` in flight and ${rate}/s (burst ${burst}), interactive guaranteed ${interactiveShare}% of each` +
      `; ${perReplica} jobs per replica, autoscaler ceiling ${ceiling}${noCeiling ? " (ignored)" : ""}` +
      `; ${reserve === undefined ? "no reserve" : `bulk pauses at ${reserve} left`}\n`,
  );

  const stop = new AbortController();
  setMaxListeners(0, stop.signal);
  const limit = deadline("autoscale", Math.max(40_000, (items / (allowance / 2)) * 1000 * 5));
  limit.signal.addEventListener("abort", () => stop.abort(limit.signal.reason), { once: true });

  const stats: Record<TrafficClass, ClassStats> = {
    interactive: { sent: 0, ok: 0, refused: 0, waitsMs: [], meter: new LevelMeter(), peak: 0 },
    bulk: { sent: 0, ok: 0, refused: 0, waitsMs: [], meter: new LevelMeter(), peak: 0 },
  };
  const fleet = new LevelMeter();
  let fleetPeak = 0;
  let yields = 0;
  let yieldingUntil = 0;
  let errors = 0;
  const calls = new Map<string, Call>();

  /**
   * A fetch for one class through `gate`. The fetch behind the gate runs once the call is admitted:
   * it notes the wait and counts the call in flight until its answer's headers are in (the
   * ticket is released then too).
   */
  function sender(gate: Gate, cls: TrafficClass) {
    const s = stats[cls];
    const timed: typeof fetch = async (input, init) => {
      const call = calls.get(input as string)!;
      call.sentAt = performance.now();
      s.sent++;
      s.meter.up();
      s.peak = Math.max(s.peak, s.meter.level);
      fleet.up();
      fleetPeak = Math.max(fleetPeak, fleet.level);
      try {
        const r = await fetch(input, init);
        if (reserve !== undefined && cls === "bulk") noteYield(r.headers);
        return r;
      } finally {
        call.tookMs = performance.now() - call.sentAt;
        s.meter.down();
        fleet.down();
      }
    };
    const gatedFetch = wrapFetch(
      gate,
      timed,
      reserve !== undefined && cls === "bulk" ? { reserve: { remaining: reserve } } : {},
    );
    return async (path: string): Promise<{ status: number; tookMs: number }> => {
      const target = `${provider.url}${path}`;
      const call: Call = { askedAt: performance.now(), sentAt: Number.NaN, tookMs: Number.NaN };
      calls.set(target, call);
      try {
        const r = await gatedFetch(target, { signal: stop.signal, floodgate: { class: cls } });
        await r.arrayBuffer();
        s.waitsMs.push(call.sentAt - call.askedAt);
        if (r.status === 200) s.ok++;
        else if (r.status === 429) s.refused++;
        return { status: r.status, tookMs: call.tookMs };
      } finally {
        calls.delete(target);
      }
    };
  }

  /** Count the pauses the reserve starts (one per window), as wrapFetch decides them. */
  function noteYield(headers: Headers): void {
    const w = parseRateLimit(headers, Date.now()).find((x) => x.name === "requests");
    if (!w || w.resetMs === undefined || w.resetMs <= 0 || w.remaining > reserve!) return;
    const until = performance.now() + w.resetMs;
    if (until > yieldingUntil + 10) yields++;
    yieldingUntil = Math.max(yieldingUntil, until);
  }

  const backlog = Array.from({ length: items }, (_, i) => i);
  let bulkDone = 0;
  const gates: Gate[] = [apiGate];
  const workers: Promise<void>[] = [];
  let replicas = 0;

  const phases: Phase[] = [];
  let phase: Phase = { name: "1 replica", from: performance.now(), to: 0, done: 0, diagnosis: undefined };
  /** End the phase: the library's diagnosis of the replicas' gates, with the work still waiting. */
  const endPhase = () => {
    phase.to = performance.now();
    phase.diagnosis = diagnose(gates.slice(1), { backlog: backlog.length });
    phases.push(phase);
  };

  async function bulkJob(send: (path: string) => Promise<{ status: number; tookMs: number }>) {
    while (!stop.signal.aborted) {
      const item = backlog.shift();
      if (item === undefined) return;
      try {
        const res = await send(`/bulk/${item}`);
        if (res.status === 200) {
          bulkDone++;
          phase.done++;
        } else {
          // A 429 has paused bulk for its Retry-After already; the item goes again after it.
          if (res.status !== 429) errors++;
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
    const gate = replicaGate(await backendFor(), `replica-${replicas}`);
    gates.push(gate);
    chart?.watch(gate);
    replicas++;
    const send = sender(gate, "bulk");
    for (let j = 0; j < perReplica; j++) workers.push(bulkJob(send));
  }

  // Interactive traffic: Poisson arrivals, four times faster while bulk is 40–60% done.
  const sendInteractive = sender(apiGate, "interactive");
  let interactiveAsked = 0;
  const interactiveCalls: Promise<void>[] = [];
  const spiking = () => bulkDone >= items * 0.4 && bulkDone < items * 0.6;
  const interactive = (async () => {
    while (!stop.signal.aborted && bulkDone < items) {
      const rate = spiking() ? 4 * interactiveRate : interactiveRate;
      await sleep(-Math.log(1 - Math.random()) * (1000 / rate), stop.signal).catch(() => {});
      if (stop.signal.aborted || bulkDone >= items) break;
      const n = interactiveAsked++;
      interactiveCalls.push(
        sendInteractive(`/interactive/${n}`).then(
          ({ status }) => {
            if (status !== 200 && status !== 429) errors++;
          },
          () => {
            if (!stop.signal.aborted) errors++;
          },
        ),
      );
    }
  })();

  // The provider's cap (3 × the bound) is far above the lines: the bound is the semaphore's limit.
  const chart = startChart(f.chart, {
    title: `autoscale [${url ? "redis" : "memory"}]: fleet bound ${bound}, ${rate}/s`,
  })
    ?.watch(apiGate)
    .watchProvider(provider);
  const started = performance.now();
  const ticker = progress(() => {
    const p = provider.stats();
    return (
      `bulk ${String(bulkDone).padStart(String(items).length)}/${items} · replicas ${replicas}` +
      ` · in flight ${fleet.level} (peak ${fleetPeak}/${bound}; bulk ${stats.bulk.meter.level}` +
      `, interactive ${stats.interactive.meter.level}) · interactive ${stats.interactive.ok}` +
      `${spiking() ? " (spike)" : ""}${reserve === undefined ? "" : ` · yields ${yields}`}` +
      ` · 429s ${p.rejected429} · ${secs(performance.now() - started)}`
    );
  });

  // The autoscaler: one replica until a quarter is done, then size by backlog, capped.
  await addReplica();
  let scaledTo = "";
  const autoscaler = (async () => {
    while (!stop.signal.aborted && bulkDone < items * 0.25) await sleep(50);
    if (stop.signal.aborted) return;
    const desired = Math.ceil(backlog.length / 25);
    const wanted = noCeiling ? desired : Math.min(desired, ceiling);
    endPhase();
    while (replicas < wanted) await addReplica();
    scaledTo = `1→${replicas} (backlog ${backlog.length} asks for ${desired}; ceiling ${bound}/${perReplica} = ${ceiling}${noCeiling ? ", ignored" : ""})`;
    phase = { name: `${replicas} replicas`, from: performance.now(), to: 0, done: 0, diagnosis: undefined };
  })();

  await autoscaler;
  // Workers finish once the backlog is empty (a worker started during scaling is in the list).
  for (let i = 0; i < workers.length; i++) await workers[i];
  endPhase();
  const elapsedMs = performance.now() - started;
  await interactive;
  await Promise.all(interactiveCalls);
  ticker.stop();
  limit.clear();
  await writeChart(chart);

  // The classes as the stages divide them (fleet-wide figures, also on Redis).
  const [permitStage, rateStage] = apiGate.stages;
  const permitClassesSeen = permitStage!.snapshot().classes!;
  const rateClassesSeen = rateStage!.snapshot().classes!;

  const p = provider.stats();
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

  const { interactive: inter, bulk } = stats;
  const failures: string[] = [];
  if (inter.refused > 0) failures.push(`${inter.refused} interactive requests refused (429)`);
  if (fleetPeak > bound) failures.push(`${fleetPeak} calls in flight, above the fleet bound of ${bound}`);
  if (p.peak > cap) failures.push(`provider saw ${p.peak} at once, above its cap of ${cap}`);
  if (bulkDone < items) failures.push(`${items - bulkDone} bulk items not done`);
  if (inter.ok < interactiveAsked)
    failures.push(`${interactiveAsked - inter.ok} interactive requests not served`);
  if (!noCeiling && replicas > ceiling)
    failures.push(`${replicas} replicas, above the ceiling of ${ceiling}`);
  if (errors > 0) failures.push(`${errors} calls failed`);
  if (stop.signal.aborted) failures.push((stop.signal.reason as Error).message);

  // Little's law and the constraint of each phase, as the library measured them (the replicas'
  // share of the fleet bound: throughput × service time against the concurrency they had).
  const little = phases.map((ph) => {
    const d = ph.diagnosis!;
    const inflight = d.stages.find((st) => st.name === "fleet-inflight")!;
    return `${ph.name} (${ph.done} done in ${secs(ph.to - ph.from)}): ${inflight.line} → ${d.constraint}: ${d.summary}`;
  });

  const classLine = (cls: TrafficClass) => {
    const s = stats[cls];
    const permits = permitClassesSeen[cls]!;
    const tokens = rateClassesSeen[cls]!;
    return (
      `${cls} (share ${cls === "interactive" ? interactiveShare : 100 - interactiveShare}%: ${permits.guarantee} of ${bound} permits` +
      `${permits.kept > 0 ? ` (${permits.kept} never lent)` : ""}, ${Math.round(tokens.guarantee)} of ${rate}/s` +
      `${permits.priority > 0 ? `; priority ${permits.priority}` : ""}) ${s.sent} calls` +
      `, wait p50 ${msText(quantile(s.waitsMs, 0.5))} p95 ${msText(quantile(s.waitsMs, 0.95))}` +
      `, 429s ${s.refused}, peak ${s.peak} in flight`
    );
  };

  process.stdout.write(
    `autoscale [${url ? "redis" : "memory"}]: bulk ${bulkDone}/${items} in ${secs(elapsedMs)} (${perSec(bulkDone, elapsedMs)})` +
      ` · interactive ${inter.ok}/${interactiveAsked}` +
      ` · provider peak ${p.peak}/${cap}, fleet peak ${fleetPeak}/${bound} in flight · 429s ${p.rejected429}` +
      ` (interactive ${inter.refused}, bulk ${bulk.refused}) · sheds 0` +
      ` · ${reserve === undefined ? "no reserve" : `bulk paused ${yields}× at ${reserve} left`}` +
      ` · replicas ${scaledTo ? scaledTo.split(" ")[0] : "1"}` +
      ` · ${failures.length === 0 ? "OK" : `FAILED: ${failures.join("; ")}`}\n` +
      `  classes: ${classLine("interactive")} · ${classLine("bulk")}\n` +
      `  autoscaler: ${scaledTo || "did not scale"}\n` +
      `  Little's law and the constraint, per phase:\n${little.map((l) => `    ${l}\n`).join("")}`,
  );
  return failures.length === 0 ? 0 : 1;
}
