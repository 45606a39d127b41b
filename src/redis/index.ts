/**
 * The Redis backend: `redis(client, options)` builds the same stages as `memory()`, shared by
 * every process that uses the same Redis and prefix.
 *
 * @module floodgate/redis
 */
import type { Cluster, Redis } from "ioredis";
import { StageRegistry } from "../base/registry.js";
import { type Clock, systemClock } from "../clock.js";
import { InvalidOptionsError } from "../errors.js";
import { stageLogger } from "../logger.js";
import { MemoryAimd } from "../memory/aimd.js";
import { MemoryIntervalGate } from "../memory/interval-gate.js";
import { MemoryQueue } from "../memory/queue.js";
import { MemorySemaphore } from "../memory/semaphore.js";
import { MemoryTokenBucket } from "../memory/token-bucket.js";
import type { BackendErrorOptions, StageOptions, TokenBucketOptions } from "../options.js";
import type { Backend, IntervalGateStage, Logger, Stage } from "../types.js";
import { parseOptions, redisBackendSchema } from "../validate.js";
import { RedisAimd } from "./aimd.js";
import { RedisClassBucket } from "./bucket-classes.js";
import { connectionOf, type SupportedClient } from "./clients/index.js";
import { FallbackStage } from "./fallback.js";
import { RedisFusion } from "./fused-gate.js";
import { RedisIntervalGate } from "./interval-gate.js";
import { RedisLink } from "./link.js";
import { RedisQueue } from "./queue.js";
import { type RedisContext, RedisSemaphore } from "./semaphore.js";
import { RedisTokenBucket } from "./token-bucket.js";

export type { IoredisFamilyClient, NodeRedisClient, SupportedClient } from "./clients/index.js";
export { stageKey } from "./keys.js";
export type { LeaseTicket } from "./lease.js";
export { commandName, SCRIPTS, type ScriptName, scriptSha, scriptSource } from "./scripts.js";

/** Whether token bucket options ask for classes (checked, with everything else, when it is built). */
function hasClasses(opts: unknown): boolean {
  const o = opts as { classes?: unknown; defaultClass?: unknown } | null | undefined;
  return o?.classes !== undefined || o?.defaultClass !== undefined;
}

export {
  FallbackStage,
  RedisAimd,
  RedisClassBucket,
  RedisIntervalGate,
  RedisQueue,
  RedisSemaphore,
  RedisTokenBucket,
};

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
  /**
   * How long a process counts as alive after its last sign of life, ms. A process with waiters
   * gives one with each wait and every `livenessMs / 3` (one call per stage, whatever its number
   * of waiters); one that stops (killed, frozen, its event loop blocked that long) has its waiters
   * taken out of the line and granted nothing, and a grant made to it just before comes back
   * within this time. Held leases are not affected: they last `leaseMs`. An integer >= 100.
   * @default 2000
   */
  livenessMs?: number;
  /**
   * How long a permit granted to a waiter on someone else's release stays the waiter's before
   * its process claims it, ms. The waiter's process claims it with its first renewal, at 80% of
   * this, when the call is still running then (shorter calls never need to). A permit granted to
   * a process that dies or freezes before it claims it comes back after this long. Never longer
   * than the stage's lease. An integer >= 20.
   * @default 500
   */
  claimMs?: number;
  /** Randomness for jitter. @default Math.random */
  random?: () => number;
  /** Default `onBackendError` of every stage this backend builds. @default "fail-closed" */
  onBackendError?: "fail-closed" | "fail-open" | "local";
  /**
   * A connection for the pub/sub wake-ups, which need one of their own: a client of the same
   * library as `client` (for node-redis, connected or not; it is connected when first needed).
   * You own it: `close()` leaves it open. @default `client.duplicate()`, made on first need and
   * closed by `close()`
   */
  subscriber?: RedisClient;
}

/** The Redis backend: every stage it builds is shared by all processes using the same Redis and prefix. */
export interface RedisBackend extends Backend {
  readonly kind: "redis";
}

/**
 * A client `redis(client)` accepts, recognised by its shape: an ioredis (5, 6) or iovalkey
 * `Redis` or `Cluster`, or a node-redis (5, 6) client from `createClient()` or `createCluster()`.
 */
export type RedisClient = Redis | Cluster | SupportedClient;

/** At least one of anything countable. */
const share = (n: number, by: number) => Math.max(1, Math.floor(n * by));

/**
 * The Redis backend. Pass an ioredis or iovalkey `Redis` or `Cluster` client (create it with
 * `enableOfflineQueue: false`), or a node-redis client from `createClient()` or `createCluster()`
 * (with `disableOfflineQueue: true`), so a Redis outage fails calls at once instead of queueing a
 * burst to replay later. floodgate also refuses to send while the client is not ready, but for
 * its first connection, which the first calls wait for up to `commandTimeoutMs` (a client not
 * told to connect yet, `lazyConnect` or a node-redis client before `connect()`, is connected by
 * the first call). Throws `InvalidOptionsError` for anything else.
 *
 * ```ts
 * const backend = redis(new Redis(process.env.REDIS_URL, { enableOfflineQueue: false }), { prefix: "sos:" });
 * const portal = backend.semaphore("de-inflight", { limit: 8, leaseMs: 15_000 });
 * ```
 */
