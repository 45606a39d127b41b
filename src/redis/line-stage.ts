import { KeyedLineStage, TimedLine } from "../base/line-stage.js";
import type { BaseTicket } from "../base/stage.js";
import type { WaitEntry, Waiter, WaitList } from "../base/wait-list.js";
import type { RedisContext } from "./semaphore.js";

/** This process's waiters for one key or host, asked for in order, one Redis call at a time. */
export class RedisLine extends TimedLine {
  busy: Promise<void> | undefined = undefined;
  again = false;
  /** KEYS of the line's scripts. */
  readonly keys: readonly string[];
  constructor(readonly redisKey: string) {
    super();
    this.keys = [redisKey];
  }
}

/** What one Redis call said for the head of a line. */
export type Attempt =
  | { granted: true; adopt(ticket: BaseTicket): void; giveBack(): void }
  | { granted: false; waitMs: number };

/**
 * A Redis stage whose decisions are per key (token buckets) or per host (interval gates) and
 * are timed by Redis: each line asks Redis for its head, grants and goes on, or sleeps exactly as
 * long as Redis says. Lines of idle keys are forgotten.
 */
export abstract class RedisLineStage<L extends RedisLine> extends KeyedLineStage<L> {
  override readonly backend = "redis";
  protected override readonly waitsInLine = false;
  constructor(name: string, ctx: RedisContext) {
    super(name, ctx.clock, 10_000);
  }

  protected isIdle(line: L): boolean {
    return line.size === 0 && !line.busy;
  }

  /** A new, empty line for `key`. */
  protected abstract newLine(key: string): L;

  /** Ask Redis for the head of `line` (the call is made once per head, at a time). */
  protected abstract attempt(line: L, head: Waiter): Promise<Attempt>;

  protected line(key: string): L {
    let line = this.lines.get(key);
    if (!line) {
      line = this.newLine(key);
      this.lines.set(key, line);
    }
    return line;
  }

  /** Ask again for `key`'s head, if it has a line (after a refund, a pause, a settle). */
  protected serveAgain(key: string): void {
    const line = this.lines.get(key);
    if (line) void this.serveLine(line, key);
  }

  /** Grant the head and go on, or sleep as long as Redis says. Returns the call in flight. */
  protected serveLine(line: L, key: string): Promise<void> | undefined {
    if (line.busy) {
      line.again = true;
      return line.busy;
    }
    if (line.timer !== undefined) {
      this.clock.clearTimeout(line.timer);
      line.timer = undefined;
    }
    const head = line.head;
    if (!head) return undefined;
    line.again = false;
    line.busy = this.attempt(line, head).then(
      (a) => {
        line.busy = undefined;
        if (a.granted) {
          if (head.list === line) a.adopt(this.grant(head, "token"));
          else a.giveBack(); // it left while the call was out
          void this.serveLine(line, key);
          return;
        }
        // Refused for now: the line waits (its head for its time, the others behind it).
        for (let w: WaitEntry | null = line.head; w; w = w.next) this.markWaiting(w);
        if (line.again || head.list !== line) {
          void this.serveLine(line, key);
          return;
        }
        line.timer = this.clock.setTimeout(() => {
          line.timer = undefined;
          void this.serveLine(line, key);
        }, a.waitMs);
      },
      (error: unknown) => {
        line.busy = undefined;
        this.log.warn({ err: error, key }, "Redis unavailable; admission failed closed");
        for (let w = line.head; w; w = line.head) this.failWaiter(w, error);
      },
    );
    return line.busy;
  }

  /**
   * What is due on `list` now, for the timeout of `waiter`: the head asked for, and each head after
   * it that a grant goes on to at once (`serveLine`), while `waiter` is still in line. Its own
   * place may come at this same instant (a spacing of 0 after a pause), as in memory, where every
   * waiter whose slot has come goes at once.
   */
  protected override grantDue(list: WaitList, key: string, waiter?: WaitEntry): Promise<void> | undefined {
    const line = list as L;
    const busy = this.serveLine(line, key);
    return busy?.then(() => this.#stillDue(line, waiter));
  }

  /** The call out for `line`'s next head, made as the one before was granted, while `waiter` waits there. */
  #stillDue(line: L, waiter: WaitEntry | undefined): Promise<void> | undefined {
    const busy = line.busy;
    if (waiter === undefined || waiter.list !== line || busy === undefined) return undefined;
    return busy.then(() => this.#stillDue(line, waiter));
  }

  protected afterWaiterGone(list: WaitList, waiter: Waiter): void {
    void this.serveLine(list as L, waiter.key);
  }
}
