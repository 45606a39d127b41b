import type { WaitFor } from "../base/stage.js";
import { shedChannel } from "../channels.js";
import type { Clock } from "../clock.js";
import { ShedError } from "../errors.js";
import type { QueueOptions } from "../options.js";
import type { Snapshot, StageKind } from "../types.js";
import { parseOptions, queueSchema } from "../validate.js";
import { PermitStage } from "./semaphore.js";

/**
 * Bounded queue: at most `maxSize` jobs hold a slot at once. A slot is held while the job waits;
 * in a `Gate` it is given back as soon as every later stage has admitted the job. When full,
 * `whenFull: "block"` makes the producer wait (backpressure); `"shed"` rejects with `ShedError`.
 */
export class MemoryQueue extends PermitStage {
  override readonly kind: StageKind = "queue";
  override readonly holds = "wait" as const;
  protected override readonly waitFor: WaitFor = "queue";
  readonly whenFull: "block" | "shed";

  constructor(name: string, options: QueueOptions, clock: Clock) {
    const o = parseOptions(queueSchema, "queue", name, options);
    super(name, o.maxSize, clock);
    this.whenFull = o.whenFull ?? "block";
    this.init(o.logger);
  }

  protected override get blocks(): boolean {
    return this.whenFull === "block";
  }

  protected override shedding(cost: number): Promise<never> | undefined {
    if (this.whenFull === "block") return undefined;
    this.shed++;
    this.log.warn({ depth: this.used, maxSize: this.limit }, "queue full, shed");
    if (shedChannel.hasSubscribers)
      shedChannel.publish({ stage: this.name, kind: this.kind, backend: this.backend, cost });
    return Promise.reject(
      new ShedError(this.name, `queue "${this.name}": full (maxSize ${this.limit}), job shed`),
    );
  }

  override snapshot(): Snapshot {
    const s = this.baseSnapshot(this.limit);
    s.queueDepth = this.used;
    return s;
  }
}
