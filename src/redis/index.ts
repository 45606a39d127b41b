import type { Cluster, Redis } from "ioredis";
import { StageRegistry } from "../base/registry.js";
import { type Clock, systemClock } from "../clock.js";
import { InvalidOptionsError } from "../errors.js";
import { stageLogger } from "../logger.js";
import type {
  AimdOptions,
  IntervalGateOptions,
  QueueOptions,
  SemaphoreOptions,
  StageOptions,
  TokenBucketOptions,
} from "../options.js";
import type { Backend, Logger } from "../types.js";
import { parseOptions, redisBackendSchema } from "../validate.js";
import { RedisAimd } from "./aimd.js";
import { RedisIntervalGate } from "./interval-gate.js";
import { type RedisClientLike, RedisLink } from "./link.js";
import { RedisQueue } from "./queue.js";
import { type RedisContext, RedisSemaphore } from "./semaphore.js";
import { RedisTokenBucket } from "./token-bucket.js";

export { stageKey } from "./keys.js";
export { commandName, SCRIPTS, type ScriptName, scriptSha, scriptSource } from "./scripts.js";
export type { LeaseTicket } from "./semaphore.js";
export { RedisAimd, RedisIntervalGate, RedisQueue, RedisSemaphore, RedisTokenBucket };

/** Options for `redis(client, options)`. */
export interface RedisBackendOptions extends StageOptions {
  /** Put in front of every key; keeps tenants and environments apart. @default "floodgate:" */
  prefix?: string;
  /**
   * Whose clock decides leases and refills. `server`: Redis's `TIME`, so workers with skewed
   * clocks agree. `clock`: the injected `clock` (tests under `FakeClock`; a single host).
   * @default "server"
   */
  time?: "server" | "clock";
  /**
   * Longest wait for one Redis reply, in milliseconds; then the call fails closed with
   * `BackendUnavailableError`. An integer >= 1. @default 2000
   */
  commandTimeoutMs?: number;
  /**
   * Longest a waiter goes without asking Redis again, in milliseconds (jittered ×0.5–1.5). Wake-ups
   * come through pub/sub; the poll only covers a lost message. An integer >= 10. @default 1000
   */
  pollMs?: number;
  /** Randomness for jitter. @default Math.random */
  random?: () => number;
  /**
   * A connection for the pub/sub wake-ups, which need one of their own. You own it: `close()`
   * leaves it open. @default `client.duplicate()`, made on first need and closed by `close()`
   */
  subscriber?: Redis | Cluster;
}

/** The Redis backend: every stage it builds is shared by all processes using the same Redis and prefix. */
export interface RedisBackend extends Backend {
  readonly kind: "redis";
  semaphore(name: string, options: SemaphoreOptions): RedisSemaphore;
  queue(name: string, options: QueueOptions): RedisQueue;
  aimd(name: string, options: AimdOptions): RedisAimd;
  tokenBucket(name: string, options: TokenBucketOptions): RedisTokenBucket;
  intervalGate(name: string, options: IntervalGateOptions): RedisIntervalGate;
}

/**
 * The Redis backend. Pass an ioredis `Redis` or `Cluster` client; create it with
 * `enableOfflineQueue: false` so a Redis outage fails calls at once instead of queueing a burst
 * to replay later (floodgate also refuses to send while the client is not ready).
 *
 * ```ts
 * const backend = redis(new Redis(process.env.REDIS_URL, { enableOfflineQueue: false }), { prefix: "sos:" });
 * const portal = backend.semaphore("de-inflight", { limit: 8, leaseMs: 15_000 });
 * ```
 */
export function redis(client: Redis | Cluster, options: RedisBackendOptions = {}): RedisBackend {
  const o = parseOptions(redisBackendSchema, "redis", undefined, options);
  if (!client || typeof (client as unknown as RedisClientLike).defineCommand !== "function") {
    throw new InvalidOptionsError(
      undefined,
      "client",
      "redis: client must be an ioredis Redis or Cluster client",
    );
  }
  const clock: Clock = o.clock ?? systemClock;
  const logger: Logger | undefined = o.logger;
  const log = stageLogger(logger, "redis", "gate", "redis");
  const link = new RedisLink(
    client as unknown as RedisClientLike,
    clock,
    o.commandTimeoutMs ?? 2000,
    log,
    (o.time ?? "server") === "clock",
    o.subscriber as unknown as RedisClientLike | undefined,
  );
  const prefix = o.prefix ?? "floodgate:";
  const registry = new StageRegistry();
  const ctx = (options: StageOptions): RedisContext => ({
    link,
    prefix,
    clock: options?.clock ?? clock,
    logger,
    random: o.random ?? Math.random,
    pollMs: o.pollMs ?? 1000,
  });

  return {
    kind: "redis",
    semaphore: (name, opts) =>
      registry.build("semaphore", name, opts, () => new RedisSemaphore(name, opts, ctx(opts))),
    queue: (name, opts) => registry.build("queue", name, opts, () => new RedisQueue(name, opts, ctx(opts))),
    aimd: (name, opts) => registry.build("aimd", name, opts, () => new RedisAimd(name, opts, ctx(opts))),
    tokenBucket: (name, opts) =>
      registry.build("tokenBucket", name, opts, () => new RedisTokenBucket(name, opts, ctx(opts))),
    intervalGate: (name, opts) =>
      registry.build("intervalGate", name, opts, () => new RedisIntervalGate(name, opts, ctx(opts))),
    async close() {
      await registry.close();
      await link.close();
    },
    [Symbol.asyncDispose]() {
      return this.close();
    },
  };
}
