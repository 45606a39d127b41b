import { redis } from "floodgate/redis";
import { Redis } from "ioredis";

// A waiter in another process: on "wait", admit and report the moment of the grant.
const [url, prefix] = process.argv.slice(2) as [string, string];
const client = new Redis(url, { enableOfflineQueue: false });
await new Promise((r) => client.once("ready", r));
const sem = redis(client, { prefix }).semaphore("handoff", { limit: 1 });
process.on("message", async (m: { kind: string }) => {
  if (m.kind === "wait") {
    const pending = sem.admit();
    process.send!({ kind: "queued" });
    const ticket = await pending;
    const at = performance.timeOrigin + performance.now();
    await ticket.release("success");
    process.send!({ kind: "granted", at });
  } else if (m.kind === "exit") {
    client.disconnect();
    process.exit(0);
  }
});
process.send!({ kind: "ready" });
