import { classBook } from "../base/classes.js";
import { DEFAULTS } from "../defaults.js";
import type { AimdOptions } from "../options.js";
import type { Outcome, StageKind } from "../types.js";
import { aimdSchema, parseOptions } from "../validate.js";
import type { LeaseTicket } from "./lease.js";
import { type RedisContext, RedisPermitStage } from "./semaphore.js";

/**
 * `redis(...).aimd(name, options)`: a fleet-wide semaphore whose limit is kept in Redis and moved
 * by every process's outcomes (`lua/aimd-release.lua`).
 */
/** One release of an AIMD lease: its script's arguments, and what its reply is judged by. */
interface AimdRelease {
  args: (string | number)[];
  outcome: Outcome;
  slow: boolean;
  /** The limit when it was sent. */
  before: number;
  sentAt: number;
}

export class RedisAimd extends RedisPermitStage {
  readonly kind: StageKind = "aimd";
  readonly #min: number;
  readonly #max: number;
  readonly #ratio: number;
  readonly #slowCallMs: number;
  readonly #initial: number;

  constructor(name: string, options: AimdOptions, ctx: RedisContext) {
    const o = parseOptions(aimdSchema, "aimd", name, options);
    const min = o.min ?? DEFAULTS.aimd.min;
    super(
      name,
      {
        limit: undefined,
        initial: o.initial,
        maxCost: min,
        leaseMs: o.leaseMs ?? DEFAULTS.leaseMs,
        whenFull: "block",
        logger: o.logger,
        reclaim: o.reclaim === "signal",
      },
      ctx,
      classBook("aimd", name, o, o.initial, min),
    );
    this.#min = min;
    this.#max = o.max;
    this.#initial = o.initial;
    this.#ratio = o.backoffRatio ?? DEFAULTS.aimd.backoffRatio;
    this.#slowCallMs = o.slowCallMs ?? Number.POSITIVE_INFINITY;
    this.init(o.logger ?? ctx.logger);
  }

  protected override async giveBack(t: LeaseTicket, outcome: Outcome, refund: boolean): Promise<boolean> {
    const release = this.#release(t, outcome, refund);
    return this.#released(await this.link.run(this.name, "aimd-release", this.keys, release.args), release);
  }

  protected override giveBackStep(
    t: LeaseTicket,
    outcome: Outcome,
    refund: boolean,
    released: (held: boolean) => void,
    failed: (error: unknown) => void,
  ): void {
    const release = this.#release(t, outcome, refund);
    this.link.step(
      this.name,
      "aimd-release",
      this.keys,
      release.args,
      (reply: unknown[]) => released(this.#released(reply, release)),
      failed,
    );
  }

  /** A release of `t`'s lease: its script's arguments, and what its reply is judged by. */
  #release(t: LeaseTicket, outcome: Outcome, refund: boolean): AimdRelease {
    // (Read once for a fused gate's whole turn: no later than the call is sent.)
    const now = this.time();
    const slow = now - t.admittedAt > this.#slowCallMs;
    const args = [
      this.link.now(),
      t.leaseId,
      this.channel,
      refund ? "refund" : outcome,
      t.epoch,
      this.#min,
      this.#max,
      this.#ratio,
      slow ? "1" : "0",
      this.claimMs,
      this.link.listeners,
      this.#initial,
      this.classSpec,
    ];
    return { args, outcome, slow, before: this.limit, sentAt: now };
  }

  /** What the reply to `release` says: the new limit (logged when it moved); true when the lease was still held. */
  #released(reply: unknown[], release: AimdRelease): boolean {
    const before = release.before;
    this.limit = Number(reply[1]);
    this.sawUsed(reply[3], release.sentAt);
    this.granted(reply[4], release.sentAt);
    if (this.limit !== before) {
      const level = this.limit < before ? "warn" : "debug";
      this.log[level](
        { from: before, to: this.limit, outcome: release.outcome, slow: release.slow },
        "limit changed",
      );
    }
    return Number(reply[0]) === 1;
  }
}
