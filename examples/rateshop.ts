/**
 * Seed 004 — competitor rate shops across a handful of hosts.
 *
 * Each "host" is its own local server on 127.0.0.1 (a port each) with the minimum spacing it
 * tolerates between two requests: closer ones are answered 429. One host also throttles every
 * Nth request with a Retry-After. The shop matrix goes through one gate per host:
 *
 *   semaphore (global in-flight ceiling, shared by every host's gate) →
 *   interval gate for the host (its minimum interval plus jitter, keyed by host)
 *
 * The interval gate comes last, right before the request: it spaces admissions, so nothing
 * that can wait may stand between it and the send, or two calls that were spaced apart could
 * leave together. A caller therefore holds its global permit while it waits for its host's slot,
 * which is at most one interval when callers are spread over the hosts.
 *
 * `wrapFetch` sends the requests: a 429's Retry-After pauses that host on its gate (for the
 * whole fleet on Redis), and the shop is tried again after the pause.
 *
 * Fails (exit 1) when more requests were in flight across the hosts than the ceiling, the app sent
 * two requests to a host closer than it tolerates, a request arrived while a Retry-After was
 * running, or a shop did not complete. Two requests sent far enough apart that arrive closer (a
 * loaded machine delivered one late) are refused by the host, counted and tried again.
 */
import { setMaxListeners } from "node:events";
import { Gate } from "floodgate";
import { wrapFetch } from "floodgate/fetch";
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
import { type Provider, providerGroup, startProvider } from "./provider.js";

export const about =
  "rate shops over several hosts: global in-flight ceiling, per-host spacing with jitter, Retry-After";

const COMMAND = exampleCommand(
  "rateshop",
  about,
  {
    shops: { type: "int", default: 20, small: 6, help: "shops per host" },
    ceiling: { type: "int", default: 6, help: "requests in flight at once over every host" },
    "jitter-ms": {
      type: "int",
      default: 50,
      min: 0,
      help: "up to this much random delay on top of each host's interval",
    },
    "margin-ms": {
      type: "int",
      default: 40,
      min: 0,
      help: "configured interval = what the host tolerates + this",
    },
    "service-ms": {
      type: "int",
      default: 400,
      min: 0,
      help: "host answer time, plus up to half of it at random",
    },
    "throttle-every": {
      type: "int",
      default: 5,
      help: 'the "vendor" host answers every Nth request 429 + Retry-After: 1',
    },
  },
  ["REDIS_URL=redis://host:port: share the ceiling, the spacing and the pauses through Redis."],
);

interface Host {
  name: string;
  /** Least spacing the host tolerates, ms. */
  toleratesMs: number;
  throttle?: boolean;
  server?: Provider;
  done: number;
  retried: number;
  /** When each request left (performance.now()). */
  sent: number[];
}

/**
 * One host's spacing, judged on what left the app: the gate spaces what it sends, and what
 * arrives is that plus the machine's delivery. Two requests sent at least `toleratesMs` apart
 * that arrive closer (a loaded machine held one back) are refused by the host and tried again:
 * `delivered` counts those refusals, which fail nothing. `broken`: two were sent too close.
 */
export function spacingVerdict(
  toleratesMs: number,
  sent: readonly number[],
  arrivedMinGapMs: number,
  refusedTooFast: number,
): { sentMinMs: number; broken: boolean; delivered: number } {
  let sentMinMs = Number.POSITIVE_INFINITY;
  for (let i = 1; i < sent.length; i++) sentMinMs = Math.min(sentMinMs, sent[i]! - sent[i - 1]!);
  const broken = sentMinMs < toleratesMs;
  const delivered = !broken && arrivedMinGapMs < toleratesMs ? refusedTooFast : 0;
  return { sentMinMs, broken, delivered };
}

