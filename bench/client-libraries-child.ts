/**
 * The waiting side of the client-libraries benchmark's handoff, in a process of its own: one
 * backend per client library. On `wait` it admits on that library's stage, says `queued`, and on
 * the grant reports the moment (monotonic clock, shared by every process of the machine).
 */
import type { Stage } from "floodgate";
import { type RedisBackend, redis } from "floodgate/redis";
import { LIBRARIES, type Opened } from "./client-libraries.js";

type Message = { kind: "wait"; lib: string; stage: string } | { kind: "exit" };

const [url, prefix] = process.argv.slice(2) as [string, string];
const nowMs = () => Number(process.hrtime.bigint()) / 1e6;
const send = (m: object) => process.send!(m);

const opened = new Map<string, Opened>();
const backends = new Map<string, RedisBackend>();
for (const [name, open] of Object.entries(LIBRARIES)) {
  const o = await open(url);
  opened.set(name, o);
  backends.set(name, redis(o.client, { prefix }));
}

const stages = new Map<string, Stage>();

async function wait(lib: string, stage: string): Promise<void> {
  let sem = stages.get(stage);
  if (!sem) {
    sem = backends.get(lib)!.semaphore(stage, { limit: 1 });
    stages.set(stage, sem);
  }
  const pending = sem.admit();
  send({ kind: "queued" });
  const ticket = await pending;
  const at = nowMs();
  await ticket.release("success");
  send({ kind: "granted", at });
}

process.on("message", (m: Message) => {
  if (m.kind === "wait") {
    wait(m.lib, m.stage).catch((error: unknown) => send({ kind: "error", message: String(error) }));
  } else {
    void Promise.all([...backends.values()].map((b) => b.close())).finally(() => {
      for (const o of opened.values()) o.close();
      process.exit(0);
    });
  }
});
// Leave by itself if the parent goes away.
process.on("disconnect", () => process.exit(0));
send({ kind: "ready" });
