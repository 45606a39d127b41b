import { LONGEST_MS } from "../admit.js";
import { KeyedLineStage, type TimedLine } from "../base/line-stage.js";
import type { WaitEntry, WaitList } from "../base/wait-list.js";

/**
 * A memory stage whose decisions are per key (token buckets) or per host (interval gates) and
 * timed: each line grants from its head what its state allows now, then sleeps exactly until its
 * head could go. Lines that are idle (see `isIdle`) are forgotten on a sweep. The counterpart of
 * `RedisLineStage`, where Redis holds the state and says how long to sleep.
 */
export abstract class MemoryLineStage<L extends TimedLine> extends KeyedLineStage<L> {
  /** A new line for a key first seen at `now`. */
  protected abstract newLine(now: number): L;

  /** Grant from the head of `line` whatever its state allows at `now`. */
  protected abstract grantReady(line: L, key: string, now: number): void;

  /** Milliseconds until `head`, at the head of `line`, could go. */
  protected abstract headWaitMs(line: L, head: WaitEntry, now: number): number;

  /** Milliseconds until someone waiting on `line` could go, or undefined when nobody waits. */
  protected nextWaitMs(line: L, now: number): number | undefined {
    const head = line.head;
    return head ? this.headWaitMs(line, head, now) : undefined;
  }

  /** `key`'s line, made when first asked for. */
  protected line(key: string, now: number): L {
    let line = this.lines.get(key);
    if (!line) {
      line = this.newLine(now);
      this.lines.set(key, line);
    }
    return line;
  }

  /** Grant what is due now, then sleep until the next head could go. */
  protected serveLine(line: L, key: string): void {
    const now = this.clock.now();
    this.grantReady(line, key, now);
    this.schedule(line, key, now);
  }

  /** Set the line's timer for its head (none when nobody waits), as of `now`. */
  protected schedule(line: L, key: string, now?: number): void {
    if (line.timer !== undefined) {
      this.clock.clearTimeout(line.timer);
      line.timer = undefined;
    }
    const wait = this.nextWaitMs(line, now ?? this.clock.now());
    if (wait === undefined) return;
    // A wait too long to set a timer for (a debt, a slow refill, a long pause) is at most LONGEST_MS.
    const ms = Math.min(wait, LONGEST_MS);
    line.timer = this.clock.setTimeout(() => {
      line.timer = undefined;
      this.serveLine(line, key);
    }, ms);
  }

  protected override grantDue(list: WaitList, key: string): undefined {
    this.serveLine(list as L, key);
  }
}
