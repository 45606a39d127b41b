/**
 * The simplest fleet semaphore there is, as a baseline: leases in a sorted set scored by expiry
 * (Redis's clock), acquire tries one script and sleeps 200 ms between tries, release deletes the
 * lease. No queue, no wake-up.
 */
import { randomUUID } from "node:crypto";
import type { Redis } from "ioredis";

const ACQUIRE = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
  return 1
end
return 0`;

type PollClient = Redis & {
  benchPollAcquire(key: string, limit: number, leaseMs: number, id: string): Promise<number>;
};

export class PollingSemaphore {
  readonly #client: PollClient;

  constructor(
    client: Redis,
    readonly key: string,
    readonly limit: number,
    readonly leaseMs = 15_000,
    readonly pollMs = 200,
  ) {
    if (!("benchPollAcquire" in client))
      client.defineCommand("benchPollAcquire", { numberOfKeys: 1, lua: ACQUIRE });
    this.#client = client as PollClient;
  }

  /** Try until granted, every `pollMs`, until `signal` aborts; resolves to a release function. */
  async acquire(signal: AbortSignal): Promise<() => Promise<unknown>> {
    const id = randomUUID();
    for (;;) {
      signal.throwIfAborted();
      if (Number(await this.#client.benchPollAcquire(this.key, this.limit, this.leaseMs, id)) === 1) {
        return () => this.#client.zrem(this.key, id);
      }
      await new Promise<void>((resolve) => {
        const done = () => {
          clearTimeout(timer);
          signal.removeEventListener("abort", done);
          resolve();
        };
        const timer = setTimeout(done, this.pollMs);
        signal.addEventListener("abort", done);
      });
    }
  }
}
