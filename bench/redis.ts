/**
 * Redis backend figures: admissions per second from one process, Redis calls per admission, and
 * the release-to-grant handoff between two processes.
 *
 *   npx tsx bench/redis.ts [--seconds 3] [--rounds 200] [--callers 64]
 */
import { fork } from "node:child_process";
import { once } from "node:events";
import { parseArgs } from "node:util";
import { redis } from "floodgate/redis";
import { Redis } from "ioredis";
import { benchRedis, percentile } from "./redis-server.js";

const { values } = parseArgs({
  options: {
    seconds: { type: "string", default: "3" },
    rounds: { type: "string", default: "200" },
    callers: { type: "string", default: "64" },
  },
});
const seconds = Number(values.seconds);
const rounds = Number(values.rounds);
const callers = Number(values.callers);

const server = await benchRedis();
const client = new Redis(server.url, { enableOfflineQueue: false });
await once(client, "ready");
const prefix = `bench:${process.pid}:`;

async function evalCalls(): Promise<number> {
  const info = await client.info("commandstats");
  let calls = 0;
  for (const line of info.split("\n")) {
    const m = /^cmdstat_(evalsha|eval|evalsha_ro|eval_ro):calls=(\d+)/.exec(line);
    if (m) calls += Number(m[2]);
  }
  return calls;
}

// 1. Throughput: `callers` loops of admit + release on an uncontended semaphore and bucket.
async function throughput(kind: "semaphore" | "tokenBucket"): Promise<number> {
  const backend = redis(client, { prefix: `${prefix}${kind}:` });
  const stage =
    kind === "semaphore"
      ? backend.semaphore("tp", { limit: 1_000_000 })
      : backend.tokenBucket("tp", { capacity: 1_000_000_000, refillPerSecond: 1_000_000_000 });
  const deadline = performance.now() + seconds * 1000;
  let count = 0;
  await Promise.all(
    Array.from({ length: callers }, async () => {
      while (performance.now() < deadline) {
        const t = await stage.admit();
        await t.release("success");
        count++;
      }
    }),
  );
  await backend.close();
  return count / seconds;
}

async function pingRate(): Promise<number> {
  const deadline = performance.now() + seconds * 1000;
  let count = 0;
  await Promise.all(
    Array.from({ length: callers }, async () => {
      while (performance.now() < deadline) {
        await client.ping();
        count++;
      }
    }),
  );
  return count / seconds;
}

// 2. Calls per admission, uncontended and with 8 callers on a limit of 2.
async function callsPerAdmission(limit: number, parallel: number, total: number): Promise<number> {
  const backend = redis(client, { prefix: `${prefix}calls${limit}:` });
  const sem = backend.semaphore("calls", { limit });
  await sem.admit().then((t) => t.release()); // load scripts first
  const before = await evalCalls();
  let left = total;
  await Promise.all(
    Array.from({ length: parallel }, async () => {
      while (left-- > 0) {
        const t = await sem.admit();
        await new Promise((r) => setImmediate(r));
        await t.release("success");
      }
    }),
  );
  const after = await evalCalls();
  await backend.close();
  return (after - before) / total;
}

// 3. Handoff: this process releases, another process (waiting in Redis) is granted.
async function handoff(): Promise<number[]> {
  const hp = `${prefix}handoff:`;
  const child = fork(new URL("./redis-handoff-child.ts", import.meta.url).pathname, [server.url, hp], {
    execArgv: ["--import", "tsx"],
    stdio: ["ignore", "inherit", "inherit", "ipc"],
  });
  const messages: { kind: string; at?: number }[] = [];
  let notify: (() => void) | undefined;
  child.on("message", (m: { kind: string; at?: number }) => {
    messages.push(m);
    notify?.();
  });
  const next = async (kind: string) => {
    for (;;) {
      const i = messages.findIndex((m) => m.kind === kind);
      if (i >= 0) return messages.splice(i, 1)[0]!;
      await new Promise<void>((r) => {
        notify = r;
      });
    }
  };
  await next("ready");
  const backend = redis(client, { prefix: hp });
  const sem = backend.semaphore("handoff", { limit: 1 });
  const latencies: number[] = [];
  for (let i = 0; i < rounds; i++) {
    const held = await sem.admit();
    child.send({ kind: "wait" });
    await next("queued");
    await new Promise((r) => setTimeout(r, 5)); // let the waiter line up in Redis
    const releasedAt = performance.timeOrigin + performance.now();
    await held.release("success");
    const granted = await next("granted");
    latencies.push(granted.at! - releasedAt);
  }
  child.send({ kind: "exit" });
  await once(child, "exit");
  await backend.close();
  return latencies.sort((a, b) => a - b);
}

const ping = await pingRate();
const sem = await throughput("semaphore");
const bucket = await throughput("tokenBucket");
const calls1 = await callsPerAdmission(1_000, 1, 500);
const calls8 = await callsPerAdmission(2, 8, 500);
const lat = await handoff();
const fmt = (n: number) => Math.round(n).toLocaleString("en-US");
console.log(`redis-server at ${server.url}, ${callers} callers, ${seconds} s per figure`);
console.log(`PING                               ${fmt(ping)} /s`);
console.log(
  `semaphore acquire + release        ${fmt(sem)} admissions/s (${(sem / (ping / 2)).toFixed(2)} × PING÷2)`,
);
console.log(
  `token bucket take + release        ${fmt(bucket)} admissions/s (${(bucket / ping).toFixed(2)} × PING)`,
);
console.log(
  `Redis round trips per admission          ${calls1.toFixed(2)} uncontended, ${calls8.toFixed(2)} with 8 callers on 2 permits`,
);
console.log(
  `handoff release → grant (2 procs)  p50 ${percentile(lat, 50).toFixed(2)} ms, p99 ${percentile(lat, 99).toFixed(2)} ms over ${lat.length} rounds`,
);
client.disconnect();
await server.stop();
