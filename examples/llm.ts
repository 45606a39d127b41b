/**
 * Seed 002 — an LLM client under requests-per-minute and tokens-per-minute limits.
 *
 * The simulated provider counts RPM and TPM (a "minute" is `--minute-ms` long so the run takes
 * seconds), answers 429 with Retry-After when either is exceeded, and puts `usage` in every
 * answer. It also has a concurrency limit nobody documented: above it, 429 "overloaded" with
 * Retry-After. The client composes:
 *
 *   semaphore (connection pool) → AIMD (halves on 429) → rpm bucket → tpm bucket (weighted) →
 *   interval gate (no spacing; it holds the host while a Retry-After runs)
 *
 * Each call is admitted at its estimated cost (prompt tokens + max_tokens, `costs: { tpm }`) and
 * settled with the actual usage from the response (`ticket.settle({ tpm })`), so the unused part
 * of the reservation goes back to the bucket. A prompt larger than the whole TPM budget is
 * refused at once. A 429 halves the AIMD limit, and its Retry-After pauses the host for every
 * caller (`gate.pause`). At 85% of the corpus (or on Ctrl-C / SIGTERM, through
 * `drainOnSignals`) the client shuts down gracefully with `gate.drain`: no new admissions,
 * waiting calls rejected, a short grace for calls in flight, then the rest aborted through their
 * ticket's signal, released, and the gate closed.
 *
 * Fails (exit 1) when the provider refused anything for RPM or TPM, a call was sent while a
 * Retry-After pause was running, the oversized prompt was not refused at once, AIMD did not cut
 * after a 429, or the shutdown left a call waiting or in flight.
 */
import { type DrainResult, drainOnSignals, Gate, isFloodgateError, type Ticket } from "floodgate";
import { parseRetryAfter } from "floodgate/fetch";
import { startChart, writeChart } from "./chart.js";
import {
  deadline,
  exampleCommand,
  msText,
  newPrefix,
  openBackend,
  parseFlags,
  perSec,
  progress,
  secs,
  where,
} from "./common.js";
import { startProvider } from "./provider.js";

export const about =
  "LLM client: RPM and TPM buckets, reserve-then-settle, AIMD on 429, Retry-After, shutdown";

const COMMAND = exampleCommand(
  "llm",
  about,
  {
    docs: { type: "int", default: 300, small: 80, help: "documents to summarise" },
    rpm: { type: "int", default: 120, help: "provider requests per minute" },
    tpm: { type: "int", default: 24_000, help: "provider tokens per minute" },
    "minute-ms": { type: "int", default: 1000, help: 'how long a "minute" lasts here' },
    pool: {
      type: "int",
      default: 16,
      help: "connection pool: semaphore size and AIMD's start and ceiling",
    },
    "hidden-cap": {
      type: "int",
      default: 6,
      help: 'concurrency above which the provider answers 429 "overloaded"',
    },
    "service-ms": {
      type: "int",
      default: 120,
      min: 0,
      help: "provider answer time, plus up to half of it at random",
    },
    "max-tokens": { type: "int", default: 300, min: 0, help: "completion budget per call" },
    "grace-ms": { type: "int", default: 100, min: 0, help: "time calls in flight get to finish at shutdown" },
  },
  ["REDIS_URL=redis://host:port: share the buckets, semaphore, AIMD limit and pauses through Redis."],
);

/** Tokens of a prompt, as the provider counts them (a stand-in for a real tokenizer). */
const promptTokens = (prompt: string) => Math.ceil(prompt.length / 4);

interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

type Attempt = { status: 200; usage: Usage } | { status: number; reason: string };

