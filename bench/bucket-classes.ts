/**
 * Traffic classes on a token bucket: interactive calls arriving while bulk work drains the
 * bucket, through one bucket with classes, one shared bucket, and a static split (two buckets
 * with 80% and 20% of the rate and capacity). Real time: each call waits for its token and
 * holds nothing after.
 */
import { type Backend, memory } from "floodgate";
import { measure, type Scenario } from "./classes.js";
import { type BenchArgs, type Benchmark, si, sleep } from "./lib.js";

const RATE = 100;
const CAPACITY = 20;
/** Bulk producers, each asking again as soon as it has its token. */
const BULK_PRODUCERS = 10;
/** One interactive call every this many milliseconds (40 a second: half its share of 80). */
const INTERACTIVE_EVERY_MS = 25;

type Take = (cls: "interactive" | "bulk") => Promise<unknown>;

const SETUPS = {
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
type SetupName = keyof typeof SETUPS;

/** One run of `seconds` in this process: bulk producers (if any) and interactive arrivals (if any). */
async function scenario(take: Take, seconds: number, bulk: boolean, interactive: boolean) {
  const end = performance.now() + seconds * 1000;
  let bulkDone = 0;
  const producers = bulk
    ? Array.from({ length: BULK_PRODUCERS }, async () => {
        while (performance.now() < end) {
          await take("bulk");
          if (performance.now() <= end) bulkDone++;
        }
      })
    : [];
  const waits: number[] = [];
  const calls: Promise<void>[] = [];
  if (interactive) {
    // Let bulk drain the bucket first.
    await sleep(bulk ? 300 : 0);
    while (performance.now() < end) {
      const asked = performance.now();
      calls.push(take("interactive").then(() => void waits.push(performance.now() - asked)));
      await sleep(INTERACTIVE_EVERY_MS);
    }
  }
  await Promise.all([...producers, ...calls]);
  return { waits, bulkDone: bulkDone / seconds };
}

export const bucketClassesBench: Benchmark = {
  name: "bucket-classes",
  title: "traffic classes on a token bucket",
  redis: false,
  async run(args: BenchArgs) {
    const seconds = args.seconds ?? (args.quick ? 1 : 3);
    const count = args.rounds ?? (args.quick ? 1 : 3);
    const run: Scenario<SetupName> = (setup, s, bulk, interactive) =>
      scenario(SETUPS[setup](memory()), s, bulk, interactive);
    await measure(
      {
        classes: "classes",
        shared: "one shared bucket",
        split: "static split (80% + 20%)",
        title: `Traffic classes on a token bucket (memory): ${RATE} tokens/s, capacity ${CAPACITY}, ${BULK_PRODUCERS} bulk producers, interactive every ${INTERACTIVE_EVERY_MS} ms`,
        unit: "bucket",
        boundMs: 1000 / RATE,
        bound: "one token's refill",
        whole: (w) => `one bucket, bulk alone: ${si(w)}/s, the first second's burst included`,
      },
      run,
      seconds,
      count,
    );
  },
};
