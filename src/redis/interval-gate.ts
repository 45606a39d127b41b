import { LONGEST_MS, pauseError } from "../admit.js";
import { spacingMs } from "../algorithms/interval.js";
import { answerWith, BaseTicket, type StepDone } from "../base/stage.js";
import type { Waiter } from "../base/wait-list.js";
import { hostRule } from "../call-rule.js";
import { pauseChannel } from "../channels.js";
import { DEFAULTS } from "../defaults.js";
import { fusable } from "../fuse.js";
import { draw } from "../memory/interval-gate.js";
import type { IntervalGateOptions } from "../options.js";
import type { AdmitOptions, Outcome, StageKind, Ticket } from "../types.js";
import { intervalGateSchema, parseOptions } from "../validate.js";
import { TURN_CHUNK } from "./batch.js";
import type { Late } from "./gate-call.js";
import { stageKey } from "./keys.js";
import { type Attempt, RedisLine, RedisLineStage } from "./line-stage.js";
import type { RedisLink } from "./link.js";
import type { RedisContext } from "./semaphore.js";

/** A host's line, with the next grant's spacing, drawn once however many times it is asked for. */
class HostLine extends RedisLine {
  spacing: number | undefined = undefined;
}

/** A ticket that remembers the slot it claimed, so a refund can hand it back. */
class SlotTicket extends BaseTicket {
  claimed = "";
  previous = "";
}

type TakeReply = [started: number, previousOrWait: string, claimed?: string];

/**
 * `redis(...).intervalGate(name, options)`: the next free slot of each host lives in Redis, so
 * the spacing holds across the fleet and `pause(host, ms)` holds the host back for every process.
 */
export class RedisIntervalGate extends RedisLineStage<HostLine> {
  readonly kind: StageKind = "intervalGate";
  readonly #link: RedisLink;
  readonly #prefix: string;
  readonly #minIntervalMs: number;
  readonly #jitterMs: number;
  readonly #random: () => number;
  readonly #defaultHost: string | undefined;

