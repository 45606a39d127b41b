/**
 * One worker process of the Redis token bucket traffic-classes benchmark. On `run` it builds the
 * set-up on the shared Redis (under the given prefix) and, from the given moment (monotonic
 * clock, shared by every process of the machine), runs its role until the deadline: `bulk`
 * producers each asking again as soon as it has its token, or `interactive` calls arriving at a
 * fixed pace. Then it reports counts and waits. It leaves when the parent says `exit` or goes
 * away.
 */
import { redis } from "floodgate/redis";
import { runBucketRole, SETUPS, type SetupName } from "./bucket-classes.js";
import type { Role, RoleReport } from "./classes.js";
import { nowMs, serve, sleep, workerClient } from "./worker-child.js";

export interface BucketClassesRun {
  kind: "run";
  setup: SetupName;
  role: Role;
  prefix: string;
  /** Monotonic ms (process.hrtime) at which the role starts, and when it stops. */
  startAt: number;
  endAt: number;
}

const client = await workerClient();

serve(
  async (m: BucketClassesRun) => {
    const backend = redis(client, { prefix: m.prefix });
    const take = SETUPS[m.setup](backend);
    await sleep(Math.max(0, m.startAt - nowMs()));
    const report: RoleReport = await runBucketRole(take, m.role, m.endAt, nowMs);
    await backend.close();
    return { kind: "done", ...report };
  },
  async () => client.disconnect(),
);
