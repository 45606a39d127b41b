import { classBook } from "../base/classes.js";
import type { Clock } from "../clock.js";
import { fusable } from "../fuse.js";
import type { SemaphoreOptions } from "../options.js";
import type { StageKind } from "../types.js";
import { parseOptions, semaphoreSchema } from "../validate.js";
import { memoryFusion } from "./fused-gate.js";
import { PermitStage } from "./permit-stage.js";

export { PermitStage } from "./permit-stage.js";

/**
 * Counting semaphore: at most `limit` permits held at once, FIFO, weighted by `cost`; with
 * `classes`, divided into guaranteed shares that lend what they leave idle.
 */
export class MemorySemaphore extends PermitStage {
  readonly kind: StageKind = "semaphore";

  constructor(name: string, options: SemaphoreOptions, clock: Clock) {
    const o = parseOptions(semaphoreSchema, "semaphore", name, options);
    super(name, o.limit, clock, classBook("semaphore", name, o, o.limit, o.limit), o.reclaim === "signal");
    // Without classes, a Gate can decide it together with other memory stages (see memoryFusion).
    if (!this.book) fusable(this, memoryFusion(clock));
    this.init(o.logger);
  }
}
