import { type AimdConfig, type AimdState, aimdStep } from "../algorithms/aimd.js";
import { classBook } from "../base/classes.js";
import { BaseTicket } from "../base/stage.js";
import type { Clock } from "../clock.js";
import { DEFAULTS } from "../defaults.js";
import { fusable } from "../fuse.js";
import type { AimdOptions } from "../options.js";
import type { Outcome, Snapshot, StageKind } from "../types.js";
import { aimdSchema, parseOptions } from "../validate.js";
import { memoryFusion } from "./fused-gate.js";
import { PermitStage } from "./semaphore.js";

/** A ticket that remembers the AIMD epoch it was admitted in. */
class AimdTicket extends BaseTicket {
  epoch = 0;
}

/**
 * Adaptive concurrency: a semaphore whose limit `aimdStep` moves. A drop (or a success slower
 * than `slowCallMs`) cuts the limit by `backoffRatio`, at most once per window of drops; a
 * success while at least half the limit is in use adds one. A cost must fit under `min`.
 */
export class MemoryAimd extends PermitStage {
  override readonly kind: StageKind = "aimd";
  readonly #config: AimdConfig;
  readonly #slowCallMs: number;
  #state: AimdState;

  constructor(name: string, options: AimdOptions, clock: Clock) {
    const o = parseOptions(aimdSchema, "aimd", name, options);
    super(
      name,
      o.initial,
      clock,
      classBook("aimd", name, o, o.initial, o.min ?? DEFAULTS.aimd.min),
      o.reclaim === "signal",
    );
    this.#config = {
      min: o.min ?? DEFAULTS.aimd.min,
      max: o.max,
      backoffRatio: o.backoffRatio ?? DEFAULTS.aimd.backoffRatio,
    };
    this.#slowCallMs = o.slowCallMs ?? Number.POSITIVE_INFINITY;
    this.#state = { limit: o.initial, epoch: 0 };
    if (!this.book) fusable(this, memoryFusion(clock));
    this.init(o.logger);
  }

  /** An AIMD limiter's limit can fall to `min`: a cost above it could never be admitted. */
  override get maxCost(): number {
    return this.#config.min;
  }

  protected override newTicket(cost: number, key: string, now: number): BaseTicket {
    const ticket = new AimdTicket(this, cost, key, now);
    ticket.epoch = this.#state.epoch;
    return ticket;
  }

  override releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): void {
    this.used -= ticket.cost;
    this.book?.giveBack(ticket.key, ticket.cost);
    // A call admitted at cost 0 held no permit: its outcome teaches nothing (as on Redis).
    if (!refund && outcome !== "ignored" && ticket.cost > 0) {
      // Without `slowCallMs` no call is slow: the clock is not read.
      const slow =
        this.#slowCallMs !== Number.POSITIVE_INFINITY &&
        this.clock.now() - ticket.admittedAt > this.#slowCallMs;
      const before = this.#state;
      this.#state = aimdStep(before, this.#config, {
        dropped: outcome === "dropped" || slow,
        inFlight: this.used + ticket.cost,
        epoch: (ticket as AimdTicket).epoch,
      });
      if (this.#state.limit !== before.limit) {
        this.limit = this.#state.limit;
        const level = this.#state.limit < before.limit ? "warn" : "debug";
        this.log[level]({ from: before.limit, to: this.#state.limit, outcome, slow }, "limit changed");
      }
    }
    this.serveLine();
  }

  override snapshot(): Snapshot {
    return this.withClasses(this.baseSnapshot(this.limit));
  }
}
