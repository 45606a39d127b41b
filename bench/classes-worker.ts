/**
 * One worker process of the Redis traffic-classes benchmarks (the semaphore's and the token
 * bucket's). On `run` it builds the set-up on the shared Redis (under the given prefix) and, from
 * the given moment (monotonic clock, shared by every process of the machine), runs its role until
 * the deadline: `bulk` producers each asking again as soon as its call ends (or, on a bucket, as
 * soon as it has its token), or `interactive` calls arriving at a fixed pace. Then it reports
 * counts and waits. It leaves when the parent says `exit` or goes away.
 */
import { redis } from "floodgate/redis";
import * as bucket from "./bucket-classes.js";
import { type Role, type RoleReport, runRole, SETUPS, type SetupName } from "./classes.js";
import { nowMs, serve, sleep, workerClient } from "./worker-child.js";

export interface ClassesRun {
  kind: "run";
  family: "semaphore" | "bucket";
  setup: SetupName | bucket.SetupName;
  role: Role;
  prefix: string;
  /** Monotonic ms (process.hrtime) at which the role starts, and when it stops. */
  startAt: number;
  endAt: number;
}

const client = await workerClient();

serve(
  async (m: ClassesRun) => {
    const backend = redis(client, { prefix: m.prefix });
    // The set-up is built first, then the role starts at its moment.
    let run: () => Promise<RoleReport>;
    if (m.family === "bucket") {
      const take = bucket.SETUPS[m.setup as bucket.SetupName](backend);
      run = () => bucket.runBucketRole(take, m.role, m.endAt, nowMs);
    } else {
      const admit = SETUPS[m.setup as SetupName](backend);
      run = () => runRole(admit, m.role, m.endAt, nowMs);
    }
    await sleep(Math.max(0, m.startAt - nowMs()));
    const report: RoleReport = await run();
    await backend.close();
    return { kind: "done", ...report };
  },
  async () => client.disconnect(),
);
