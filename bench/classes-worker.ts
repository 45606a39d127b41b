/**
 * One worker process of the Redis traffic-classes benchmark. On `run` it builds the set-up on
 * the shared Redis (under the given prefix) and, from the given moment (monotonic clock, shared
 * by every process of the machine), runs its role until the deadline: `bulk` producers each
 * calling again as soon as its call ends, or `interactive` calls arriving at a fixed pace. Then
 * it reports counts and waits. It leaves when the parent says `exit` or goes away.
 */
import { redis } from "floodgate/redis";
import { Redis } from "ioredis";
import { type Role, type RoleReport, runRole, SETUPS, type SetupName } from "./classes.js";

export interface ClassesRun {
  kind: "run";
  setup: SetupName;
  role: Role;
  prefix: string;
  /** Monotonic ms (process.hrtime) at which the role starts, and when it stops. */
  startAt: number;
  endAt: number;
}

const [redisUrl] = process.argv.slice(2) as [string];
const client = new Redis(redisUrl, { enableOfflineQueue: false, maxRetriesPerRequest: 1 });
client.on("error", () => {});
await new Promise((r) => client.once("ready", r));
const nowMs = () => Number(process.hrtime.bigint()) / 1e6;
const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

process.on("disconnect", () => process.exit(0));
process.on("message", async (m: ClassesRun | { kind: "exit" }) => {
  if (m.kind === "exit") {
    client.disconnect();
    process.exit(0);
  }
  try {
    const backend = redis(client, { prefix: m.prefix });
    const admit = SETUPS[m.setup](backend);
    await sleep(Math.max(0, m.startAt - nowMs()));
    const report: RoleReport = await runRole(admit, m.role, m.endAt, nowMs);
    await backend.close();
    process.send!({ kind: "done", ...report });
  } catch (error) {
    process.send!({ kind: "error", message: String(error) });
  }
});
process.send!({ kind: "ready" });
