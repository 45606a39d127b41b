import { randomBytes } from "node:crypto";
import { tooCostly } from "../admit.js";
import { KeyedStates } from "../base/keyed.js";
import { BaseStage, BaseTicket } from "../base/stage.js";
import { type Waiter, WaitList } from "../base/wait-list.js";
import type { ClockTimer } from "../clock.js";
import { AdmitTimeoutError } from "../errors.js";
import type { TokenBucketOptions } from "../options.js";
import type { AdmitOptions, Outcome, Snapshot, StageKind, Ticket, TryAdmitOptions } from "../types.js";
import { parseOptions, tokenBucketSchema } from "../validate.js";
import { stageKey } from "./keys.js";
import { maybeSent, type RedisLink } from "./link.js";
import type { RedisContext } from "./semaphore.js";

/** This process's waiters for one key, asked for in order, one Redis call at a time. */
class KeyLine extends WaitList {
  timer: ClockTimer | undefined = undefined;
  busy: Promise<void> | undefined = undefined;
  again = false;
  constructor(readonly redisKey: string) {
    super();
  }
}

/** A ticket that knows its grant, so a refund can tell whether it is still the latest. */
class GrantTicket extends BaseTicket {
  grant = "";
}

const DEFAULT_KEY = "default";
const GRANT_PREFIX = `${randomBytes(6).toString("hex")}:`;
let grants = 0;

/**
 * `redis(...).tokenBucket(name, options)`: one bucket per key in Redis, refilled by the server's
 * clock and shared by the fleet. A refusal says exactly how long until the tokens are there, and
 * the caller sleeps that long rather than polling. This process's waiters for a key are served
 * first in, first out; idle keys expire in Redis once they would be full again.
 */
export class RedisTokenBucket extends BaseStage {
  readonly kind: StageKind = "tokenBucket";
  override readonly backend = "redis";
  readonly #link: RedisLink;
  readonly #prefix: string;
  readonly #capacity: number;
  readonly #refill: number;
  readonly #recoveryMs: number;
  readonly #initial: number;
  readonly #penaltyFactor: number | undefined;
  readonly #minFactor: number;
  readonly #lines: KeyedStates<KeyLine>;

  constructor(name: string, options: TokenBucketOptions, ctx: RedisContext) {
    super(name, ctx.clock);
    const o = parseOptions(tokenBucketSchema, "tokenBucket", name, options);
    this.#link = ctx.link;
    this.#prefix = ctx.prefix;
    this.#capacity = o.capacity;
    this.#refill = o.refillPerSecond;
    this.#recoveryMs = o.penalty?.recoveryMs ?? 30_000;
    this.#initial = o.initialTokens ?? o.capacity;
    this.#penaltyFactor = o.penalty ? (o.penalty.factor ?? 0.5) : undefined;
    this.#minFactor = o.penalty?.minFactor ?? 0.1;
    this.#lines = new KeyedStates(ctx.clock, 10_000, (line) => line.size === 0 && !line.busy);
    this.init(o.logger ?? ctx.logger);
  }

  #line(key: string): KeyLine {
    let line = this.#lines.get(key);
    if (!line) {
      line = new KeyLine(stageKey(this.#prefix, this.name, `b:${key}`));
      this.#lines.set(key, line);
    }
    return line;
  }

  /** A fresh grant id: this process's random prefix and a counter. */
  #grantId(): string {
    return `${GRANT_PREFIX}${++grants}`;
  }

  #take(line: KeyLine, cost: number, grant: string): Promise<[number, number]> {
    return this.#link
      .run(
        this.name,
        "token-bucket-take",
        [line.redisKey],
        [this.#link.now(), this.#capacity, this.#refill, this.#recoveryMs, cost, this.#initial, grant],
      )
      .catch((error: unknown) => {
        // The take may still run once Redis answers; the refund then undoes it (and does
        // nothing if it never ran, or if another grant came after it).
        if (maybeSent(error)) void this.#refundAt(line.redisKey, cost, grant);
        throw error;
      });
  }