export async function main(argv: string[]): Promise<number> {
  const f = parseFlags(COMMAND, argv);
  if (!f) return 0;
  const { shops: shopsPerHost, ceiling, "jitter-ms": jitterMs, "margin-ms": marginMs } = f;
  const { "service-ms": serviceMs, "throttle-every": throttleEvery } = f;

  const hosts: Host[] = [
    { name: "booking.test", toleratesMs: 150, done: 0, retried: 0, sent: [] },
    { name: "expedia.test", toleratesMs: 250, done: 0, retried: 0, sent: [] },
    { name: "vendor.test", toleratesMs: 100, throttle: true, done: 0, retried: 0, sent: [] },
    { name: "hotels.test", toleratesMs: 200, done: 0, retried: 0, sent: [] },
  ];
  const group = providerGroup();
  for (const h of hosts) {
    h.server = await startProvider({
      cap: 10_000,
      serviceMs,
      serviceJitterMs: serviceMs / 2,
      minIntervalMs: h.toleratesMs,
      throttleEvery: h.throttle ? throttleEvery : undefined,
      group,
    });
  }

  const handle = await openBackend(newPrefix("rateshop"));
  const b = handle.backend;
  const inflight = b.semaphore("shop-inflight", { limit: ceiling });
  const fetchers = new Map(
    hosts.map((h) => {
      const gate = new Gate(
        [
          inflight,
          b.intervalGate(`shop-spacing-${h.name}`, { minIntervalMs: h.toleratesMs + marginMs, jitterMs }),
        ],
        { name: `shop-${h.name}` },
      );
      // The fetch behind the gate notes when each request leaves, to compare with when it arrives.
      const timed: typeof fetch = (input, init) => {
        h.sent.push(performance.now());
        return fetch(input, init);
      };
      return [h.name, { gate, fetch: wrapFetch(gate, timed) }] as const;
    }),
  );
  process.stderr.write(
    `rateshop: ${where(handle)}; ${hosts.length} hosts on 127.0.0.1 ports, ${shopsPerHost} shops each; ` +
      `ceiling ${ceiling} in flight; spacing = tolerance + ${marginMs} ms + up to ${jitterMs} ms jitter\n`,
  );

  // The matrix, interleaved over the hosts so the callers spread over them.
  const matrix: { host: Host; property: number; checkIn: string }[] = [];
  for (let i = 0; i < shopsPerHost; i++) {
    for (const host of hosts) {
      matrix.push({
        host,
        property: 1000 + (i >> 1),
        checkIn: `2025-03-${String(1 + (i % 2)).padStart(2, "0")}`,
      });
    }
  }
  const total = matrix.length;
  const slowest = Math.max(...hosts.map((h) => h.toleratesMs + marginMs + jitterMs));
  const limit = deadline("rateshop", Math.max(30_000, 5 * shopsPerHost * slowest + 10_000));
  setMaxListeners(0, limit.signal);

  // One request to a throwaway server before the clock starts: the first HTTP request of a process
  // loads and compiles the client and server code, and that one-off delay would sit between the
  // first shop's admission and its arrival, shrinking the spacing the host sees.
  const warm = await startProvider({ cap: 1, serviceMs: 0 });
  await (await fetch(`${warm.url}/warm-up`)).arrayBuffer();
  await warm.close();

  let next = 0;
  let done = 0;
  let errors = 0;
  const audit = new Map<string, number>();
  const chart = startChart(f.chart, {
    title: `rateshop [${handle.mode}]: ${hosts.length} hosts, ceiling ${ceiling}`,
  })?.watch(...[...fetchers.values()].map((x) => x.gate));
  // The hosts' servers as one: in flight across them (the group), and their 429s.
  const rejected429 = () => hosts.reduce((n, h) => n + h.server!.stats().rejected429, 0);
  chart?.watchProvider({ stats: () => ({ ...group, rejected429: rejected429() }) }, "hosts");
  const started = performance.now();
  const ticker = progress(
    () =>
      `${String(done).padStart(String(total).length)}/${total} shops · in flight ${group.inFlight} (peak ${group.peak}/${ceiling})` +
      ` · 429s ${hosts.reduce((n, h) => n + h.server!.stats().rejected429, 0)} · ${secs(performance.now() - started)}`,
  );

  async function caller(): Promise<void> {
    while (next < total && !limit.signal.aborted) {
      const shop = matrix[next++]!;
      const { host } = shop;
      const url = `${host.server!.url}/rates?property=${shop.property}&checkin=${shop.checkIn}`;
      for (let attempt = 1; attempt <= 4; attempt++) {
        try {
          const res = await fetchers.get(host.name)!.fetch(url, { signal: limit.signal });
          const raw = await res.text();
          if (res.status === 429) {
            // wrapFetch has already paused this host for the Retry-After; the next attempt waits it out.
            host.retried++;
            continue;
          }
          // The raw bytes are kept before anything reads them (the audit trail).
          audit.set(`${host.name}:${shop.property}:${shop.checkIn}`, raw.length);
          if (res.status === 200) {
            host.done++;
            done++;
          } else errors++;
          break;
        } catch (error) {
          if (!limit.signal.aborted) {
            errors++;
            process.stderr.write(`\nrateshop: ${url} failed: ${(error as Error).message}\n`);
          }
          break;
        }
      }
    }
  }

  await Promise.all(Array.from({ length: Math.min(total, 2 * hosts.length) }, caller));
  const elapsedMs = performance.now() - started;
  ticker.stop();
  limit.clear();
  await writeChart(chart);

  const stats = new Map(hosts.map((h) => [h.name, h.server!.stats()]));
  for (const { gate } of fetchers.values()) await gate.close();
  await Promise.all(hosts.map((h) => h.server!.close()));
  await handle.close(true);

  const failures: string[] = [];
  let spacingHeld = true;
  let tooFast = 0;
  // Refused as too fast though sent far enough apart: the machine delivered them closer.
  let delivered = 0;
  let throttled = 0;
  let early = 0;
  const lines: string[] = [];
  for (const h of hosts) {
    const st = stats.get(h.name)!;
    tooFast += st.rejectedBy.spacing;
    throttled += st.rejectedBy.throttle;
    early += st.early;
    const spacing = spacingVerdict(h.toleratesMs, h.sent, st.minGapMs, st.rejectedBy.spacing);
    const sentMin = spacing.sentMinMs;
    delivered += spacing.delivered;
    if (spacing.broken) {
      spacingHeld = false;
      failures.push(`${h.name}: two requests sent ${msText(sentMin)} apart (tolerates ${h.toleratesMs} ms)`);
    }
    lines.push(
      `  ${h.name.padEnd(13)} tolerates ${h.toleratesMs} ms · configured ${h.toleratesMs + marginMs} ms` +
        ` + 0–${jitterMs} ms jitter · min spacing sent ${msText(sentMin)}, arrived ${msText(st.minGapMs)}` +
        ` (mean ${msText(st.meanGapMs)})` +
        ` · ${h.done} shops, ${st.rejectedBy.throttle} Retry-After, ${st.early} early · peak ${st.peak}`,
    );
  }
  if (group.peak > ceiling)
    failures.push(`${group.peak} in flight across hosts, above the ceiling of ${ceiling}`);
  if (tooFast > delivered) failures.push(`${tooFast - delivered} requests refused as too fast`);
  if (early > 0) failures.push(`${early} requests arrived while a Retry-After was running`);
  if (done < total) failures.push(`${total - done} shops not collected`);
  if (audit.size !== done) failures.push(`audit holds ${audit.size} responses for ${done} shops`);
  if (errors > 0) failures.push(`${errors} shops failed`);
  if (limit.signal.aborted) failures.push((limit.signal.reason as Error).message);

  process.stdout.write(
    `rateshop [${handle.mode}]: ${done}/${total} shops over ${hosts.length} hosts in ${secs(elapsedMs)}` +
      ` (${perSec(done, elapsedMs)}) · peak in flight ${group.peak}/${ceiling} across hosts` +
      ` · 429s ${throttled + tooFast} (${throttled} Retry-After, ${tooFast} too fast` +
      `${delivered > 0 ? `, ${delivered} of them sent far enough apart and delivered closer by the machine` : ""}) · sheds 0` +
      ` · Retry-After: ${early} requests early · spacing sent ${spacingHeld ? "≥ tolerance on every host" : "BROKEN"}` +
      ` · ${failures.length === 0 ? "OK" : `FAILED: ${failures.join("; ")}`}\n` +
      `${lines.join("\n")}\n`,
  );
  return failures.length === 0 ? 0 : 1;
}
