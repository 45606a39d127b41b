/**
 * Traffic classes on a token bucket: interactive calls arriving while bulk work drains the
 * bucket, through one bucket with classes, one shared bucket, and a static split (two buckets
 * with 80% and 20% of the rate and capacity). Real time: each call waits for its token and
 * holds nothing after.
 */
import { type Backend, memory } from "floodgate";
import {
  BULK_PROCESSES,
  type ClassesTable,
  measure,
  onWorkers,
  type Role,
  type RoleReport,
  type Scenario,
} from "./classes.js";
import { type BenchArgs, type Benchmark, si, sleep } from "./lib.js";

const RATE = 100;
const CAPACITY = 20;
/** Bulk producers, each asking again as soon as it has its token. */
const BULK_PRODUCERS = 10;
/** One interactive call every this many milliseconds (40 a second: half its share of 80). */
const INTERACTIVE_EVERY_MS = 25;
/** How long bulk drains the bucket before interactive starts: its burst, and more. */
const DRAIN_MS = 300;

export type Take = (cls: "interactive" | "bulk") => Promise<unknown>;

export const SETUPS = {
  classes: (b: Backend): Take => {
    const bucket = b.tokenBucket("classes", {
      capacity: CAPACITY,
      refillPerSecond: RATE,
      classes: { interactive: { share: 80, priority: 1 }, bulk: { share: 20 } },
    });
    return (cls) => bucket.admit({ class: cls });
  },
  "one shared bucket": (b: Backend): Take => {
    const bucket = b.tokenBucket("shared", { capacity: CAPACITY, refillPerSecond: RATE });
    return () => bucket.admit();
  },
  "static split (80% + 20%)": (b: Backend): Take => {
    const interactive = b.tokenBucket("interactive", { capacity: 16, refillPerSecond: 80 });
    const bulk = b.tokenBucket("bulk", { capacity: 4, refillPerSecond: 20 });
    return (cls) => (cls === "interactive" ? interactive : bulk).admit();
  },
};
export type SetupName = keyof typeof SETUPS;

/** Run `role` through `take` until `endAt` (on the clock `now`): interactive waits (ms), bulk calls done. */
export async function runBucketRole(
  take: Take,
  role: Role,
  endAt: number,
  now: () => number,
): Promise<RoleReport> {
  let bulkDone = 0;
  const waits: number[] = [];
  if (role.kind === "bulk") {
    await Promise.all(
      Array.from({ length: role.producers }, async () => {
        while (now() < endAt) {
          await take("bulk");
          if (now() <= endAt) bulkDone++;
        }
      }),
    );
    return { waits, bulkDone };
  }
  const calls: Promise<void>[] = [];
  while (now() < endAt) {
    const asked = now();
    calls.push(take("interactive").then(() => void waits.push(now() - asked)));
    await sleep(INTERACTIVE_EVERY_MS);
  }
  await Promise.all(calls);
  return { waits, bulkDone };
}

/** One run of `seconds` in this process: bulk producers (if any) and interactive arrivals (if any). */
async function scenario(take: Take, seconds: number, bulk: boolean, interactive: boolean) {
  const now = () => performance.now();
  const end = now() + seconds * 1000;
  const roles: Promise<RoleReport>[] = [];
  if (bulk) roles.push(runBucketRole(take, { kind: "bulk", producers: BULK_PRODUCERS }, end, now));
  // Interactive starts once bulk has drained the bucket.
  if (interactive)
    roles.push(sleep(bulk ? DRAIN_MS : 0).then(() => runBucketRole(take, { kind: "interactive" }, end, now)));
  const reports = await Promise.all(roles);
  return {
    waits: reports.flatMap((r) => r.waits),
    bulkDone: reports.reduce((sum, r) => sum + r.bulkDone, 0) / seconds,
  };
}

/** The table's wording, `label` and `where` saying on what and where the producers run. */
function bucketTable(label: string, where: string): ClassesTable<SetupName> {
  return {
    classes: "classes",
    shared: "one shared bucket",
    split: "static split (80% + 20%)",
    title: `${label}: ${RATE} tokens/s, capacity ${CAPACITY}, ${BULK_PRODUCERS} bulk producers${where}, interactive every ${INTERACTIVE_EVERY_MS} ms`,
    unit: "bucket",
    boundMs: 1000 / RATE,
    bound: "one token's refill",
    whole: (w) => `one bucket, bulk alone: ${si(w)}/s, the first second's burst included`,
  };
}

export const bucketClassesBench: Benchmark = {
  name: "bucket-classes",
  title: "traffic classes on a token bucket",
  redis: false,
  async run(args: BenchArgs) {
    const seconds = args.seconds ?? (args.quick ? 0.5 : 3);
    const count = args.rounds ?? (args.quick ? 1 : 3);
    const run: Scenario<SetupName> = (setup, s, bulk, interactive) =>
      scenario(SETUPS[setup](memory()), s, bulk, interactive);
    await measure(bucketTable("Traffic classes on a token bucket (memory)", ""), run, seconds, count);
  },
};

export const redisBucketClassesBench: Benchmark = {
  name: "redis-bucket-classes",
  title: "traffic classes on a Redis token bucket, worker processes",
  redis: true,
  async run(args: BenchArgs) {
    const seconds = args.seconds ?? (args.quick ? 0.5 : 3);
    const count = args.rounds ?? (args.quick ? 1 : 3);
    const where = ` in ${BULK_PROCESSES} processes, interactive in another`;
    await onWorkers<SetupName>(await args.redisUrl(), "bucket", BULK_PRODUCERS, DRAIN_MS, (run) =>
      measure(bucketTable("Traffic classes on a Redis token bucket", where), run, seconds, count),
    );
  },
};
