import { KeyedLineStage, TimedLine } from "../base/line-stage.js";
import type { BaseTicket } from "../base/stage.js";
import type { WaitEntry, Waiter, WaitList } from "../base/wait-list.js";
import type { RedisContext } from "./semaphore.js";

/**
 * This process's waiters for one key or host, asked for in order, one Redis call at a time (for
 * several of the first at once where a stage allows: `RedisLineStage.headsAtOnce`).
 */
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
  | {
      granted: true;
      adopt(ticket: BaseTicket): void;
      giveBack(): void;
      /**
       * Ms from this grant until the line's next could go, when the grant itself says (an
       * interval gate's spacing): the line then sleeps that long instead of asking at once and
       * being told to wait. Undefined or 0: ask at once.
       */
      nextInMs?: number;
    }
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

  /**
   * How many of `line`'s first waiters one call may ask for at once (`attemptMany`): 1 unless a
   * stage can tell that a grant holds nobody behind it back (an interval gate that spaces nothing).
   */
  protected headsAtOnce(_line: L): number {
    return 1;
  }

  /**
   * Ask Redis, in one call, for each of `heads` (`line`'s first waiters, in order), decided in turn
   * as if each had asked alone: one attempt each, in that order. Called only when `headsAtOnce`
   * allows more than one.
   */
  protected attemptMany(_line: L, _heads: readonly Waiter[]): Promise<Attempt[]> {
    return Promise.reject(new Error(`${this.kind} "${this.name}": asks for one head at a time`));
  }

  protected line(key: string): L {
    let line = this.lines.get(key);
    if (!line) {
      line = this.newLine(key);
      this.lines.set(key, line);
    }
    return line;
  }

  /**
   * A waiter joined `line`: ask for it when it is the head, or when nothing is under way. One behind
   * others is asked for in its turn: the line has a call out, or sleeps until its head's time,
   * which a newcomer does not move (asking again then would only be told to wait).
   */
  protected joined(line: L, key: string): void {
    if (line.size === 1 || (line.busy === undefined && line.timer === undefined))
      void this.serveLine(line, key);
  }

  /** Ask again for `key`'s head, if it has a line (after a refund, a pause, a settle). */
  protected serveAgain(key: string): void {
    const line = this.lines.get(key);
    if (line) void this.serveLine(line, key);
  }

  /**
   * Grant the head (or the first heads at once: `headsAtOnce`) and go on, or sleep as long as Redis
   * says. Returns the call in flight.
   */
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
    const many = line.size > 1 ? Math.min(line.size, this.headsAtOnce(line)) : 1;
    if (many === 1) {
      line.busy = this.attempt(line, head).then(
        (a) => this.#answered(line, key, [head], [a]),
        (error: unknown) => this.#failed(line, key, error),
      );
      return line.busy;
    }
    const heads: Waiter[] = [];
    for (let w: Waiter | null = head; w !== null && heads.length < many; w = w.next as Waiter | null)
      heads.push(w);
    line.busy = this.attemptMany(line, heads).then(
      (attempts) => this.#answered(line, key, heads, attempts),
      (error: unknown) => this.#failed(line, key, error),
    );
    return line.busy;
  }

  /**
   * What Redis said for `heads`, `line`'s first waiters, in order: each granted goes (or, gone
   * while the call was out, gives its grant back) and the line goes on; the first refused stops
   * the rest, and the line waits (that head for its time, the others behind it). A refusal holds
   * every later head of the call back too, a key's or host's next grant only moving later: one
   * granted after it is given back.
   */
  #answered(line: L, key: string, heads: readonly Waiter[], attempts: readonly Attempt[]): void {
    line.busy = undefined;
    let refused: { head: Waiter; waitMs: number } | undefined;
    let nextInMs = 0;
    for (let i = 0; i < heads.length; i++) {
      const a = attempts[i]!;
      const head = heads[i]!;
      if (!a.granted) {
        refused ??= { head, waitMs: a.waitMs };
      } else if (refused === undefined && head.list === line) {
        a.adopt(this.grant(head, "token"));
        nextInMs = a.nextInMs ?? 0;
      } else a.giveBack();
    }
    // Granted, and the grant says the next cannot go for a while: the line sleeps that long (a
    // pause, a refund or a waiter that leaves or times out asks again at once: `serveLine`).
    if (refused === undefined && nextInMs > 0 && line.head !== null && !line.again) {
      refused = { head: line.head, waitMs: nextInMs };
    }
    if (refused === undefined) {
      void this.serveLine(line, key);
      return;
    }
    for (let w: WaitEntry | null = line.head; w; w = w.next) this.markWaiting(w);
    if (line.again || refused.head.list !== line) {
      void this.serveLine(line, key);
      return;
    }
    line.timer = this.clock.setTimeout(() => {
      line.timer = undefined;
      void this.serveLine(line, key);
    }, refused.waitMs);
  }

  /** A call for `line`'s heads failed: every waiter of the line fails closed. */
  #failed(line: L, key: string, error: unknown): void {
    line.busy = undefined;
    this.log.warn({ err: error, key }, "Redis unavailable; admission failed closed");
    for (let w = line.head; w; w = line.head) this.failWaiter(w, error);
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