export async function main(argv: string[]): Promise<number> {
  const f = parseFlags(COMMAND, argv);
  if (!f) return 0;
  const { docs, rpm, tpm, "minute-ms": minuteMs, pool, "hidden-cap": hiddenCap } = f;
  const { "service-ms": serviceMs, "max-tokens": maxTokens, "grace-ms": graceMs } = f;
  const shutdownAt = Math.ceil(docs * 0.85);

  const provider = await startProvider({
    cap: hiddenCap,
    serviceMs,
    serviceJitterMs: serviceMs / 2,
    retryAfterMs: 100,
    requestLimit: { limit: rpm, windowMs: minuteMs },
    tokenLimit: { limit: tpm, windowMs: minuteMs },
  });
  const host = new URL(provider.url).host;
  const handle = await openBackend(newPrefix("llm"));
  const b = handle.backend;
  const perSecond = 1000 / minuteMs;
  const gate = new Gate(
    [
      // Stages that hold the call first (pool, adaptive limit), then those that meter its start
      // (RPM and TPM tokens, then the host): the tokens are taken last, right before the send, so
      // the rates hold for when calls leave. A call holds its permits while it waits for tokens.
      b.semaphore("llm-pool", { limit: pool }),
      b.aimd("llm-adaptive", { initial: pool, min: 1, max: pool, backoffRatio: 0.5 }),
      b.tokenBucket("rpm", { capacity: rpm, refillPerSecond: rpm * perSecond }),
      b.tokenBucket("tpm", { capacity: tpm, refillPerSecond: tpm * perSecond }),
      // Last, right before the call: a Retry-After pause then holds back every call about to be
      // sent, including those that already have their tokens and permits.
      b.intervalGate("llm-host", { minIntervalMs: 0 }),
    ],
    { name: "llm" },
  );
  process.stderr.write(
    `llm: ${where(handle)}; provider ${rpm} RPM, ${tpm} TPM (a minute lasts ${minuteMs} ms), ` +
      `and an undocumented limit of ${hiddenCap} in flight; client pool ${pool}\n`,
  );
  const aimdLimit = () => gate.snapshot().stages.find((s) => s.name === "llm-adaptive")!.limit;

  const failures: string[] = [];

  // 1. Cost above capacity: refused at once, never waited on, never sent.
  const huge = "x".repeat(4 * (tpm + 1000));
  const hugeEstimate = promptTokens(huge) + maxTokens;
  const t0 = performance.now();
  let refusal = "";
  try {
    await gate.run(async () => "never runs", { host, costs: { tpm: hugeEstimate } });
    failures.push("a prompt above the TPM capacity was admitted");
  } catch (error) {
    const tookMs = performance.now() - t0;
    if (!isFloodgateError(error, "INVALID_OPTIONS")) throw error;
    refusal = `${hugeEstimate} tokens > ${tpm} refused in ${tookMs.toFixed(1)} ms`;
    process.stderr.write(`llm: oversized prompt refused at once: ${error.message}\n`);
    if (tookMs > 100) failures.push(`the oversized prompt took ${msText(tookMs)} to be refused`);
  }
  if (provider.stats().requests > 0) failures.push("the oversized prompt reached the provider");

  // 2. The corpus.
  const corpus = Array.from({ length: docs }, (_, i) => ({
    id: i,
    prompt: `Summarise filing ${i}. ${"lorem ipsum ".repeat(30 + Math.floor(Math.random() * 500))}`,
  }));
  const limit = deadline("llm", Math.max(30_000, (docs / Math.min(hiddenCap, rpm / 60)) * serviceMs * 5));
  limit.signal.addEventListener("abort", () => void shutdown(limit.signal.reason as Error), { once: true });

  let next = 0;
  let ok = 0;
  let finishedInGrace = 0;
  let abortedWaiting = 0;
  let abortedInFlight = 0;
  let retries = 0;
  let reserved = 0;
  let settledBack = 0;
  let charged = 0;
  let errors = 0;
  const trail: number[] = [pool];
  const cuts: string[] = [];
  const sends: number[] = [];
  const pauses: { at: number; ms: number; landed: number }[] = [];
  let shuttingDown: Promise<void> | undefined;
  let shutdownReason = "";
  let drained: DrainResult | undefined;

  /** Note the AIMD limit when it moved. */
  const sample = () => {
    const l = aimdLimit();
    const last = trail[trail.length - 1]!;
    if (l === last) return;
    if (l < last) cuts.push(`${last}→${l}`);
    trail.push(l);
  };
  const sampler = setInterval(sample, 10);

  const attempt = (prompt: string, estimate: number, state: { sent: boolean }): Promise<Attempt> =>
    gate.run(
      async (ticket: Ticket): Promise<Attempt> => {
        state.sent = true;
        sends.push(performance.now());
        const res = await fetch(`${provider.url}/v1/completions`, {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ prompt, max_tokens: maxTokens }),
          signal: ticket.signal, // aborts if the drain's grace runs out
        });
        const body = (await res.json()) as { usage?: Usage; reason?: string };
        if (res.status === 429) {
          ticket.record("dropped"); // AIMD halves
          // Retry-After overrides any backoff of ours: the host is paused for every caller.
          const ms = parseRetryAfter(res.headers);
          if (ms !== undefined && ms > 0) {
            const pause = { at: performance.now(), ms, landed: Number.POSITIVE_INFINITY };
            pauses.push(pause);
            await gate.pause(host, ms);
            pause.landed = performance.now(); // from here on, no call may pass the gate
          }
          // The provider charged no tokens for a refused call: give the reservation back.
          await ticket.settle({ tpm: 0 });
          return { status: 429, reason: body.reason ?? "?" };
        }
        if (res.status !== 200 || !body.usage) return { status: res.status, reason: "unexpected answer" };
        const usage = body.usage;
        reserved += estimate;
        charged += usage.total_tokens;
        settledBack += estimate - usage.total_tokens;
        // Reserve, then settle: the bucket keeps only what the call cost.
        await ticket.settle({ tpm: usage.total_tokens });
        return { status: 200, usage };
      },
      { host, costs: { tpm: estimate } },
    );

  async function caller(): Promise<void> {
    while (next < docs && !shuttingDown) {
      const doc = corpus[next++]!;
      const estimate = promptTokens(doc.prompt) + maxTokens;
      for (;;) {
        const state = { sent: false };
        try {
          const r = await attempt(doc.prompt, estimate, state);
          sample();
          if (r.status === 200) {
            if (shuttingDown) finishedInGrace++;
            ok++;
            break;
          }
          retries++;
        } catch (error) {
          if (isFloodgateError(error, "DRAINING")) {
            // Not sent yet: refused or rejected by the drain. Sent: cut when its grace ran out.
            if (state.sent) abortedInFlight++;
            else abortedWaiting++;
            return;
          }
          errors++;
          process.stderr.write(`\nllm: doc ${doc.id} failed: ${(error as Error).message}\n`);
          break;
        }
      }
      if (ok >= shutdownAt && !shuttingDown) void shutdown(new Error(`${ok} of ${docs} done`));
    }
  }

  /** Graceful shutdown: the gate's drain (no new calls, waiting ones rejected, a grace, then cut). */
  function shutdown(reason: Error): Promise<void> {
    shutdownReason ||= reason.message;
    shuttingDown ??= gate.drain({ graceMs }).then((r) => {
      drained = r;
    });
    return shuttingDown;
  }
  // Ctrl-C or SIGTERM drains the gate the same way; the run then prints its summary and exits.
  const stopOnSignals = drainOnSignals(gate, { graceMs, exit: false, onDrained: (r) => (drained = r) });
  process.once("SIGINT", () => void shutdown(new Error("interrupted")));
  process.once("SIGTERM", () => void shutdown(new Error("terminated")));

  // The cap drawn is the provider's undocumented one, which AIMD finds by its 429s.
  const chart = startChart(f.chart, { title: `llm [${handle.mode}]: ${rpm} RPM, ${tpm} TPM`, cap: hiddenCap })
    ?.watch(gate)
    .watchProvider(provider);
  const started = performance.now();
  const ticker = progress(() => {
    const p = provider.stats();
    const s = gate.snapshot();
    return (
      `${String(ok).padStart(String(docs).length)}/${docs} done · in flight ${s.inFlight} · waiting ${s.waiting}` +
      ` · AIMD limit ${aimdLimit()} · 429s ${p.rejected429} · pauses ${pauses.length}` +
      ` · ${secs(performance.now() - started)}`
    );
  });
  const callers = Array.from({ length: Math.min(docs, 4 * pool) }, caller);
  await Promise.all(callers);
  await shutdown(new Error("corpus done"));
  const elapsedMs = performance.now() - started;
  limit.clear();
  clearInterval(sampler);
  ticker.stop();
  stopOnSignals();
  await writeChart(chart);

  const after = gate.snapshot();
  const p = provider.stats();
  await provider.close();
  await handle.close(true);

  // Was anything sent while a Retry-After pause ran, after the pause had landed in the gate? (A
  // grant already on its way when it landed is allowed a few milliseconds, and the pause's end
  // one: Redis reads its clock in whole milliseconds.)
  const slackMs = 5;
  const inside = (t: number, w: (typeof pauses)[number]) => t > w.landed + slackMs && t < w.at + w.ms - 1;
  const early = sends.filter((t) => pauses.some((w) => inside(t, w))).length;
  const overload = p.rejectedBy.cap;
  const notStarted = docs - next;

  if (p.rejectedBy.requests > 0) failures.push(`${p.rejectedBy.requests} calls refused for RPM`);
  if (p.rejectedBy.tokens > 0) failures.push(`${p.rejectedBy.tokens} calls refused for TPM`);
  if (p.peak > pool) failures.push(`provider saw ${p.peak} at once, above the pool of ${pool}`);
  if (early > 0) {
    const late = sends
      .flatMap((t) => pauses.filter((w) => inside(t, w)).map((w) => (t - w.landed).toFixed(1)))
      .join(", ");
    failures.push(`${early} calls sent while a Retry-After pause ran (ms after it landed: ${late})`);
  }
  const lowest = Math.min(...trail);
  if (overload > 0 && cuts.length === 0) failures.push("429s came back but AIMD never cut its limit");
  if (after.inFlight !== 0 || after.waiting !== 0)
    failures.push(`after shutdown ${after.inFlight} in flight and ${after.waiting} waiting`);
  if (ok + abortedWaiting + abortedInFlight + notStarted + errors !== docs)
    failures.push("some documents are not accounted for");
  if (errors > 0) failures.push(`${errors} calls failed`);
  if (limit.signal.aborted) failures.push((limit.signal.reason as Error).message);

  process.stdout.write(
    `llm [${handle.mode}]: ${ok}/${docs} completions in ${secs(elapsedMs)} (${perSec(ok, elapsedMs)})` +
      ` then shutdown · provider peak ${p.peak}/${pool} · 429s ${p.rejected429}` +
      ` (${overload} overloaded, ${p.rejectedBy.requests} RPM, ${p.rejectedBy.tokens} TPM) · sheds ${after.shed}` +
      ` · AIMD halved ${cuts.slice(0, 3).join(", ")}${cuts.length > 3 ? ", …" : ""} (${cuts.length} cuts, lowest ${lowest}, ends ${trail[trail.length - 1]}) · Retry-After: ${pauses.length} pauses, ${early} sends inside one` +
      ` · ${failures.length === 0 ? "OK" : `FAILED: ${failures.join("; ")}`}\n` +
      `  tokens: reserved ${reserved} for completed calls, settled ${settledBack} back, kept ${charged}` +
      ` (provider charged ${p.tokens}, calls cut in flight included) · retries ${retries}` +
      ` · oversized prompt: ${refusal || "not refused"}\n` +
      `  shutdown (${shutdownReason}): ${finishedInGrace} finished in the ${graceMs} ms grace,` +
      ` ${abortedInFlight} aborted in flight, ${abortedWaiting} aborted waiting, ${notStarted} never started;` +
      ` gate.drain: ${drained?.completed ?? "?"} completed, ${drained?.aborted ?? "?"} aborted, ${drained?.rejected ?? "?"} rejected` +
      ` in ${drained ? msText(drained.tookMs) : "?"}; gate closed with ${after.inFlight} in flight, ${after.waiting} waiting\n`,
  );
  return failures.length === 0 ? 0 : 1;
}
