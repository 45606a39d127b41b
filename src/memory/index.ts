import type { Clock } from "../clock.js";
import { systemClock } from "../clock.js";
import { InvalidOptionsError } from "../errors.js";
import type {
  AimdOptions,
  IntervalGateOptions,
  MemoryBackendOptions,
  QueueOptions,
  SemaphoreOptions,
  StageOptions,
  TokenBucketOptions,
} from "../options.js";
import type { Backend, Logger, StageKind } from "../types.js";
import { checkName, memoryBackendSchema, parseOptions } from "../validate.js";
import { MemoryAimd } from "./aimd.js";
import { MemoryIntervalGate } from "./interval-gate.js";
import { MemoryQueue } from "./queue.js";
import { MemorySemaphore } from "./semaphore.js";
import type { BaseStage } from "../base/stage.js";
import { MemoryTokenBucket } from "./token-bucket.js";

export { MemoryAimd, MemoryIntervalGate, MemoryQueue, MemorySemaphore, MemoryTokenBucket };

/** The in-memory backend: every stage it builds lives in this process. */
export interface MemoryBackend extends Backend {
  readonly kind: "memory";
  semaphore(name: string, options: SemaphoreOptions): MemorySemaphore;
  tokenBucket(name: string, options: TokenBucketOptions): MemoryTokenBucket;
  queue(name: string, options: QueueOptions): MemoryQueue;
  intervalGate(name: string, options: IntervalGateOptions): MemoryIntervalGate;
  aimd(name: string, options: AimdOptions): MemoryAimd;
}

/** Options data (not clock, logger or random) as a comparable string. */
function fingerprint(options: object): string {
  return JSON.stringify(options, (key, value) =>
    key === "clock" || key === "logger" || key === "random" ? undefined : value,
  );
}

/**
 * The embedded backend: stages that live in this process. Asking twice for the same kind and name
 * returns the same stage, as two processes naming one Redis stage share it; asking with other
 * options throws.
 */
export function memory(options: MemoryBackendOptions = {}): MemoryBackend {
  const o = parseOptions(memoryBackendSchema, "memory", undefined, options);
  const clock: Clock = o.clock ?? systemClock;
  const logger: Logger | undefined = o.logger;
  const random = o.random ?? Math.random;
  const stages = new Map<string, { stage: BaseStage; fingerprint: string }>();

  function build<O extends StageOptions, S extends BaseStage>(
    kind: StageKind,
    name: string,
    options: O,
    make: (name: string, options: O, clock: Clock) => S,
  ): S {
    checkName(kind, name);
    if (typeof options !== "object" || options === null) {
      throw new InvalidOptionsError(name, "options", `${kind} "${name}": options must be an object`);
    }
    const id = `${kind}:${name}`;
    const print = fingerprint(options);
    const existing = stages.get(id);
    if (existing) {
      if (existing.fingerprint !== print) {
        throw new InvalidOptionsError(
          name,
          "options",
          `${kind} "${name}": already built with other options (${existing.fingerprint}); one name, one configuration`,
        );
      }
      return existing.stage as S;
    }
    const withDefaults = { ...options };
    if (withDefaults.logger === undefined && logger !== undefined) withDefaults.logger = logger;
    const stage = make(name, withDefaults, options.clock ?? clock);
    stages.set(id, { stage, fingerprint: print });
    return stage;
  }

  return {
    kind: "memory",
    semaphore: (name, opts) => build("semaphore", name, opts, (n, x, c) => new MemorySemaphore(n, x, c)),
    tokenBucket: (name, opts) => build("tokenBucket", name, opts, (n, x, c) => new MemoryTokenBucket(n, x, c)),
    queue: (name, opts) => build("queue", name, opts, (n, x, c) => new MemoryQueue(n, x, c)),
    intervalGate: (name, opts) =>
      build("intervalGate", name, opts, (n, x, c) => new MemoryIntervalGate(n, x, c, random)),
    aimd: (name, opts) => build("aimd", name, opts, (n, x, c) => new MemoryAimd(n, x, c)),
    async close() {
      for (const { stage } of stages.values()) await stage.close();
    },
    [Symbol.asyncDispose]() {
      return this.close();
    },
  };
}
