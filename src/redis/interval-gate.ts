import { spacingMs } from "../algorithms/interval.js";
import { KeyedStates } from "../base/keyed.js";
import { BaseStage, BaseTicket } from "../base/stage.js";
import { type Waiter, WaitList } from "../base/wait-list.js";
import type { ClockTimer } from "../clock.js";
import { InvalidOptionsError } from "../errors.js";
import type { IntervalGateOptions } from "../options.js";
import type { AdmitOptions, Outcome, Snapshot, StageKind, Ticket, TryAdmitOptions } from "../types.js";
import { intervalGateSchema, parseOptions } from "../validate.js";
import { stageKey } from "./keys.js";
import type { RedisLink } from "./link.js";
import type { RedisContext } from "./semaphore.js";

/** This process's waiters for one host, asked for in order, one Redis call at a time. */
class HostLine extends WaitList {
  timer: ClockTimer | undefined = undefined;
  busy: Promise<void> | undefined = undefined;
  again = false;
  /** The next grant's spacing, drawn once however many times it is asked for. */
  spacing: number | undefined = undefined;
  constructor(readonly redisKey: string) {
    super();
  }
}

/** A ticket that remembers the slot it claimed, so a refund can hand it back. */
class SlotTicket extends BaseTicket {
  claimed = "";
  previous = "";
}

type TakeReply = [started: number, previousOrWait: string, claimed?: string];

const DEFAULT_HOST = "default";

/**
 * `redis(...).intervalGate(name, options)`: the next free slot of each host lives in Redis, so
 * the spacing holds across the fleet and `pause(host, ms)` holds the host back for every process.
 */
export class RedisIntervalGate extends BaseStage {
  readonly kind: StageKind = "intervalGate";
  override readonly backend = "redis";
  readonly #link: RedisLink;
  readonly #prefix: string;
  readonly #minIntervalMs: number;
  readonly #jitterMs: number;
  readonly #random: () => number;
  readonly #lines: KeyedStates<HostLine>;

  constructor(name: string, options: IntervalGateOptions, ctx: RedisContext) {
    super(name, ctx.clock);
    const o = parseOptions(intervalGateSchema, "intervalGate", name, options);
    this.#link = ctx.link;
    this.#prefix = ctx.prefix;
    this.#minIntervalMs = o.minIntervalMs;
    this.#jitterMs = o.jitterMs ?? 0;
    this.#random = o.random ?? ctx.random;
    this.#lines = new KeyedStates(ctx.clock, 10_000, (line) => line.size === 0 && !line.busy);
    this.init(o.logger ?? ctx.logger);
  }

  #key(host: string): string {
    return stageKey(this.#prefix, this.name, `h:${host}`);
  }

  #line(host: string): HostLine {
    let line = this.#lines.get(host);
    if (!line) {
      line = new HostLine(this.#key(host));
      this.#lines.set(host, line);
    }
    return line;
  }

  #take(line: HostLine): Promise<TakeReply> {
    line.spacing ??= spacingMs(this.#minIntervalMs, this.#jitterMs, this.#random());
    return this.#link
      .run(this.name, "interval-gate-take", [line.redisKey], [this.#link.now(), line.spacing])
      .then((reply: TakeReply) => {
        if (Number(reply[0]) === 1) line.spacing = undefined;
        return reply;
      });
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

  admit(options?: AdmitOptions): Promise<Ticket> {
    let o: AdmitOptions;
    try {
      o = this.check(options);
    } catch (error) {
      return Promise.reject(error);
    }
    if (o.signal?.aborted) return Promise.reject(o.signal.reason);
    const host = o.host ?? DEFAULT_HOST;
    const line = this.#line(host);
    if (o.timeoutMs === 0 && line.size === 0) {
      return this.tryAdmit(o).then((t) => t ?? this.wait(line, o.cost ?? 1, host, o));
    }
    const promise = this.wait(line, o.cost ?? 1, host, o);
    void this.#drain(line, host);
    return promise;
  }

  tryAdmit(options?: TryAdmitOptions): Promise<Ticket | undefined> {
    try {
      const o = this.check(options);
      const host = o.host ?? DEFAULT_HOST;
      const line = this.#line(host);
      if (line.size > 0) return Promise.resolve(undefined);
      const startedAt = this.clock.now();
      return this.#take(line).then((reply) => {
        if (Number(reply[0]) !== 1) return undefined;
        const ticket = this.#mark(this.issue(o.cost ?? 1, host, startedAt, "token"), reply);
        if (this.closed) {
          void this.#refund(ticket);
          throw this.closedSignal.reason;
        }
        return ticket;
      });
    } catch (error) {
      return Promise.reject(error);
    }
  }

  /**
   * Let no call start to `host` for `ms` milliseconds from now, in every process sharing this
   * Redis. Never shortens an earlier pause or the current spacing.
   */
  pause(host: string, ms: number): Promise<void> {
    if (typeof host !== "string" || host.length === 0) {
      return Promise.reject(
        new InvalidOptionsError(
          this.name,
          "host",
          `intervalGate "${this.name}": host must be a non-empty string`,
        ),
      );
    }
    if (!(ms >= 0) || !Number.isFinite(ms)) {
      return Promise.reject(
        new InvalidOptionsError(
          this.name,
          "ms",
          `intervalGate "${this.name}": pause ms must be a finite number >= 0 (got ${ms})`,
        ),
      );
    }
    this.log.warn({ host, ms }, "host paused");
    return this.#link
      .run(this.name, "interval-gate-pause", [this.#key(host)], [this.#link.now(), ms])
      .then(() => {
        const line = this.#lines.get(host);
        if (line) void this.#drain(line, host);
      });
  }

  /** Start the head's call if its slot has come; else sleep until the slot Redis names. */
  #drain(line: HostLine, host: string): Promise<void> | undefined {
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
    line.busy = this.#take(line).then(
      (reply) => {
        line.busy = undefined;
        if (Number(reply[0]) === 1) {
          if (head.list === line) this.#mark(this.grant(head, "token"), reply);
          else void this.#refundSlot(line.redisKey, String(reply[2] ?? ""), String(reply[1] ?? ""));
          void this.#drain(line, host);
          return;
        }
        if (line.again || head.list !== line) {
          void this.#drain(line, host);
          return;
        }
        line.timer = this.clock.setTimeout(() => {
          line.timer = undefined;
          void this.#drain(line, host);
        }, Number(reply[1]));
      },
      (error: unknown) => {
        line.busy = undefined;
        this.log.warn({ err: error, host }, "Redis unavailable; admission failed closed");
        for (let w = line.head; w; w = line.head) this.failWaiter(w, error);
      },
    );
    return line.busy;
  }

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
      const line = this.#lines.get(ticket.key);
      if (line) void this.#drain(line, ticket.key);
    });
  }

  protected override grantDue(list: WaitList, key: string): Promise<void> | undefined {
    return this.#drain(list as HostLine, key);
  }

  protected afterWaiterGone(list: WaitList, waiter: Waiter): void {
    void this.#drain(list as HostLine, waiter.key);
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
