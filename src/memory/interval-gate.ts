import { LONGEST_MS, pauseError } from "../admit.js";
import {
  claimSlot,
  delayMs,
  type HostState,
  pauseHost,
  refundSlot,
  spacingMs,
} from "../algorithms/interval.js";
import { TimedLine } from "../base/line-stage.js";
import { BaseTicket } from "../base/stage.js";
import type { WaitEntry, WaitList } from "../base/wait-list.js";
import { hostRule } from "../call-rule.js";
import { pauseChannel } from "../channels.js";
import type { Clock } from "../clock.js";
import { DEFAULTS } from "../defaults.js";
import { fusable } from "../fuse.js";
import type { IntervalGateOptions } from "../options.js";
import type { AdmitOptions, Outcome, StageKind, Ticket } from "../types.js";
import { intervalGateSchema, parseOptions } from "../validate.js";
import { memoryFusion } from "./fused-gate.js";
import { MemoryLineStage } from "./line-stage.js";

/** One host: when its next call may start, its FIFO of waiters, and the timer for the head. */
class HostSlot extends TimedLine implements HostState {
  /** End of the latest pause; a refunded slot never reaches back inside it. */
  pausedUntil = Number.NEGATIVE_INFINITY;
  constructor(public nextAt: number) {
    super();
  }
}

/** A ticket that remembers the slot it claimed, so a refund can hand it back. */
class SlotTicket extends BaseTicket {
  /** `nextAt` this grant set, and the one it replaced. */
  claimed = 0;
  previous = 0;
}

/**
 * One draw of `random` for the jitter. A `random` that throws draws 0 (no jitter) rather than
 * failing the call; a value outside [0, 1) is treated as 0 by `spacingMs`.
 */
export function draw(random: () => number): number {
  try {
    return random();
  } catch {
    return 0;
  }
}

/**
 * Minimum spacing between the starts of calls to each host: `minIntervalMs` plus a random
 * `[0, jitterMs)` on top, never less. `pause(host, ms)` holds a host back (Retry-After).
 */
export class MemoryIntervalGate extends MemoryLineStage<HostSlot> {
  readonly kind: StageKind = "intervalGate";
  readonly #minIntervalMs: number;
  readonly #jitterMs: number;
  readonly #random: () => number;
  readonly #defaultHost: string | undefined;

  constructor(name: string, options: IntervalGateOptions, clock: Clock, random: () => number = Math.random) {
    const o = parseOptions(intervalGateSchema, "intervalGate", name, options);
    const jitterMs = o.jitterMs ?? DEFAULTS.intervalGate.jitterMs;
    super(name, clock, Math.min(Math.max(1000, Math.ceil(o.minIntervalMs + jitterMs)), 600_000));
    this.#minIntervalMs = o.minIntervalMs;
    this.#jitterMs = jitterMs;
    this.#random = o.random ?? random;
    this.#defaultHost = o.defaultHost;
    this.callRule = hostRule(this.#defaultHost);
    fusable(this, memoryFusion(clock));
    this.init(o.logger);
  }

  protected isIdle(h: HostSlot, now: number): boolean {
    return h.size === 0 && h.nextAt <= now && h.pausedUntil <= now;
  }

  protected newLine(now: number): HostSlot {
    return new HostSlot(now);
  }

  /**
   * Every waiter whose slot has come, in order: after each, the host's next slot is one spacing
   * on, so with a spacing of 0 the next goes at the same instant, as on Redis (and before a
   * timeout due at that instant, which counts capacity free then as in time).
   */
  protected grantReady(h: HostSlot, _host: string, now: number): void {
    for (let w = h.head; w && h.nextAt <= now; w = h.head) {
      const previous = this.#claim(h, now);
      this.#mark(this.grant(w, "token"), previous, h);
    }
  }

  protected headWaitMs(h: HostSlot, _head: WaitEntry, now: number): number {
    return delayMs(h.nextAt, now);
  }

  #start(h: HostSlot, cost: number, host: string, now: number): SlotTicket {
    const previous = this.#claim(h, now);
    return this.#mark(this.issue(cost, host, undefined, "token", false, now), previous, h);
  }