  constructor(name: string, options: IntervalGateOptions, ctx: RedisContext) {
    super(name, ctx);
    const o = parseOptions(intervalGateSchema, "intervalGate", name, options);
    this.#link = ctx.link;
    fusable(this, ctx.fusion);
    this.#prefix = ctx.prefix;
    this.#minIntervalMs = o.minIntervalMs;
    this.#jitterMs = o.jitterMs ?? DEFAULTS.intervalGate.jitterMs;
    this.#random = o.random ?? ctx.random;
    this.#defaultHost = o.defaultHost;
    this.callRule = hostRule(this.#defaultHost);
    this.init(o.logger ?? ctx.logger);
  }

  #key(host: string): string {
    return stageKey(this.#prefix, this.name, `h:${host}`);
  }

  protected newLine(host: string): HostLine {
    return new HostLine(this.#key(host));
  }

  /** One take for `line`'s head, with `args` (its spacing drawn once: `#takeArgs`). */
  #take(line: HostLine, args = this.#takeArgs(line)): Promise<TakeReply> {
    return this.#link
      .run(this.name, "interval-gate-take", line.keys, args, this.#lateTake)
      .then((reply: TakeReply) => this.#took(line, reply));
  }

  /**
   * A take the client ran after its caller failed closed (alone, or as a step of a fused gate's
   * call): the slot it claimed goes back while it is the host's latest, as the caller's own refund
   * would have. One function for every take: `keys` and `reply` are the take's.
   */
  readonly #lateTake: Late = (keys, _args, reply) => {
    if (!Array.isArray(reply) || Number(reply[0]) !== 1) return;
    void this.#refundSlot(keys[0]!, String(reply[2] ?? ""), String(reply[1] ?? ""));
  };

  /** ARGV of `interval-gate-take` for `line`'s next grant (its spacing drawn once, until granted). */
  #takeArgs(line: HostLine): (string | number)[] {
    line.spacing ??= Math.min(spacingMs(this.#minIntervalMs, this.#jitterMs, draw(this.#random)), LONGEST_MS);
    return [this.#link.now(), line.spacing];
  }

  /** Note what a take of `line` said: a grant uses up the spacing drawn for it. */
  #took(line: HostLine, reply: TakeReply): TakeReply {
    if (Number(reply[0]) === 1) line.spacing = undefined;
    return reply;
  }

  protected override newTicket(cost: number, key: string, now: number): BaseTicket {
    return new SlotTicket(this, cost, key, now);
  }

  #mark(ticket: BaseTicket, reply: TakeReply): SlotTicket {
    const t = ticket as SlotTicket;
    t.previous = String(reply[1] ?? "");
    t.claimed = String(reply[2] ?? "");
    return t;
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const host = (o.host ?? this.#defaultHost)!;
    const line = this.line(host);
    if (o.timeoutMs === 0 && line.size === 0) {
      return this.tryAdmit({ host, cost: o.cost }).then((t) => t ?? this.wait(line, o.cost ?? 1, host, o));
    }
    const promise = this.wait(line, o.cost ?? 1, host, o);
    this.joined(line, host);
    return promise;
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const host = (o.host ?? this.#defaultHost)!;
    const line = this.line(host);
    if (line.size > 0) return Promise.resolve(undefined);
    return this.#take(line).then((reply) => this.#tried(reply, o, host));
  }

  /** The ticket a try's take for `host` gave (undefined: refused); throws once the gate is closed. */
  #tried(reply: TakeReply, o: AdmitOptions, host: string): Ticket | undefined {
    if (Number(reply[0]) !== 1) return undefined;
    const ticket = this.#mark(this.issue(o.cost ?? 1, host, undefined, "token"), reply);
    if (this.closed) {
      void this.#refund(ticket);
      throw this.closedSignal.reason;
    }
    return ticket;
  }

  protected override tryStepChecked(o: AdmitOptions, done: StepDone): void {
    const host = (o.host ?? this.#defaultHost)!;
    const line = this.line(host);
    if (line.size > 0) {
      super.tryStepChecked(o, done);
      return;
    }
    this.#link.step(
      this.name,
      "interval-gate-take",
      line.keys,
      this.#takeArgs(line),
      (reply: TakeReply) => answerWith(done, () => this.#tried(this.#took(line, reply), o, host)),
      (error) => done(undefined, error),
      this.#lateTake,
    );
  }

  /**
   * Let no call start to `host` for `ms` milliseconds from now, in every process sharing this
   * Redis. Never shortens an earlier pause or the current spacing. `host` must be a non-empty
   * string and `ms` a finite number >= 0 (above `LONGEST_MS`, about 285,000 years, it pauses that
   * long); bad arguments reject with `InvalidOptionsError` before Redis is asked, as in memory.
   */
  pause(host: string, ms: number): Promise<void> {
    const invalid = pauseError(this.name, host, ms);
    if (invalid) return Promise.reject(invalid);
    const pauseMs = Math.min(ms, LONGEST_MS);
    this.log.warn({ host, ms: pauseMs }, "host paused");
    if (pauseChannel.hasSubscribers) {
      pauseChannel.publish({ stage: this.name, kind: this.kind, backend: this.backend, host, ms: pauseMs });
    }
    return this.#link
      .run(this.name, "interval-gate-pause", [this.#key(host)], [this.#link.now(), pauseMs])
      .then(() => this.serveAgain(host));
  }

  protected async attempt(line: HostLine, _head: Waiter): Promise<Attempt> {
    const args = this.#takeArgs(line);
    const sentAt = this.clock.now();
    const reply = await this.#take(line, args);
    // Redis decided about halfway between the call and its reply: the next slot is `spacing` after.
    const sinceDecided = (this.clock.now() - sentAt) / 2;
    return this.#attemptOf(line, reply, Math.max(0, Number(args[1]) - sinceDecided));
  }

  /**
   * What a take's `reply` says for the waiter it asked for: granted, the host's next slot is
   * `nextInMs` off, so the line sleeps as long before it asks for the next.
   */
  #attemptOf(line: HostLine, reply: TakeReply, nextInMs: number): Attempt {
    if (Number(reply[0]) !== 1) return { granted: false, waitMs: Number(reply[1]) };
    return {
      granted: true,
      adopt: (ticket) => this.#mark(ticket, reply),
      giveBack: () => void this.#refundSlot(line.redisKey, String(reply[2] ?? ""), String(reply[1] ?? "")),
      nextInMs,
    };
  }

  /**
   * A gate that spaces nothing (`minIntervalMs` and `jitterMs` 0: only a pause holds a host back)
   * lets a grant hold nobody behind it back, so a host's line asks for up to TURN_CHUNK of its
   * first waiters in one take, as memory lets every waiter whose slot has come go at once. Any
   * other asks for its head alone: a grant spaces the next, whose spacing is drawn as it asks.
   */
  protected override headsAtOnce(_line: HostLine): number {
    return this.#minIntervalMs === 0 && this.#jitterMs === 0 ? TURN_CHUNK : 1;
  }

  /** One take for each of `heads`, decided in turn in one script call (lua/interval-gate-take.lua). */
  protected override async attemptMany(line: HostLine, heads: readonly Waiter[]): Promise<Attempt[]> {
    const args = this.#takeArgs(line);
    // (The head's spacing, drawn as a lone head's is; the others', 0: see `headsAtOnce`.)
    for (let i = 1; i < heads.length; i++) args.push(0);
    const replies: unknown = await this.#link.run(
      this.name,
      "interval-gate-take",
      line.keys,
      args,
      this.#lateTakes,
    );
    if (!Array.isArray(replies) || replies.length !== heads.length || !replies.every(Array.isArray)) {
      throw new Error(`interval-gate-take: ${heads.length} takes answered ${JSON.stringify(replies)}`);
    }
    const takes = replies as TakeReply[];
    this.#took(line, takes[0]!);
    // (Every spacing after the head's is 0; the head's is 0 too: see `headsAtOnce`.)
    return takes.map((reply) => this.#attemptOf(line, reply, 0));
  }

  /** A turn's takes the client ran after their callers failed closed: each slot claimed goes back, latest first. */
  readonly #lateTakes: Late = (keys, args, replies) => {
    if (!Array.isArray(replies)) return;
    for (let i = replies.length - 1; i >= 0; i--) this.#lateTake(keys, args, replies[i]);
  };

  #refundSlot(redisKey: string, claimed: string, previous: string): Promise<unknown> {
    return this.#link
      .run(this.name, "interval-gate-refund", [redisKey], [this.#link.now(), claimed, previous])
      .catch((error) => this.log.warn({ err: error }, "slot refund failed"));
  }

  #refund(t: SlotTicket): Promise<unknown> {
    return this.#refundSlot(this.#key(t.key), t.claimed, t.previous);
  }

  releaseTicket(ticket: BaseTicket, _outcome: Outcome, refund: boolean): Promise<void> | undefined {
    if (!refund) return undefined;
    return this.#refund(ticket as SlotTicket).then(() => {
      this.serveAgain(ticket.key);
    });
  }
}
