/**
 * Seed 003 — supplier feed ingestion with backpressure.
 *
 * A producer reads a feed of records from four suppliers and hands each to its supplier's gate
 * (`gate.enqueue`). Every supplier's gate is
 *
 *   bounded queue (block the producer, or --shed; shared) → the supplier's share of the pool →
 *   semaphore (the downstream pool; shared) → token bucket (key = supplier, with a penalty after
 *   a 429; shared)
 *
 * Holding stages first, the rate last, so the rate holds for when records are sent; a record
 * holds its permits while it waits for its supplier's token, which is why each supplier has its
 * own share of the pool. Each supplier is its own local server with its own quota. All four
 * were contracted at the same rate, but one (acme) now allows less: its 429s cut its bucket's
 * refill rate (the penalty), which then climbs back, so it is slowed instead of hammered. A
 * record answered 429 is submitted again.
 *
 * The progress line and the summary show the four numbers that localise a bottleneck, from the
 * stages' snapshots: queue depth, token wait, permit wait, and shed count.
 *
 * Fails (exit 1) when the pool's bound was broken (more in flight across the suppliers than the
 * semaphore allows), the queue held more than its size, a supplier within its quota answered
 * 429, a record was lost (block: every record delivered; --shed: delivered + shed = produced),
 * or the penalised supplier kept being refused (more than a quarter of its calls).
 */
import { setMaxListeners } from "node:events";
import { diagnose, Gate, type Job, ShedError } from "floodgate";
import { startChart, writeChart } from "./chart.js";
import {
  deadline,
  exampleCommand,
  newPrefix,
  openBackend,
  parseFlags,
  perSec,
  progress,
  secs,
  sleep,
  where,
} from "./common.js";
import { type Provider, providerGroup, startProvider } from "./provider.js";

export const about =
  "supplier feed: bounded queue (block or --shed), per-supplier buckets with a 429 penalty, the four numbers";

const COMMAND = exampleCommand(
  "ingest",
  about,
  {
    records: { type: "int", default: 400, small: 120, help: "records in the feed" },
    "feed-rate": { type: "number", default: 200, min: 1, help: "records per second the feed offers" },
    queue: { type: "int", default: 40, help: "bounded queue size" },
    shed: { type: "boolean", help: "shed records when the queue is full instead of blocking the producer" },
    pool: {
      type: "int",
      default: 12,
      help: "records in flight at once over every supplier; each supplier at most pool / 4, rounded up",
    },
    rate: { type: "number", default: 20, min: 0.1, help: "contracted requests per second per supplier" },
    "service-ms": {
      type: "int",
      default: 100,
      min: 0,
      help: "supplier answer time, plus up to half of it at random",
    },
  },
  ["REDIS_URL=redis://host:port: share the queue, the pool and its shares, and the buckets through Redis."],
);

interface Supplier {
  id: string;
  /** Requests per second it really allows. */
  quota: number;
  server?: Provider;
  produced: number;
  delivered: number;
  rejected: number;
  shed: number;
  /** When its last record was delivered (performance.now()). */
  lastAt: number;
}

