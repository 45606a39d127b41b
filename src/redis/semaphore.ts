import { classBook } from "../base/classes.js";
import { DEFAULTS } from "../defaults.js";
import type { SemaphoreOptions } from "../options.js";
import type { StageKind } from "../types.js";
import { parseOptions, semaphoreSchema } from "../validate.js";
import type { RedisContext } from "./context.js";
import { RedisPermitStage } from "./permit-stage.js";

export type { RedisContext } from "./context.js";
export { RedisPermitStage } from "./permit-stage.js";

/**
 * `redis(...).semaphore(name, options)`: at most `limit` permits held across the fleet; with
 * `classes`, divided into guaranteed shares that lend what they leave idle, decided in Redis.
 */
export class RedisSemaphore extends RedisPermitStage {
  readonly kind: StageKind = "semaphore";

  constructor(name: string, options: SemaphoreOptions, ctx: RedisContext) {
    const o = parseOptions(semaphoreSchema, "semaphore", name, options);
    super(
      name,
      {
        limit: o.limit,
        initial: o.limit,
        maxCost: o.limit,
        leaseMs: o.leaseMs ?? DEFAULTS.leaseMs,
        whenFull: "block",
        logger: o.logger,
        reclaim: o.reclaim === "signal",
      },
      ctx,
      classBook("semaphore", name, o, o.limit, o.limit),
    );
    this.init(o.logger ?? ctx.logger);
  }
}
