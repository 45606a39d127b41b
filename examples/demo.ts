/**
 * floodgate demo: many concurrent callers, one provider that answers 429 above its cap, and a
 * gate in between that keeps the calls in flight at or under the cap.
 *
 *   npm run demo                       # 400 requests from 64 callers, cap 8, 50 ms each
 *   npm run demo -- --requests 80      # a short run
 *   npm run demo -- --cap 4 --service-ms 20 --callers 16
 *
 * Prints a live progress line on stderr and a summary on stdout. Exits non-zero when the provider
 * answered any 429, saw more than `cap` requests at once, or a request did not complete.
 */
import { setMaxListeners } from "node:events";
import { Gate, memory } from "floodgate";
import { wrapFetch } from "floodgate/fetch";
import { CHART_FLAG, startChart, writeChart } from "./chart.js";
import { command, parseOrExit } from "./cli.js";
import { startProvider } from "./provider.js";

const COMMAND = command({
  name: "demo",
  synopsis: "npm run demo -- [flags]",
  about:
    "Many concurrent callers, one provider that answers 429 above its cap, and a gate in between\n" +
    "(queue, semaphore, AIMD) that keeps the calls in flight at or under the cap. Exits 1 when the\n" +
    "provider answered a 429, saw more than its cap at once, or a request did not complete.",
  flags: {
    requests: { type: "int", default: 400, help: "requests to send" },
    callers: { type: "int", default: 64, help: "concurrent callers" },
    cap: { type: "int", default: 8, help: "requests the provider serves at once; the gate's limit" },
    "service-ms": { type: "int", default: 50, help: "provider answer time per request" },
    chart: CHART_FLAG,
  },
});

async function main(): Promise<number> {
  const { requests, callers, cap, "service-ms": serviceMs, chart: chartFile } = parseOrExit(COMMAND).values;
  const provider = await startProvider({ cap, serviceMs });
  const backend = memory();
  const gate = new Gate(
    [
      // At most 2 × cap callers wait for a permit; the rest wait for a queue slot (backpressure).
      backend.queue("demo-queue", { maxSize: 2 * cap, whenFull: "block" }),
      backend.semaphore("demo-inflight", { limit: cap }),
      backend.aimd("demo-adaptive", { initial: cap, min: 1, max: cap }),
    ],
    { name: "demo" },
  );
  const gatedFetch = wrapFetch(gate);
  const chart = startChart(chartFile, {
    title: `demo: ${requests} requests from ${callers} callers, provider cap ${cap}, ${serviceMs} ms each`,
    cap,
  });
  chart?.watch(gate).watchProvider(provider);

  // Bounded in time as well as in count: far longer than the run needs, then everything stops.
  const idealMs = (requests / cap) * serviceMs;
  const deadlineMs = Math.max(15_000, 10 * idealMs);
  const stop = new AbortController();
  // Every caller listens to this one signal while it waits or is in flight.
  setMaxListeners(2 * callers + 10, stop.signal);
  const deadline = setTimeout(
    () => stop.abort(new Error(`demo: gave up after ${deadlineMs} ms`)),
    deadlineMs,
  );

  let next = 0;
  let done = 0;
  let ok = 0;
  let errors = 0;
  const started = performance.now();

  const tty = process.stderr.isTTY === true;
  const progress = () => {
    const s = gate.snapshot();
    const p = provider.stats();
    const line =
      `${String(done).padStart(String(requests).length)}/${requests} done · in flight ${s.inFlight}` +
      ` · waiting ${s.waiting} · limit ${s.limit} · provider peak ${p.peak} · 429s ${p.rejected429}` +
      ` · ${((performance.now() - started) / 1000).toFixed(1)} s`;
    process.stderr.write(tty ? `\r${line}\x1b[K` : `${line}\n`);
  };
  const ticker = setInterval(progress, tty ? 100 : 1000);

  async function caller(): Promise<void> {
    while (next < requests && !stop.signal.aborted) {
      const n = next++;
      try {
        const res = await gatedFetch(`${provider.url}/work/${n}`, { signal: stop.signal });
        await res.arrayBuffer();
        if (res.status === 200) ok++;
      } catch (error) {
        if (!stop.signal.aborted) {
          errors++;
          process.stderr.write(`\nrequest ${n} failed: ${(error as Error).message}\n`);
        }
      } finally {
        done++;
      }
    }
  }

  await Promise.all(Array.from({ length: Math.min(callers, requests) }, caller));
  const elapsedMs = performance.now() - started;
  clearTimeout(deadline);
  clearInterval(ticker);
  progress();
  if (tty) process.stderr.write("\n");
  await writeChart(chart);

  const stats = provider.stats();
  const snapshot = gate.snapshot();
  const throughput = ok / (elapsedMs / 1000);
  const ideal = cap / (serviceMs / 1000);
  process.stdout.write(
    `floodgate demo: ${requests} requests from ${callers} callers; provider cap ${cap}, ${serviceMs} ms per request\n` +
      `completed ${ok}/${requests} in ${(elapsedMs / 1000).toFixed(2)} s · ` +
      `throughput ${throughput.toFixed(1)} req/s vs ideal ${ideal.toFixed(1)} req/s (${((100 * throughput) / ideal).toFixed(0)}%) · ` +
      `provider peak ${stats.peak}/${cap} · 429s ${stats.rejected429}` +
      (errors > 0 ? ` · errors ${errors}` : "") +
      (stop.signal.aborted ? ` · stopped: ${(stop.signal.reason as Error).message}` : "") +
      "\n" +
      `gate: admitted ${snapshot.admitted} · permit wait ${(snapshot.permitWaitMs / 1000).toFixed(1)} s in total` +
      ` · queue wait ${(snapshot.queueWaitMs / 1000).toFixed(1)} s in total · adaptive limit ${snapshot.limit}\n`,
  );

  await gate.close();
  await provider.close();
  const failed = stats.rejected429 > 0 || stats.peak > cap || ok < requests || errors > 0;
  return failed ? 1 : 0;
}

main().then(
  (code) => {
    process.exitCode = code;
  },
  (error) => {
    process.stderr.write(`demo failed: ${(error as Error).stack ?? error}\n`);
    process.exitCode = 1;
  },
);
