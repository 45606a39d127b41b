/**
 * A fused Redis gate's refused calls read: the stage a call waits for, when it could ask again by
 * itself, and which stage each stretch of its wait counts against (`countWait`, for the stages'
 * flow figures), as in a fused memory gate.
 */

import type { BaseStage } from "../base/stage.js";
import type { Stage } from "../types.js";
import type { GateReply } from "./gate-call.js";

/** Stages that hold a permit while a call runs: a call they refuse waits in the gate's line. */
export const PERMIT_KINDS: ReadonlySet<string> = new Set(["semaphore", "aimd"]);

/** What a reply, or a grant, says of the permit line's waits (see `FusedWaits.stretch`). */
export type LineWait = Pick<GateReply, "lineRateMs" | "lineRateKey" | "moved">;

/** What a refused try says of its wait (see `FusedWaits.refused`). */
export interface Refusal {
  /** Index of the stage the call waits for (see `FusedWaits.refused`), or -1. */
  blame: number;
  /**
   * First in the permit line: ms until a permit stage that refused it could have room by itself
   * (its nearest lease ends, or its quarantine), or -1.
   */
  soonest: number;
  /** It is the first in the permit line (its permit steps ran, and it waits there). */
  first: boolean;
}

/** The waits of one fused gate's calls, read from their replies and counted against its stages. */
export class FusedWaits {
  readonly #stages: readonly Stage[];
  /** How each stage's keys begin, as Redis names them. */
  readonly #keysOf: readonly string[];

  constructor(stages: readonly Stage[], keysOf: readonly string[]) {
    this.#stages = stages;
    this.#keysOf = keysOf;
  }

  /**
   * The stage a refused call waits for: in the permit line, the first permit stage that refused
   * it (or the first, when someone ahead kept the steps from running); else the metering stage
   * with the longest wait (or the first, when someone ahead in its lane did). -1 when none.
   * `stepOf` is each stage's step in the attempt (-1: its stage made no script call).
   */
  #blame(reply: GateReply, stepOf: readonly number[]): number {
    // First in the permit line and refused by a rate only, a call waits for that rate.
    const forPermits = reply.inLine === "permits" && reply.waitMs < 0;
    let best = -1;
    let longest = -1;
    for (let i = 0; i < this.#stages.length; i++) {
      if (PERMIT_KINDS.has(this.#stages[i]!.kind) !== forPermits) continue;
      const step = stepOf[i]!;
      const r = step < 0 ? undefined : reply.replies[step];
      if ((r === false || r === null) && best < 0) best = i;
      if (!Array.isArray(r) || Number(r[0]) !== 0) continue;
      if (forPermits) return i;
      if (Number(r[1]) > longest) {
        longest = Number(r[1]);
        best = i;
      }
    }
    return best;
  }

  /**
   * A refused try: the stage it waits for (`#blame`); whether it is the first in the permit line
   * (it waits there, and its permit steps ran); and then, ms until the first of the permit stages
   * that refused it could have room without a release (the soonest of their nearest lease ends
   * and quarantines, as each acquire's reply says), so that it asks again then, as a stage's own
   * waiter does, rather than at its next poll: a holder that died frees nothing until its lease
   * runs out, and tells nobody (-1 when none says, or a rate is what it waits for).
   */
  refused(reply: GateReply, stepOf: readonly number[]): Refusal {
    let first = false;
    let soonest = -1;
    if (reply.inLine === "permits") {
      for (let i = 0; i < this.#stages.length; i++) {
        const step = stepOf[i]!;
        if (!PERMIT_KINDS.has(this.#stages[i]!.kind) || step < 0) continue;
        const r = reply.replies[step];
        if (!Array.isArray(r)) continue;
        first = true;
        const ms = Number(r[1]);
        if (reply.waitMs < 0 && Number(r[0]) === 0 && ms >= 0 && (soonest < 0 || ms < soonest)) soonest = ms;
      }
    }
    return { blame: this.#blame(reply, stepOf), soonest, first };
  }

  /**
   * Count a stretch of `ms` of waiting, up to a try whose reply (or grant) is `reply`, as the
   * wait of stage `i` (see `#blame`); but for its part while the permit line's firsts kept their
   * place waiting for a rate (they wait for it, and so does everyone behind them, as in a fused
   * memory gate, where the first steps aside into its lane and those behind follow it there),
   * which counts at that rate's stage: the growth of their rate waits in all since the call's
   * previous reply (`rateAt`, -1 when that reply did not say), at most the stretch. When the
   * permit line took the call with its lane meanwhile (`moved`), its part from then on counts at
   * the permit stage that refused its lane's first, as in memory, but for the line's rate waits
   * since then.
   */
  stretch(i: number, ms: number, rateAt: number, reply: LineWait | undefined): void {
    const moved = reply?.moved;
    if (moved !== undefined && ms > 0) {
      // The permit line took it with its lane meanwhile: its lane's wait up to then; from then on,
      // it waited for the permit stage that refused its lane's first (but for the line's rates).
      const after = Math.min(ms, moved.agoMs);
      this.charge(i, ms - after);
      const permit = this.#stageOfKey(moved.key, true);
      this.#inLine(permit < 0 ? i : permit, after, moved.lineRateMs, reply!);
      return;
    }
    if (rateAt < 0 || reply?.lineRateMs === undefined || !(ms > 0)) {
      this.charge(i, ms);
      return;
    }
    this.#inLine(i, ms, rateAt, reply);
  }

  /**
   * Count `ms` waited in the permit line as the wait of stage `i`, but for the growth of its
   * firsts' rate waits since `rateAt` (at most `ms`), at that rate's stage (see `stretch`).
   */
  #inLine(i: number, ms: number, rateAt: number, reply: LineWait): void {
    const total = reply.lineRateMs ?? rateAt;
    const stage = this.#stageOfKey(reply.lineRateKey ?? "", false);
    const rate = stage < 0 ? 0 : Math.min(ms, Math.max(0, total - rateAt));
    if (rate > 0) this.charge(stage, rate);
    this.charge(i, ms - rate);
  }

  /** The permit stage (`permits`) or metering stage whose keys `key` is one of (the longest match), or -1. */
  #stageOfKey(key: string, permits: boolean): number {
    let best = -1;
    for (let i = 0; i < this.#stages.length; i++) {
      const start = this.#keysOf[i]!;
      if (PERMIT_KINDS.has(this.#stages[i]!.kind) !== permits || !key.startsWith(start)) continue;
      if (best < 0 || start.length > this.#keysOf[best]!.length) best = i;
    }
    return best;
  }

  /** Count `ms` of waiting as the wait of stage `i` (see `#blame`). */
  charge(i: number, ms: number): void {
    if (i < 0 || !(ms > 0)) return;
    const stage = this.#stages[i] as Partial<BaseStage>;
    stage.countWait?.(PERMIT_KINDS.has(stage.kind!) ? "permit" : "token", ms);
  }
}