export function redis(client: RedisClient, options: RedisBackendOptions = {}): RedisBackend {
  const o = parseOptions(redisBackendSchema, "redis", undefined, options);
  const connection = connectionOf(client);
  if (connection === undefined) {
    throw new InvalidOptionsError(
      undefined,
      "client",
      "redis: client must be an ioredis or iovalkey Redis or Cluster client, or a node-redis client (createClient or createCluster)",
    );
  }
  const subscriber = o.subscriber === undefined ? undefined : connectionOf(o.subscriber, false);
  if (o.subscriber !== undefined && (subscriber === undefined || subscriber.library !== connection.library)) {
    throw new InvalidOptionsError(
      undefined,
      "subscriber",
      `redis: subscriber must be a client of the same library as client (${connection.library})`,
    );
  }
  const clock: Clock = o.clock ?? systemClock;
  const logger: Logger | undefined = o.logger;
  const log = stageLogger(logger, "redis", "gate", "redis");
  const link = new RedisLink(
    connection,
    clock,
    o.commandTimeoutMs ?? 2000,
    log,
    (o.time ?? "server") === "clock",
    subscriber,
  );
  const prefix = o.prefix ?? "floodgate:";
  const registry = new StageRegistry();
  // A Gate's stages share one slot only on one server: on a Cluster each stage has its own.
  const fusion =
    link.listeners === "1"
      ? new RedisFusion({ link, prefix, clock, random: o.random ?? Math.random, pollMs: o.pollMs ?? 1000 })
      : undefined;
  const ctx = (options: StageOptions): RedisContext => ({
    link,
    prefix,
    clock: options?.clock ?? clock,
    logger,
    random: o.random ?? Math.random,
    pollMs: o.pollMs ?? 1000,
    livenessMs: o.livenessMs ?? 2000,
    claimMs: o.claimMs ?? 500,
    fusion,
  });

  /**
   * The stage itself under `fail-closed`; else the stage behind a `FallbackStage` whose local
   * stage (for `local`) is an in-memory one holding this process's share of the limits.
   */
  function withPolicy<O extends StageOptions & BackendErrorOptions>(
    stage: Stage,
    options: O,
    localStage: (share: number, options: O) => Stage,
  ): Stage {
    const policy = options.onBackendError ?? o.onBackendError ?? "fail-closed";
    if (policy === "fail-closed") return stage;
    const { onBackendError: _policy, localShare: _share, ...rest } = options;
    const localOptions = { ...rest, clock: options.clock ?? clock, logger: options.logger ?? logger } as O;
    const local = policy === "local" ? localStage(options.localShare ?? 1, localOptions) : undefined;
    const log = stageLogger(options.logger ?? logger, stage.name, stage.kind, "redis");
    return new FallbackStage(stage, policy, local, options.clock ?? clock, log);
  }

  return {
    kind: "redis",
    semaphore: (name, opts) =>
      registry.build("semaphore", name, opts, () =>
        withPolicy(new RedisSemaphore(name, opts, ctx(opts)), opts, (k, local) => {
          return new MemorySemaphore(name, { ...local, limit: share(opts.limit, k) }, local.clock!);
        }),
      ),
    queue: (name, opts) =>
      registry.build("queue", name, opts, () =>
        withPolicy(new RedisQueue(name, opts, ctx(opts)), opts, (k, local) => {
          return new MemoryQueue(name, { ...local, maxSize: share(opts.maxSize, k) }, local.clock!);
        }),
      ),
    aimd: (name, opts) =>
      registry.build("aimd", name, opts, () =>
        withPolicy(new RedisAimd(name, opts, ctx(opts)), opts, (k, local) => {
          const max = share(opts.max, k);
          const min = Math.min(opts.min ?? 1, max);
          const initial = Math.min(max, Math.max(min, share(opts.initial, k)));
          return new MemoryAimd(name, { ...local, initial, min, max }, local.clock!);
        }),
      ),
    tokenBucket: (name, opts) =>
      registry.build("tokenBucket", name, opts, () =>
        withPolicy(
          !hasClasses(opts)
            ? new RedisTokenBucket(name, opts, ctx(opts))
            : new RedisClassBucket(name, opts, ctx(opts)),
          opts,
          (k, local) => {
            const capacity = share(opts.capacity, k);
            const scaled: TokenBucketOptions = {
              ...local,
              capacity,
              refillPerSecond: opts.refillPerSecond * k,
            };
            if (opts.initialTokens !== undefined)
              scaled.initialTokens = Math.min(capacity, Math.floor(opts.initialTokens * k));
            return new MemoryTokenBucket(name, scaled, local.clock!);
          },
        ),
      ),
    intervalGate: (name, opts) =>
      registry.build(
        "intervalGate",
        name,
        opts,
        () =>
          withPolicy(new RedisIntervalGate(name, opts, ctx(opts)), opts, (k, local) => {
            const spaced = { ...local, minIntervalMs: opts.minIntervalMs / k };
            return new MemoryIntervalGate(name, spaced, local.clock!, o.random ?? Math.random);
          }) as IntervalGateStage,
      ),
    async close() {
      await registry.close();
      await link.close();
    },
    [Symbol.asyncDispose]() {
      return this.close();
    },
  };
}
