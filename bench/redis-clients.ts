/** Redis helpers shared by the Redis benchmarks. */
import { once } from "node:events";
import { Redis } from "ioredis";
import { sorted } from "./lib.js";

/** A connected client, configured as floodgate's README asks (no offline queue). */
export async function connect(url: string): Promise<Redis> {
  const client = new Redis(url, { enableOfflineQueue: false, maxRetriesPerRequest: 1 });
  client.on("error", () => {});
  await once(client, "ready");
  return client;
}

/** Result of a closed loop: operations per second and each operation's latency (ms, sorted). */
export interface LoopResult {
  rate: number;
  latencies: number[];
}

/** `callers` loops each running `op` one after another until `seconds` have passed. */
export async function closedLoop(
  callers: number,
  seconds: number,
  op: () => Promise<unknown>,
): Promise<LoopResult> {
  const latencies: number[] = [];
  const started = performance.now();
  const deadline = started + seconds * 1000;
  await Promise.all(
    Array.from({ length: callers }, async () => {
      for (let t = performance.now(); t < deadline; ) {
        await op();
        const now = performance.now();
        latencies.push(now - t);
        t = now;
      }
    }),
  );
  return { rate: latencies.length / ((performance.now() - started) / 1000), latencies: sorted(latencies) };
}

/** INFO commandstats: calls and microseconds of every command so far (script-run ones included). */
export async function commandStats(client: Redis): Promise<Map<string, { calls: number; usec: number }>> {
  const info = await client.info("commandstats");
  const stats = new Map<string, { calls: number; usec: number }>();
  for (const line of info.split("\n")) {
    const m = /^cmdstat_([a-z_|]+):calls=(\d+),usec=(\d+)/.exec(line.trim());
    if (m) stats.set(m[1]!, { calls: Number(m[2]), usec: Number(m[3]) });
  }
  return stats;
}

let unique = 0;
/** A key prefix no earlier round used. */
export function freshPrefix(what: string): string {
  return `bench:${process.pid}:${what}:${++unique}:`;
}
