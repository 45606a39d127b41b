/**
 * One worker process of the fleet-fairness benchmark of a Redis token bucket. On `run` it starts
 * `callers` callers at the given moment (monotonic clock, shared by every process of the
 * machine); each asks the shared bucket for one token, again and again, until the deadline, and
 * the worker reports each caller's admissions and every wait. It leaves when the parent says
 * `exit` or goes away.
 */
import { Gate } from "floodgate";
import { redis } from "floodgate/redis";
import { RateLimiterRedis, RateLimiterRes } from "rate-limiter-flexible";
import { nowMs, serve, sleep, workerClient } from "./worker-child.js";

export type FairContender = "floodgate" | "floodgate-gate" | "rate-limiter-flexible";

export interface FairRun {
  kind: "run";
  contender: FairContender;
  prefix: string;
  callers: number;
  rate: number;
  capacity: number;
  /** Monotonic ms (process.hrtime) at which the callers start, and when they stop. */
  startAt: number;
  endAt: number;
}

export interface FairReport {
  kind: "done";
  /** Admissions of each caller before the deadline. */
  counts: number[];
  /** Every admission's wait, ms. */
  waits: number[];
}

const client = await workerClient();

/** One token, however the contender gives it. */
function taker(m: FairRun): { take: () => Promise<unknown>; close: () => Promise<void> } {
  if (m.contender === "floodgate") {
    const backend = redis(client, { prefix: m.prefix });
    const bucket = backend.tokenBucket("fair", { capacity: m.capacity, refillPerSecond: m.rate });
    return { take: () => bucket.admit(), close: () => backend.close() };
  }
  if (m.contender === "floodgate-gate") {
    // The same bucket in a fused gate with a semaphore that never binds: its callers wait in the
    // gate's lane in Redis.
    const backend = redis(client, { prefix: m.prefix });
    const gate = new Gate([
      backend.tokenBucket("fair", { capacity: m.capacity, refillPerSecond: m.rate }),
      backend.semaphore("inflight", { limit: 10_000 }),
    ]);
    const take = async () => (await gate.admit()).release("success");
    return { take, close: () => backend.close() };
  }
  // rate-limiter-flexible counts points in fixed windows: `rate` points a second; a refused
  // caller sleeps the msBeforeNext it is told, then asks again.
  const limiter = new RateLimiterRedis({
    storeClient: client,
    keyPrefix: m.prefix,
    points: m.rate,
    duration: 1,
  });
  const take = async () => {
    for (;;) {
      try {
        return await limiter.consume("fair");
      } catch (error) {
        if (!(error instanceof RateLimiterRes)) throw error;
        await sleep(Math.max(1, error.msBeforeNext));
      }
    }
  };
  return { take, close: async () => {} };
}

serve(
  async (m: FairRun): Promise<FairReport> => {
    const { take, close } = taker(m);
    await sleep(Math.max(0, m.startAt - nowMs()));
    const counts = new Array<number>(m.callers).fill(0);
    const waits: number[] = [];
    await Promise.all(
      counts.map(async (_, i) => {
        while (nowMs() < m.endAt) {
          const asked = nowMs();
          await take();
          const at = nowMs();
          if (at > m.endAt) break;
          counts[i]!++;
          waits.push(at - asked);
        }
      }),
    );
    await close();
    return { kind: "done", counts, waits };
  },
  async () => client.disconnect(),
);
