import { randomBytes } from "node:crypto";
import { refuseClasses } from "../base/classes.js";
import { BaseTicket } from "../base/stage.js";
import type { Waiter, WaitList } from "../base/wait-list.js";
import { bucketRule, UNKEYED } from "../call-rule.js";
import { DEFAULTS } from "../defaults.js";
import type { TokenBucketOptions } from "../options.js";
import type { AdmitOptions, Outcome, StageKind, Ticket } from "../types.js";
import { parseOptions, tokenBucketSchema } from "../validate.js";
import { ScriptBatch } from "./batch.js";
import { stageKey } from "./keys.js";
import { type Attempt, RedisLine, RedisLineStage } from "./line-stage.js";
import { maybeSent, type RedisLink } from "./link.js";
import type { RedisContext } from "./semaphore.js";

/** A key's line, with its takes: those made while another is out go together. */
class BucketLine extends RedisLine {
  constructor(
    redisKey: string,
    readonly takes: ScriptBatch,
  ) {
    super(redisKey);
  }
}

/** A ticket that knows its grant, so a refund can tell whether it is still the latest. */
class GrantTicket extends BaseTicket {
  grant = "";
}

/** Resolves once `line` has no call out: each grant asks for the next head at once. */
async function untilStill(line: RedisLine, busy: Promise<void>): Promise<void> {
  for (let call: Promise<void> | undefined = busy; call; call = line.busy) await call;
}

const GRANT_PREFIX = `${randomBytes(6).toString("hex")}:`;
let grants = 0;

/**
 * `redis(...).tokenBucket(name, options)`: one bucket per key in Redis, refilled by the server's
 * clock and shared by the fleet. A refusal says exactly how long until the tokens are there, and
 * the caller sleeps that long rather than polling. This process's waiters for a key are served
 * first in, first out; idle keys expire in Redis once they would be full again.
 */
export class RedisTokenBucket extends RedisLineStage<BucketLine> {
  readonly kind: StageKind = "tokenBucket";
  readonly #link: RedisLink;
  readonly #prefix: string;
  readonly #capacity: number;
  readonly #refill: number;
  readonly #recoveryMs: number;
  readonly #initial: number;
  readonly #penaltyFactor: number | undefined;
  readonly #minFactor: number;
  readonly #keyed: boolean;
  /** ARGV[2..4] of every bucket script and the fresh key's tokens, as sent (ioredis sends `String(n)`). */
  readonly #capacityArg: string;
  readonly #refillArg: string;
  readonly #recoveryArg: string;
  readonly #initialArg: string;

  constructor(name: string, options: TokenBucketOptions, ctx: RedisContext) {
    super(name, ctx);
    const o = parseOptions(tokenBucketSchema, "tokenBucket", name, options);
    refuseClasses("tokenBucket", name, o);
    this.#link = ctx.link;
    this.#prefix = ctx.prefix;
    this.#capacity = o.capacity;
    this.#refill = o.refillPerSecond;
    this.#recoveryMs = o.penalty?.recoveryMs ?? DEFAULTS.tokenBucket.penalty.recoveryMs;
    this.#initial = o.initialTokens ?? o.capacity;
    this.#penaltyFactor = o.penalty ? (o.penalty.factor ?? DEFAULTS.tokenBucket.penalty.factor) : undefined;
    this.#minFactor = o.penalty?.minFactor ?? DEFAULTS.tokenBucket.penalty.minFactor;
    this.#keyed = o.keyed ?? false;
    this.callRule = bucketRule(this.#keyed);
    this.#capacityArg = String(this.#capacity);
    this.#refillArg = String(this.#refill);
    this.#recoveryArg = String(this.#recoveryMs);
    this.#initialArg = String(this.#initial);
    this.init(o.logger ?? ctx.logger);
  }

  /** The arguments of a take or a refund: now, the bucket's settings, `cost`, the fresh key's tokens, `grant`. */
  #args(cost: number | string, grant: string): string[] {
    return [
      this.#link.now(),
      this.#capacityArg,
      this.#refillArg,
      this.#recoveryArg,
      String(cost),
      this.#initialArg,
      grant,
    ];
  }