  protected override newTicket(cost: number, key: string, now: number): BaseTicket {
    return new GrantTicket(this, cost, key, now);
  }

  admit(options?: AdmitOptions): Promise<Ticket> {
    let o: AdmitOptions;
    try {
      o = this.check(options);
    } catch (error) {
      return Promise.reject(error);
    }
    const cost = o.cost ?? 1;
    if (cost > this.#capacity)
      return Promise.reject(tooCostly(this.kind, this.name, cost, this.#capacity, "capacity"));
    if (o.signal?.aborted) return Promise.reject(o.signal.reason);
    const key = o.key ?? DEFAULT_KEY;
    if (cost === 0) return Promise.resolve(this.issue(0, key, this.clock.now(), "token"));
    const line = this.#line(key);
    if (line.size === 0) return this.#direct(line, key, cost, o);
    const promise = this.wait(line, cost, key, o);
    void this.#drain(line, key);
    return promise;
  }

  /**
   * Nobody of this process waits for the key: take straight away (many such calls may be out at
   * once). On a refusal, refuse at once a wait longer than timeoutMs, else line up.
   */
  async #direct(line: KeyLine, key: string, cost: number, o: AdmitOptions): Promise<Ticket> {
    const startedAt = this.clock.now();
    const grant = this.#grantId();
    const [taken, waitMs] = await this.#take(line, cost, grant);
    if (Number(taken) === 1) {
      if (o.signal?.aborted) {
        void this.#refund(key, cost, grant);
        throw o.signal.reason;
      }
      return this.#granted(cost, key, startedAt, grant);
    }
    if (o.signal?.aborted) throw o.signal.reason;
    const elapsed = this.clock.now() - startedAt;
    const timeoutMs = o.timeoutMs;
    if (timeoutMs !== undefined && Number(waitMs) > timeoutMs - elapsed) {
      this.timedOut++;
      this.log.warn({ timeoutMs, retryAfterMs: Number(waitMs) }, "admission timed out");
      throw new AdmitTimeoutError(
        this.name,
        `tokenBucket "${this.name}": not admitted within timeoutMs (${timeoutMs})`,
        {
          retryAfterMs: Number(waitMs),
        },
      );
    }
    const rest = timeoutMs === undefined ? o : { ...o, timeoutMs: timeoutMs - elapsed };
    const promise = this.wait(line, cost, key, rest);
    void this.#drain(line, key);
    return promise;
  }

  #granted(cost: number, key: string, startedAt: number, grant: string): Ticket {
    if (this.closed) {
      void this.#refund(key, cost, grant);
      throw this.closedSignal.reason;
    }
    const ticket = this.issue(cost, key, startedAt, "token") as GrantTicket;
    ticket.grant = grant;
    return ticket;
  }

  tryAdmit(options?: TryAdmitOptions): Promise<Ticket | undefined> {
    try {
      const o = this.check(options);
      const cost = o.cost ?? 1;
      if (cost > this.#capacity) throw tooCostly(this.kind, this.name, cost, this.#capacity, "capacity");
      const key = o.key ?? DEFAULT_KEY;
      if (cost === 0) return Promise.resolve(this.issue(0, key, this.clock.now(), "token"));
      const line = this.#line(key);
      if (line.size > 0) return Promise.resolve(undefined);
      const startedAt = this.clock.now();
      const grant = this.#grantId();
      return this.#take(line, cost, grant).then(([taken]) =>
        Number(taken) === 1 ? this.#granted(cost, key, startedAt, grant) : undefined,
      );
    } catch (error) {
      return Promise.reject(error);
    }
  }

  /**
   * Ask Redis for the head's tokens; grant and go on, or sleep exactly as long as Redis says.
   * Returns the call in flight, if any.
   */
  #drain(line: KeyLine, key: string): Promise<void> | undefined {
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
    const grant = this.#grantId();
    line.busy = this.#take(line, head.cost, grant).then(
      ([taken, waitMs]) => {
        line.busy = undefined;
        if (Number(taken) === 1) {
          if (head.list === line) (this.grant(head, "token") as GrantTicket).grant = grant;
          else void this.#refund(key, head.cost, grant); // it left while the call was out
          void this.#drain(line, key);
          return;
        }
        if (line.again || head.list !== line) {
          void this.#drain(line, key);
          return;
        }
        line.timer = this.clock.setTimeout(() => {
          line.timer = undefined;
          this.#drain(line, key);
        }, Number(waitMs));
      },
      (error: unknown) => {
        line.busy = undefined;
        this.log.warn({ err: error, key }, "Redis unavailable; admission failed closed");
        for (let w = line.head; w; w = line.head) this.failWaiter(w, error);
      },
    );
    return line.busy;
  }

  #refund(key: string, cost: number, grant: string): Promise<unknown> {
    return this.#refundAt(stageKey(this.#prefix, this.name, `b:${key}`), cost, grant);
  }

  #refundAt(redisKey: string, cost: number, grant: string): Promise<unknown> {
    return this.#link
      .run(
        this.name,
        "token-bucket-refund",
        [redisKey],
        [this.#link.now(), this.#capacity, this.#refill, this.#recoveryMs, cost, this.#initial, grant],
      )
      .catch((error) => this.log.warn({ err: error }, "refund failed"));
  }

  releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): Promise<void> | undefined {
    if (ticket.cost === 0) return undefined;
    const key = ticket.key;
    if (refund) {
      return this.#refund(key, ticket.cost, (ticket as GrantTicket).grant).then(() => {
        const line = this.#lines.get(key);
        if (line) void this.#drain(line, key);
      });
    }
    if (outcome === "dropped" && this.#penaltyFactor !== undefined) {
      return this.#link
        .run(
          this.name,
          "token-bucket-penalize",
          [stageKey(this.#prefix, this.name, `b:${key}`)],
          [
            this.#link.now(),
            this.#capacity,
            this.#refill,
            this.#recoveryMs,
            this.#penaltyFactor,
            this.#minFactor,
            this.#initial,
          ],
        )
        .then(
          (factor) => this.log.warn({ key, rateFactor: Number(factor) / 1000 }, "key penalised after drop"),
          (error) => this.log.warn({ err: error, key }, "penalty failed"),
        );
    }
    return undefined;
  }

  override settleTicket(ticket: BaseTicket, estimated: number, actual: number): Promise<void> {
    const key = ticket.key;
    return this.#link
      .run(
        this.name,
        "token-bucket-settle",
        [stageKey(this.#prefix, this.name, `b:${key}`)],
        [
          this.#link.now(),
          this.#capacity,
          this.#refill,
          this.#recoveryMs,
          actual - estimated,
          this.#initial,
          (ticket as GrantTicket).grant,
        ],
      )
      .then(() => {
        const line = this.#lines.get(key);
        if (line) void this.#drain(line, key);
      });
  }

  protected override grantDue(list: WaitList, key: string): Promise<void> | undefined {
    return this.#drain(list as KeyLine, key);
  }

  protected afterWaiterGone(list: WaitList, waiter: Waiter): void {
    void this.#drain(list as KeyLine, waiter.key);
  }

  protected lists(): Iterable<WaitList> {
    return this.#lines.map.values();
  }

  protected override onClose(): void {
    for (const line of this.#lines.map.values()) {
      if (line.timer !== undefined) this.clock.clearTimeout(line.timer);
      line.timer = undefined;
    }
    this.#lines.close();
  }

  snapshot(): Snapshot {
    return this.baseSnapshot(Number.POSITIVE_INFINITY);
  }
}