export async function main(argv: string[]): Promise<number> {
  const f = parseFlags(COMMAND, argv);
  if (!f) return 0;
  const { records, "feed-rate": feedRate, queue: queueSize, shed: shedMode, pool, rate } = f;
  const serviceMs = f["service-ms"];

  // Three suppliers allow a bit more than the contract; acme now allows 60% of it.
  const suppliers: Supplier[] = [
    { id: "acme", quota: rate * 0.6 },
    { id: "globex", quota: rate * 1.25 },
    { id: "initech", quota: rate * 1.25 },
    { id: "umbrella", quota: rate * 1.25 },
  ].map((s) => ({ ...s, produced: 0, delivered: 0, rejected: 0, shed: 0, lastAt: 0 }));
  const group = providerGroup();
  const burst = Math.max(2, Math.round(rate / 4));
  for (const s of suppliers) {
    // Each supplier's quota: a bucket of twice the client's burst, refilled at `quota` per second.
    s.server = await startProvider({
      cap: 10_000,
      serviceMs,
      serviceJitterMs: serviceMs / 2,
      requestLimit: { limit: 2 * burst, windowMs: (2 * burst * 1000) / s.quota },
      group,
    });
  }

  const handle = await openBackend(newPrefix("ingest"));
  const b = handle.backend;
  // Stages that hold a record come first (the queue, the supplier's share of the pool, the pool),
  // the supplier's rate last, so it holds for when records are sent. A record therefore holds its
  // permits while it waits for its supplier's token: with one pool for all, the slowest supplier's
  // records (acme, penalised) would fill it waiting for acme's tokens and hold every other
  // supplier to acme's pace. So each supplier gets its own share of the pool (a gate each, sharing
  // the queue, the pool and the keyed bucket): acme's records wait on acme's share.
  const queue = b.queue("ingest-queue", { maxSize: queueSize, whenFull: shedMode ? "shed" : "block" });
  const inflight = b.semaphore("ingest-inflight", { limit: pool });
  const supplierRate = b.tokenBucket("supplier-rate", {
    keyed: true,
    capacity: burst,
    refillPerSecond: rate,
    penalty: { factor: 0.5, recoveryMs: 5_000, minFactor: 0.25 },
  });
  const share = Math.max(1, Math.ceil(pool / suppliers.length));
  const shares = suppliers.map((s) => b.semaphore(`ingest-share-${s.id}`, { limit: share }));
  const gates = new Map(
    suppliers.map((s, i) => [
      s.id,
      new Gate([queue, shares[i]!, inflight, supplierRate], { name: `ingest-${s.id}` }),
    ]),
  );
  /** The four numbers, from the stages (every supplier's gate shares the queue, pool and bucket). */
  const four = () => {
    const q = queue.snapshot();
    return {
      queueDepth: q.queueDepth,
      queueWaitMs: q.queueWaitMs,
      shed: q.shed,
      tokenWaitMs: supplierRate.snapshot().tokenWaitMs,
      permitWaitMs: [inflight, ...shares].reduce((n, st) => n + st.snapshot().permitWaitMs, 0),
    };
  };
  process.stderr.write(
    `ingest: ${where(handle)}; ${records} records at ${feedRate}/s into a queue of ${queueSize} ` +
      `(${shedMode ? "shed" : "block"} when full); ${suppliers.length} suppliers contracted at ${rate}/s each, ` +
      `acme now allows ${suppliers[0]!.quota}/s; pool ${pool}, at most ${share} per supplier\n`,
  );

  const stop = new AbortController();
  setMaxListeners(0, stop.signal);
  const limit = deadline("ingest", Math.max(30_000, (records / (rate * 2)) * 1000 * 10));
  limit.signal.addEventListener("abort", () => stop.abort(limit.signal.reason), { once: true });

  let outstanding = 0;
  let producing = true;
  let failed = 0;
  /** Why the first record failed, for the summary. */
  let firstFailure = "";
  const fail = (why: string) => {
    failed++;
    firstFailure ||= why;
  };
  let maxDepth = 0;
  let allDone: () => void = () => {};
  const finished = new Promise<void>((resolve) => {
    allDone = resolve;
  });
  const settleOne = () => {
    outstanding--;
    if (!producing && outstanding === 0) allDone();
  };

  const deliver = async (ticketSignal: AbortSignal, s: Supplier, n: number) => {
    const res = await fetch(`${s.server!.url}/records/${n}`, {
      method: "POST",
      body: JSON.stringify({ supplier: s.id, n }),
      signal: AbortSignal.any([ticketSignal, stop.signal]),
    });
    await res.arrayBuffer();
    // A 429 is released as `dropped` (the default classify), which penalises this supplier's key.
    return { status: res.status };
  };

  /** Hand one record to the gate; resolves once it is queued (or shed). */
  async function submit(s: Supplier, n: number): Promise<void> {
    let job: Job<{ status: number }>;
    try {
      job = await gates
        .get(s.id)!
        .enqueue((ticket) => deliver(ticket.signal, s, n), { key: s.id, signal: stop.signal });
    } catch (error) {
      if (error instanceof ShedError) {
        // Shed records go to the dead-letter path; here they are counted.
        s.shed++;
      } else if (!stop.signal.aborted) {
        fail((error as Error).message);
      }
      settleOne();
      return;
    }
    job.done.then(
      ({ status }) => {
        if (status === 429) {
          s.rejected++;
          // Submitted again: it waits in line behind the records already queued.
          void submit(s, n);
          return;
        }
        if (status === 200) {
          s.delivered++;
          s.lastAt = performance.now();
        } else fail(`${s.id} answered ${status}`);
        settleOne();
      },
      (error: unknown) => {
        if (!stop.signal.aborted) fail((error as Error).message);
        settleOne();
      },
    );
  }

  const started = performance.now();
  const sampler = setInterval(() => {
    maxDepth = Math.max(maxDepth, queue.snapshot().queueDepth);
  }, 5);
  const fourText = () => {
    const s = four();
    return (
      `queue depth ${s.queueDepth}/${queueSize} · token wait ${secs(s.tokenWaitMs)}` +
      ` · permit wait ${secs(s.permitWaitMs)} · shed ${s.shed}`
    );
  };
  const chart = startChart(f.chart, {
    title: `ingest [${handle.mode}]: ${suppliers.length} suppliers, queue ${queueSize} (${shedMode ? "shed" : "block"}), pool ${pool}`,
  })?.watch(...gates.values());
  // The suppliers' servers as one: in flight across them (the group), and their 429s.
  const rejected429 = () => suppliers.reduce((n, s) => n + s.server!.stats().rejected429, 0);
  chart?.watchProvider({ stats: () => ({ ...group, rejected429: rejected429() }) }, "suppliers");
  let produced = 0;
  const ticker = progress(() => {
    const delivered = suppliers.reduce((n, s) => n + s.delivered, 0);
    return (
      `produced ${produced}/${records} · delivered ${delivered} · ${fourText()}` +
      ` · 429s ${suppliers.reduce((n, s) => n + s.rejected, 0)} · ${secs(performance.now() - started)}`
    );
  });

  // The producer: one record at a time at the feed's rate; `await submit` is where it blocks.
  let nextAt = performance.now();
  let producerBlockedMs = 0;
  for (let n = 0; n < records && !stop.signal.aborted; n++) {
    const wait = nextAt - performance.now();
    if (wait > 0) await sleep(wait, stop.signal).catch(() => {});
    nextAt += 1000 / feedRate;
    const s = suppliers[n % suppliers.length]!;
    s.produced++;
    produced++;
    outstanding++;
    const t = performance.now();
    await submit(s, n);
    producerBlockedMs += performance.now() - t;
  }
  producing = false;
  if (outstanding === 0) allDone();
  await Promise.race([finished, new Promise((r) => stop.signal.addEventListener("abort", r))]);
  const elapsedMs = performance.now() - started;
  clearInterval(sampler);
  ticker.stop();
  limit.clear();
  await writeChart(chart);

  const snap = four();
  // What bound the throughput, and Little's law of each supplier's share of the pool, as the
  // library measured them (before the gates close).
  const diagnosis = diagnose([...gates.values()]);
  const shareFlows = shares.map((sh) => sh.snapshot().flow!);
  const delivered = suppliers.reduce((n, s) => n + s.delivered, 0);
  const shed = suppliers.reduce((n, s) => n + s.shed, 0);
  const rejected = suppliers.reduce((n, s) => n + s.rejected, 0);
  const stats = new Map(suppliers.map((s) => [s.id, s.server!.stats()]));
  for (const gate of gates.values()) await gate.close();
  await Promise.all(suppliers.map((s) => s.server!.close()));
  await handle.close(true);

  const failures: string[] = [];
  if (group.peak > pool) failures.push(`${group.peak} in flight across suppliers, above the pool of ${pool}`);
  if (maxDepth > queueSize) failures.push(`queue held ${maxDepth}, above its size ${queueSize}`);
  for (const s of suppliers.slice(1)) {
    if (s.rejected > 0) failures.push(`${s.id} answered ${s.rejected} 429s within its quota`);
  }
  const acme = suppliers[0]!;
  const acmeCalls = stats.get("acme")!.requests;
  if (acmeCalls > 0 && acme.rejected / acmeCalls > 0.25) {
    failures.push(`acme refused ${acme.rejected} of ${acmeCalls} calls: the penalty did not slow it down`);
  }
  if (shedMode ? delivered + shed !== produced : delivered !== produced || shed > 0) {
    failures.push(`records lost: produced ${produced}, delivered ${delivered}, shed ${shed}`);
  }
  if (failed > 0) failures.push(`${failed} records failed (the first: ${firstFailure})`);
  if (stop.signal.aborted) failures.push((stop.signal.reason as Error).message);

  const tokenWait = snap.tokenWaitMs;
  const permitWait = snap.permitWaitMs;
  const constraint =
    shed > 0 || snap.queueWaitMs > Math.max(tokenWait, permitWait)
      ? "the feed outruns the pipeline (queue full)"
      : "";
  const inside = `${diagnosis.constraint}: ${diagnosis.summary}`;
  const little = suppliers
    .map((s, i) => {
      const f = shareFlows[i]!;
      return `${s.id} ${f.throughput.toFixed(1)}/s × ${(f.serviceMs / 1000).toFixed(3)} s = ${f.littleInFlight.toFixed(1)} of ${share}`;
    })
    .join(" · ");

  process.stdout.write(
    `ingest [${handle.mode}; ${shedMode ? "shed" : "block"}]: ${delivered}/${produced} records delivered in ${secs(elapsedMs)}` +
      ` (${perSec(delivered, elapsedMs)}) · peak in flight ${group.peak}/${pool} over ${suppliers.length} suppliers` +
      ` · 429s ${rejected} (acme ${acme.rejected}) · sheds ${shed}` +
      ` · queue depth max ${maxDepth}/${queueSize}, token wait ${secs(tokenWait)}, permit wait ${secs(permitWait)}, shed ${snap.shed}` +
      ` · ${failures.length === 0 ? "OK" : `FAILED: ${failures.join("; ")}`}\n` +
      `  bottleneck: ${constraint ? `${constraint}; inside it, ` : ""}${inside}` +
      ` · producer blocked ${secs(producerBlockedMs)} in total (queue wait ${secs(snap.queueWaitMs)})\n` +
      `  Little's law of each supplier's share of the pool: ${little}\n` +
      `  per supplier: ${suppliers
        .map((s) => {
          const st = stats.get(s.id)!;
          const at = s.delivered > 0 ? perSec(s.delivered, s.lastAt - started) : "-";
          return (
            `${s.id} ${s.delivered}/${s.produced} at ${at} (quota ${s.quota}/s after a burst of ${2 * burst}, 429s ${s.rejected}` +
            `${s.shed ? `, shed ${s.shed}` : ""}, peak ${st.peak})`
          );
        })
        .join(" · ")}\n`,
  );
  return failures.length === 0 ? 0 : 1;
}
