import type { WaitFor } from "../base/stage.js";
import { DEFAULTS } from "../defaults.js";
import type { QueueOptions } from "../options.js";
import type { Snapshot, StageKind } from "../types.js";
import { parseOptions, queueSchema } from "../validate.js";
import { type RedisContext, RedisPermitStage } from "./semaphore.js";

/**
 * `redis(...).queue(name, options)`: at most `maxSize` jobs hold a slot across the fleet. A slot
 * is a lease like a semaphore permit, so a dead producer's slots come back by themselves.
 */
export class RedisQueue extends RedisPermitStage {
  readonly kind: StageKind = "queue";
  override readonly holds = "wait" as const;
  protected override readonly waitFor: WaitFor = "queue";

  constructor(name: string, options: QueueOptions, ctx: RedisContext) {
    const o = parseOptions(queueSchema, "queue", name, options);
    super(
      name,
      {
        limit: o.maxSize,
        initial: o.maxSize,
        maxCost: o.maxSize,
        leaseMs: DEFAULTS.leaseMs,
        whenFull: o.whenFull ?? "block",
        logger: o.logger,
        reclaim: false,
      },
      ctx,
    );
    this.init(o.logger ?? ctx.logger);
  }

  override snapshot(): Snapshot {
    const s = this.baseSnapshot(this.limit);
    s.queueDepth = this.inFlight;
    return s;
  }
}
