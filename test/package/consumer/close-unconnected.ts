// Closing Redis stages and their backend when the client never connected throws nothing at the user.
import { Gate } from "floodgate";
import { redis } from "floodgate/redis";
import { Redis } from "ioredis";

const port = Number(process.env.CLOSED_PORT);
if (!Number.isInteger(port) || port <= 0) throw new Error("CLOSED_PORT is not set");

const escaped: unknown[] = [];
process.on("unhandledRejection", (error) => escaped.push(error));
process.on("uncaughtException", (error) => escaped.push(error));

// No "error" listener: an error event ioredis emitted would surface as one the user did not handle.
const client = new Redis(port, "127.0.0.1", { lazyConnect: true, enableOfflineQueue: false });
const backend = redis(client, { commandTimeoutMs: 500 });
const semaphore = backend.semaphore("never", { limit: 1, leaseMs: 5_000 });
const gate = new Gate([backend.tokenBucket("never-rate", { capacity: 1, refillPerSecond: 1 }), semaphore]);

const thrown: string[] = [];
for (const [what, close] of [
  ["gate.close()", () => gate.close()],
  ["semaphore.close()", () => semaphore.close()],
  ["backend.close()", () => backend.close()],
] as const) {
  try {
    await close();
  } catch (error) {
    thrown.push(`${what} threw ${String(error)}`);
  }
}
client.disconnect();
// Anything emitted late (a reconnection, a rejected command) surfaces within this.
await new Promise((resolve) => setTimeout(resolve, 300));
if (thrown.length > 0 || escaped.length > 0) {
  throw new Error([...thrown, ...escaped.map((error) => `escaped: ${String(error)}`)].join("; "));
}
console.log(`closed with the client "${client.status}", nothing thrown`);
