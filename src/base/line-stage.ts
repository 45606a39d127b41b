import type { Clock, ClockTimer } from "../clock.js";
import type { Snapshot } from "../types.js";
import { KeyedStates } from "./keyed.js";
import { BaseStage } from "./stage.js";
import { WaitList } from "./wait-list.js";

/** One key's or host's waiters, first in, first out, and the timer for its head. */
export class TimedLine extends WaitList {
  timer: ClockTimer | undefined = undefined;
}

/**
 * What the per-key (token bucket) and per-host (interval gate) stages of both backends share: a
 * line per key, each with one timer, kept in `KeyedStates` so that lines `isIdle` calls no
 * different from fresh ones are forgotten on a sweep, and closed together.
 */
export abstract class KeyedLineStage<L extends TimedLine> extends BaseStage {
  protected readonly lines: KeyedStates<L>;

  constructor(name: string, clock: Clock, sweepMs: number) {
    super(name, clock);
    this.lines = new KeyedStates(clock, sweepMs, (line, now) => this.isIdle(line, now));
  }

  /** Whether `line` is no different from a fresh one at `now` (then a sweep forgets it). */
  protected abstract isIdle(line: L, now: number): boolean;

  protected lists(): Iterable<WaitList> {
    return this.lines.map.values();
  }

  protected override onClose(): void {
    for (const line of this.lines.map.values()) {
      if (line.timer !== undefined) this.clock.clearTimeout(line.timer);
      line.timer = undefined;
    }
    this.lines.close();
  }

  snapshot(): Snapshot {
    return this.baseSnapshot(Number.POSITIVE_INFINITY);
  }
}
