/**
 * The waiting side of the handoff benchmark, in a process of its own. On `wait` it starts waiting
 * (a floodgate semaphore's or fused gate's admit, a redis-semaphore acquire, or a BLPOP), says
 * `queued`, and on the grant reports the moment (monotonic clock, shared by every process of the
 * machine) and lets go again.
 */
import { Gate, type Ticket } from "floodgate";
import { redis } from "floodgate/redis";
import { Redis } from "ioredis";
import { Semaphore } from "redis-semaphore";
import { handoffGateStages, handoffOtherGateStages } from "./handoff.js";

type Message = { kind: "wait"; lib: string; key: string } | { kind: "exit" };

const [url, prefix] = process.argv.slice(2) as [string, string];
const client = new Redis(url, { enableOfflineQueue: false });
const blocking = new Redis(url, { enableOfflineQueue: false });
client.on("error", () => {});
blocking.on("error", () => {});
await Promise.all([
  new Promise((r) => client.once("ready", r)),
  new Promise((r) => blocking.once("ready", r)),
]);
const backend = redis(client, { prefix });
const floodgate = backend.semaphore("handoff", { limit: 1 });
const gate = new Gate(handoffGateStages(backend), { name: "handoff-gate" });
const other = new Gate(handoffOtherGateStages(backend), { name: "handoff-other" });
/** floodgate's waits, by the `lib` the parent names. */
const floodgateAdmits: Record<string, () => Promise<Ticket>> = {
  floodgate: () => floodgate.admit(),
  gate: () => gate.admit(),
  "gate-other": () => other.admit(),
};
const nowMs = () => Number(process.hrtime.bigint()) / 1e6;
const send = (m: object) => process.send!(m);

async function wait(lib: string, key: string): Promise<void> {
  const admit = floodgateAdmits[lib];
  if (admit) {
    const pending = admit();
    send({ kind: "queued" });
    const ticket = await pending;
    const at = nowMs();
    await ticket.release("success");
    send({ kind: "granted", at });
  } else if (lib === "redis-semaphore") {
    const sem = new Semaphore(client, key, 1, { acquireTimeout: 60_000 });
    const pending = sem.acquire();
    send({ kind: "queued" });
    await pending;
    const at = nowMs();
    await sem.release();
    send({ kind: "granted", at });
  } else {
    const pending = blocking.blpop(key, 0);
    send({ kind: "queued" });
    await pending;
    send({ kind: "granted", at: nowMs() });
  }
}

process.on("message", (m: Message) => {
  if (m.kind === "wait") {
    wait(m.lib, m.key).catch((error: unknown) => send({ kind: "error", message: String(error) }));
  } else {
    void backend.close().finally(() => {
      client.disconnect();
      blocking.disconnect();
      process.exit(0);
    });
  }
});
// Leave by itself if the parent goes away.
process.on("disconnect", () => process.exit(0));
send({ kind: "ready" });