  protected newLine(key: string): BucketLine {
    const redisKey = stageKey(this.#prefix, this.name, `b:${key}`);
    return new BucketLine(redisKey, new ScriptBatch((pairs) => this.#sendTakes(redisKey, pairs)));
  }

  /** A fresh grant id: this process's random prefix and a counter. */
  #grantId(): string {
    return `${GRANT_PREFIX}${++grants}`;
  }

  /**
   * Take `cost` for one caller: at once when no take of this key is out, else with the key's
   * other takes of this turn of the event loop, in one script call that runs them in order.
   */
  #take(line: BucketLine, cost: number, grant: string): Promise<[number, number]> {
    return line.takes.run(String(cost), grant).catch((error: unknown) => {
      // The take may still run once Redis answers; the refund then undoes it (and does
      // nothing if it never ran, or if another grant came after it).
      if (maybeSent(error)) void this.#refundAt(line.redisKey, cost, grant);
      throw error;
    });
  }

  /** Send takes of `redisKey` (pairs of cost and grant): one alone as a plain take, more in one call. */
  #sendTakes(redisKey: string, pairs: string[]): Promise<unknown> {
    if (pairs.length === 2) {
      return this.#link.run(this.name, "token-bucket-take", [redisKey], this.#args(pairs[0]!, pairs[1]!));
    }
    const args: string[] = [
      this.#link.now(),
      this.#capacityArg,
      this.#refillArg,
      this.#recoveryArg,
      this.#initialArg,
      ...pairs,
    ];
    return this.#link.run(this.name, "token-bucket-take-many", [redisKey], args).then((replies: number[]) => {
      const each = new Array<[number, number]>(pairs.length / 2);
      for (let i = 0; i < each.length; i++) each[i] = [replies[2 * i]!, replies[2 * i + 1]!];
      return each;
    });
  }

  protected override newTicket(cost: number, key: string, now: number): BaseTicket {
    return new GrantTicket(this, cost, key, now);
  }

  /**
   * The largest cost one call can ever be admitted with: a larger one is refused at once with
   * `InvalidOptionsError`, and a Gate refuses it before it takes any stage.
   */
  override get maxCost(): number {
    return this.#capacity;
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const cost = o.cost ?? 1;
    const key = this.#keyed ? o.key! : UNKEYED;
    if (cost === 0) return Promise.resolve(this.issue(0, key, undefined, "token"));
    const line = this.line(key);
    if (line.size === 0) return this.#direct(line, key, cost, o);
    const promise = this.wait(line, cost, key, o);
    void this.drain(line, key);
    return promise;
  }

  /**
   * Nobody of this process waits for the key: take straight away (many such calls may be out at
   * once). On a refusal, refuse at once a wait longer than timeoutMs, else line up.
   */
  async #direct(line: BucketLine, key: string, cost: number, o: AdmitOptions): Promise<Ticket> {
    const startedAt = this.clock.now();
    const grant = this.#grantId();
    const [taken, waitMs] = await this.#take(line, cost, grant);
    if (Number(taken) === 1) {
      if (o.signal?.aborted) {
        void this.#refund(key, cost, grant);
        throw o.signal.reason;
      }
      return this.#granted(cost, key, grant);
    }
    if (o.signal?.aborted) throw o.signal.reason;
    const elapsed = this.clock.now() - startedAt;
    const timeoutMs = o.timeoutMs;
    if (timeoutMs !== undefined && Number(waitMs) > timeoutMs - elapsed) {
      this.timedOut++;
      this.log.warn({ timeoutMs, retryAfterMs: Number(waitMs) }, "admission timed out");
      throw this.timeoutError(timeoutMs, Number(waitMs));
    }
    const rest = timeoutMs === undefined ? o : { ...o, timeoutMs: timeoutMs - elapsed };
    const promise = this.wait(line, cost, key, rest);
    void this.drain(line, key);
    return promise;
  }

  #granted(cost: number, key: string, grant: string): Ticket {
    if (this.closed) {
      void this.#refund(key, cost, grant);
      throw this.closedSignal.reason;
    }
    const ticket = this.issue(cost, key, undefined, "token") as GrantTicket;
    ticket.grant = grant;
    return ticket;
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const cost = o.cost ?? 1;
    const key = this.#keyed ? o.key! : UNKEYED;
    if (cost === 0) return Promise.resolve(this.issue(0, key, undefined, "token"));
    const line = this.line(key);
    if (line.size > 0) return Promise.resolve(undefined);
    const grant = this.#grantId();
    return this.#take(line, cost, grant).then(([taken]) =>
      Number(taken) === 1 ? this.#granted(cost, key, grant) : undefined,
    );
  }

  protected async attempt(line: BucketLine, head: Waiter): Promise<Attempt> {
    const grant = this.#grantId();
    const [taken, waitMs] = await this.#take(line, head.cost, grant);
    if (Number(taken) !== 1) return { granted: false, waitMs: Number(waitMs) };
    return {
      granted: true,
      adopt: (ticket) => {
        (ticket as GrantTicket).grant = grant;
      },
      giveBack: () => void this.#refund(head.key, head.cost, grant),
    };
  }

  /**
   * A waiter's timeout has come: ask Redis for the line's heads until it stops moving, as memory
   * grants every waiter the tokens cover. Tokens there at this very instant are in time for
   * each waiter they cover, not only for the head (whose grant alone used to end the wait).
   */
  protected override grantDue(list: WaitList, key: string): Promise<void> | undefined {
    const line = list as BucketLine;
    const busy = this.drain(line, key);
    return busy && untilStill(line, busy);
  }

  #refund(key: string, cost: number, grant: string): Promise<unknown> {
    return this.#refundAt(stageKey(this.#prefix, this.name, `b:${key}`), cost, grant);
  }

  #refundAt(redisKey: string, cost: number, grant: string): Promise<unknown> {
    return this.#link
      .run(this.name, "token-bucket-refund", [redisKey], this.#args(cost, grant))
      .catch((error) => this.log.warn({ err: error }, "refund failed"));
  }

  releaseTicket(ticket: BaseTicket, outcome: Outcome, refund: boolean): Promise<void> | undefined {
    const key = ticket.key;
    if (refund) {
      // A ticket admitted at cost 0 took nothing and is no grant. One settled down to 0 still
      // is: its refund ends its claim to be the key's latest, as in memory.
      const grant = (ticket as GrantTicket).grant;
      if (grant === "") return undefined;
      return this.#refund(key, ticket.cost, grant).then(() => {
        this.redrain(key);
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

  /** Re-price the ticket at `actual`: charge the difference, or give it back while still the latest. */
  override settleTicket(ticket: BaseTicket, actual: number): Promise<void> | undefined {
    const estimated = ticket.cost;
    if (actual === estimated) return undefined;
    ticket.cost = actual;
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
        this.redrain(key);
      });
  }
}
