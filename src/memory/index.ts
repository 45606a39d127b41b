import { StageRegistry } from "../base/registry.js";
import type { Clock } from "../clock.js";
import { systemClock } from "../clock.js";
import type {
  AimdOptions,
  IntervalGateOptions,
  MemoryBackendOptions,
  QueueOptions,
  SemaphoreOptions,
  StageOptions,
  TokenBucketOptions,
} from "../options.js";
import type { Backend, Logger } from "../types.js";
import { memoryBackendSchema, parseOptions } from "../validate.js";
import { MemoryAimd } from "./aimd.js";
import { MemoryIntervalGate } from "./interval-gate.js";
import { MemoryQueue } from "./queue.js";
import { MemorySemaphore } from "./semaphore.js";
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
  const registry = new StageRegistry();
  const defaults = <O extends StageOptions>(options: O): O =>
    options && typeof options === "object" && options.logger === undefined && logger !== undefined
      ? { ...options, logger }
      : options;
  const clockOf = (options: StageOptions) => options?.clock ?? clock;

  return {
    kind: "memory",
    semaphore: (name, opts) =>
      registry.build("semaphore", name, opts, () => new MemorySemaphore(name, defaults(opts), clockOf(opts))),
    tokenBucket: (name, opts) =>
      registry.build(
        "tokenBucket",
        name,
        opts,
        () => new MemoryTokenBucket(name, defaults(opts), clockOf(opts)),
      ),
    queue: (name, opts) =>
      registry.build("queue", name, opts, () => new MemoryQueue(name, defaults(opts), clockOf(opts))),
    intervalGate: (name, opts) =>
      registry.build(
        "intervalGate",
        name,
        opts,
        () => new MemoryIntervalGate(name, defaults(opts), clockOf(opts), random),
      ),
    aimd: (name, opts) =>
      registry.build("aimd", name, opts, () => new MemoryAimd(name, defaults(opts), clockOf(opts))),
    close: () => registry.close(),
    [Symbol.asyncDispose]() {
      return this.close();
    },
  };
}
