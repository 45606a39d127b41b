// A Redis Gate (fused: its two stages are decided in one script call) whose first call is made
// while its client is still connecting.
import { Gate } from "floodgate";
import { redis } from "floodgate/redis";
import { Redis } from "ioredis";

const url = process.env.REDIS_URL;
if (!url) throw new Error("REDIS_URL is not set");

const client = new Redis(url, { enableOfflineQueue: false });
const backend = redis(client, { prefix: `consumer:${process.pid}:` });
const gate = new Gate([
  backend.tokenBucket("rate", { capacity: 10, refillPerSecond: 100 }),
  backend.semaphore("inflight", { limit: 2, leaseMs: 5_000 }),
]);

if (!gate.fused) throw new Error("a Gate of two stages of one Redis backend is not fused");

// No wait for "ready": the first call waits for the client's first connection.
const status = client.status;
const first = await gate.run(async () => "first");
if (first !== "first") throw new Error(`the first call returned ${String(first)}`);

let inFlight = 0;
let most = 0;
await Promise.all(
  Array.from({ length: 8 }, () =>
    gate.run(async () => {
      inFlight++;
      most = Math.max(most, inFlight);
      await new Promise((resolve) => setTimeout(resolve, 10));
      inFlight--;
    }),
  ),
);
if (most > 2) throw new Error(`${most} calls ran at once under a limit of 2`);
await backend.close();
await client.quit();
console.log(`fused gate: first call made with the client "${status}", then 8 calls, at most ${most} at once`);
