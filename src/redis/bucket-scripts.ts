/**
 * How a Redis token bucket's calls reach Redis: the arguments its scripts take, a key's takes of
 * one turn in one script call, and its refunds, settles and penalties; and what a take that ran
 * after it was failed gives back. The waiting is the stage's own (token-bucket.ts).
 */
import { randomBytes } from "node:crypto";
import type { Logger } from "../types.js";
import type { Late } from "./gate-call.js";
import { stageKey } from "./keys.js";
import { maybeSent, type RedisLink } from "./link.js";

/**
 * A take's reply: 1 taken now; 2 reserved (go in `waitMs`, the place began `fromMs` from now); 0
 * refused (`waitMs` is above the caller's wait).
 */
export type TakeReply = [taken: number, waitMs: number, fromMs?: number];

/** A bucket's settings, as its scripts take them. */
export interface BucketSettings {
  capacity: number;
  refillPerSecond: number;
  recoveryMs: number;
  /** A fresh key's tokens. */
  initial: number;
  /** The penalty's factor after a drop; undefined without a penalty. */
  penaltyFactor: number | undefined;
  minFactor: number;
}

const GRANT_PREFIX = `${randomBytes(6).toString("hex")}:`;
let grants = 0;

/** One Redis token bucket's script calls. */
export class BucketScripts {
  readonly #name: string;
  readonly #link: RedisLink;
  readonly #prefix: string;
  readonly #s: BucketSettings;
  /** The stage's logger (read when used: it is set once the stage is built). */
  readonly #log: () => Logger;
  /** ARGV[2..4] of every bucket script and the fresh key's tokens, as sent (ioredis sends `String(n)`). */
  readonly #capacityArg: string;
  readonly #refillArg: string;
  readonly #recoveryArg: string;
  readonly #initialArg: string;

  constructor(name: string, link: RedisLink, prefix: string, settings: BucketSettings, log: () => Logger) {
    this.#name = name;
    this.#link = link;
    this.#prefix = prefix;
    this.#s = settings;
    this.#log = log;
    this.#capacityArg = String(settings.capacity);
    this.#refillArg = String(settings.refillPerSecond);
    this.#recoveryArg = String(settings.recoveryMs);
    this.#initialArg = String(settings.initial);
  }

  /** The Redis key of the bucket's `key`. */
  redisKey(key: string): string {
    return stageKey(this.#prefix, this.#name, `b:${key}`);
  }

  /** A fresh grant id: this process's random prefix and a counter. */
  grantId(): string {
    return `${GRANT_PREFIX}${++grants}`;
  }

  /** The arguments of a take, a refund or a settle: now, the bucket's settings, `cost`, the fresh key's tokens, `grant`. */
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

  /** ARGV of one `token-bucket-take`: `cost` for `grant`, waiting up to `maxWaitMs` ("0": not at all). */
  takeArgs(cost: number | string, grant: string, maxWaitMs: string): string[] {
    const args = this.#args(cost, grant);
    args.push(maxWaitMs);
    return args;
  }

  /**
   * A take failed: it may still run once Redis answers; the refund then undoes it (and does
   * nothing if it never ran, or if another grant came after it).
   */
  takeFailed(redisKey: string, cost: number, grant: string, error: unknown): void {
    if (maybeSent(error)) void this.refundAt(redisKey, cost, grant);
  }

  /**
   * A take (alone, or a step of a fused gate's call) ran after it was failed for not answering in
   * time: its caller failed closed, and the refund it sent then ran first and gave back nothing.
   * The tokens it took (or the place it reserved) are given back now, while it is the key's
   * latest grant, as that refund would have. One function for every take: `keys` and `args` are
   * its own (`takeArgs`: the cost at 4, the grant at 6).
   */
  readonly lateTake: Late = (keys, args) => void this.refundAt(keys[0]!, args[4]!, String(args[6]));

  /**
   * As `lateTake`, for a turn's takes in one `token-bucket-take-many` (cost, grant, wait each,
   * from 5; three figures each in its reply, taken first). The turn's takes are one stretch of
   * the key's line: while the last that took or reserved anything is still the key's latest
   * grant, nothing was taken after any of them, so their tokens all go back in one refund of
   * their sum, as if each had been refunded in turn from the last. (Without a reply to say which
   * took, only the last take is refunded: a refund of one that took nothing would give too much.)
   */
  readonly #lateTakes: Late = (keys, args, reply) => {
    if (!Array.isArray(reply)) {
      void this.refundAt(keys[0]!, args[args.length - 3]!, String(args[args.length - 2]));
      return;
    }
    let cost = 0;
    let grant: string | undefined;
    for (let i = 5, n = 0; i + 1 < args.length; i += 3, n++) {
      // (Taken, 1, or reserved, 2: anything else took nothing.)
      const flag = Number(reply[3 * n]);
      if (flag !== 1 && flag !== 2) continue;
      cost += Number(args[i]);
      grant = String(args[i + 1]);
    }
    if (grant !== undefined) void this.refundAt(keys[0]!, cost, grant);
  };

  /** Send takes of `redisKey` (cost, grant, maxWaitMs each): one alone as a plain take, more in one call. */
  sendTakes(redisKey: string, triples: string[]): Promise<unknown> {
    if (triples.length === 3) {
      return this.#link.run(
        this.#name,
        "token-bucket-take",
        [redisKey],
        this.takeArgs(triples[0]!, triples[1]!, triples[2]!),
        this.lateTake,
      );
    }
    const args: string[] = [
      this.#link.now(),
      this.#capacityArg,
      this.#refillArg,
      this.#recoveryArg,
      this.#initialArg,
      ...triples,
    ];
    return this.#link
      .run(this.#name, "token-bucket-take-many", [redisKey], args, this.#lateTakes)
      .then((replies: number[]) => {
        const each = new Array<TakeReply>(triples.length / 3);
        for (let i = 0; i < each.length; i++)
          each[i] = [replies[3 * i]!, replies[3 * i + 1]!, replies[3 * i + 2]!];
        return each;
      });
  }

  /** Give `cost` back for `grant` (a grant or a reservation), which Redis does only for the key's latest. */
  refund(key: string, cost: number, grant: string): Promise<unknown> {
    return this.refundAt(this.redisKey(key), cost, grant);
  }

  refundAt(redisKey: string, cost: number | string, grant: string): Promise<unknown> {
    return this.#link
      .run(this.#name, "token-bucket-refund", [redisKey], this.#args(cost, grant))
      .catch((error) => this.#log().warn({ err: error }, "refund failed"));
  }

  /** Slow `key`'s refill after a dropped call (the bucket has a penalty). */
  penalize(key: string): Promise<void> {
    const s = this.#s;
    return this.#link
      .run(
        this.#name,
        "token-bucket-penalize",
        [this.redisKey(key)],
        [
          this.#link.now(),
          s.capacity,
          s.refillPerSecond,
          s.recoveryMs,
          s.penaltyFactor!,
          s.minFactor,
          s.initial,
        ],
      )
      .then(
        (factor) => this.#log().warn({ key, rateFactor: Number(factor) / 1000 }, "key penalised after drop"),
        (error) => this.#log().warn({ err: error, key }, "penalty failed"),
      );
  }

  /** Charge `delta` more tokens for `grant` at `key` (less, when negative: given back while the latest). */
  settle(key: string, delta: number, grant: string): Promise<void> {
    return this.#link
      .run(this.#name, "token-bucket-settle", [this.redisKey(key)], this.#args(delta, grant))
      .then(() => undefined);
  }
}