  /** Move the host's next slot on by one spacing; returns the slot it replaced. */
  #claim(h: HostSlot, now: number): number {
    const spacing = spacingMs(this.#minIntervalMs, this.#jitterMs, draw(this.#random));
    return claimSlot(h, now, Math.min(spacing, LONGEST_MS));
  }

  #mark(ticket: BaseTicket, previous: number, h: HostSlot): SlotTicket {
    const t = ticket as SlotTicket;
    t.previous = previous;
    t.claimed = h.nextAt;
    return t;
  }

  protected override newTicket(cost: number, key: string, now: number): BaseTicket {
    return new SlotTicket(this, cost, key, now);
  }

  protected override admitChecked(o: AdmitOptions): Promise<Ticket> {
    const host = (o.host ?? this.#defaultHost)!;
    const now = this.clock.now();
    const h = this.line(host, now);
    if (h.size === 0 && h.nextAt <= now) return Promise.resolve(this.#start(h, o.cost ?? 1, host, now));
    const promise = this.wait(h, o.cost ?? 1, host, o);
    this.schedule(h, host);
    return promise;
  }

  override admitNow(o: AdmitOptions, cost: number): BaseTicket | undefined {
    if (this.refusing || !Number.isInteger(cost) || cost < 0 || o.signal?.aborted) return undefined;
    const host = o.host ?? this.#defaultHost;
    if (host === undefined) return undefined;
    const now = this.time();
    const h = this.line(host, now);
    if (h.size !== 0 || h.nextAt > now) return undefined;
    return this.#start(h, cost, host, now);
  }

  override fuseProbe(o: AdmitOptions, cost: number): number {
    this.throwIfRefusing();
    const host = o.host ?? this.#defaultHost;
    if (host === undefined || !Number.isInteger(cost) || cost < 0) return Number.NaN;
    const now = this.time();
    const h = this.line(host, now);
    if (h.size === 0 && h.nextAt <= now) return 0;
    // Behind its own waiters, the host's slot is theirs first: ask again once it has passed.
    return Math.max(1, Math.ceil(delayMs(h.nextAt, now)));
  }

  protected tryAdmitChecked(o: AdmitOptions): Promise<Ticket | undefined> {
    const host = (o.host ?? this.#defaultHost)!;
    const now = this.clock.now();
    const h = this.line(host, now);
    if (h.size > 0 || h.nextAt > now) return Promise.resolve(undefined);
    return Promise.resolve(this.#start(h, o.cost ?? 1, host, now));
  }

  /**
   * Let no call start to `host` for `ms` milliseconds from now (a Retry-After). A pause never
   * shortens an earlier one or the current spacing. `host` must be a non-empty string and `ms` a
   * finite number >= 0 (above `LONGEST_MS`, about 285,000 years, it pauses that long); bad
   * arguments reject with `InvalidOptionsError`, as on Redis.
   */
  pause(host: string, ms: number): Promise<void> {
    const invalid = pauseError(this.name, host, ms);
    if (invalid) return Promise.reject(invalid);
    ms = Math.min(ms, LONGEST_MS);
    const now = this.clock.now();
    const h = this.line(host, now);
    pauseHost(h, now, ms);
    this.log.warn({ host, ms }, "host paused");
    if (pauseChannel.hasSubscribers) {
      pauseChannel.publish({ stage: this.name, kind: this.kind, backend: this.backend, host, ms });
    }
    this.schedule(h, host);
    return Promise.resolve();
  }

  /** Milliseconds until a call to `host` could start, ignoring waiters already queued. */
  delayFor(host: string = this.#defaultHost ?? "default"): number {
    const h = this.lines.get(host);
    return h ? delayMs(h.nextAt, this.clock.now()) : 0;
  }

  releaseTicket(ticket: BaseTicket, _outcome: Outcome, refund: boolean): void {
    if (!refund) return;
    const t = ticket as SlotTicket;
    const h = this.lines.get(t.key);
    // Hand the slot back only when nothing has moved the host on since (a later call, a pause).
    if (h && refundSlot(h, t.claimed, t.previous)) this.serveLine(h, t.key);
  }

  protected afterWaiterGone(list: WaitList, waiter: { key: string }): void {
    this.schedule(list as HostSlot, waiter.key);
  }

  /** Hosts currently kept in memory. */
  get hostCount(): number {
    return this.lines.size;
  }
}
