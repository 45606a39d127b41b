import { BaseTicket } from "../base/stage.js";
import { type Clock, type ClockTimer, unrefTimer } from "../clock.js";
import type { Logger } from "../types.js";
import type { RedisLink } from "./link.js";

/** A granted lease: its id, fencing token, and the renewal that keeps it alive. */
export class LeaseTicket extends BaseTicket {
  leaseId = "";
  /** Increases with every grant of the stage: pass it to the server to reject stale writers. */
  fence = 0;
  epoch = 0;
  controller: AbortController | undefined = undefined;
  /** The renewal its lease waits in while kept alive (see `LeaseKeeper`). @internal */
  renewal: Renewal | undefined = undefined;
  /** The keeper that renews its lease, its stage's. @internal */
  keeper: LeaseKeeper | undefined = undefined;
  renewing = false;
  /**
   * When the lease ends at the latest, on this process's clock: the lease's end on the server
   * less the most the server's clock can be ahead. Past it the ticket is lost, whatever Redis
   * has said.
   */
  validUntil = 0;
  lost = false;
  /** Asked back for a class below its guarantee (reclaim "signal"): its signal aborts. */
  reclaimed = false;
}

/** What a `LeaseKeeper` works with: one permit stage of one process. */
export interface LeaseKeeperSettings {
  /** The stage's name, for the script calls. */
  stage: string;
  link: RedisLink;
  clock: Clock;
  /** The stage's logger (read when used: it is set once the stage is built). */
  log: () => Logger;
  /** KEYS of `semaphore-renew`: the stage's holders and procs. */
  keys: readonly string[];
  /** Length of a full lease, ms. */
  leaseMs: number;
  /**
   * Names this process in Redis, for its sign of life: the stage's own members are
   * `<token>-<n>:<cost>` (a fused gate's leases take its call's name instead).
   */
  token: string;
  /** How long a sign of life lasts, ms. */
  livenessMs: number;
  /** Whether any waiter of the stage is left in this process. */
  waiting: () => boolean;
  /** A lease ran out before its release; called once per ticket. */
  lost: (t: LeaseTicket, cause?: unknown) => void;
}

/**
 * Leases renewed together, on one timer set at `at` (this clock's ms) for `ms` later: of any
 * permit stage on that clock, each renewed by its own stage's keeper.
 */
export interface Renewal {
  at: number;
  ms: number;
  leases: Set<LeaseTicket>;
  timer: ClockTimer;
}

/**
 * The latest renewal set on each clock, which leases kept within the same ms may join (see
 * `LeaseKeeper`): the permit stages on one clock share it, so that a fused gate's call, which
 * holds a lease at each of its permit stages, costs one timer, not one per stage.
 */
const openRenewals = new WeakMap<Clock, Renewal>();

/** How much sooner than its own time a lease may be renewed, with others on their timer, ms. */
const RENEW_TOGETHER_MS = 50;

/**
 * Keeps a permit stage's leases alive in Redis, and its process's sign of life. A lease is
 * renewed at 80% of what is left of it (a grant not yet claimed has a short one: the renewal
 * claims it) and judged lost once its end on this process's clock has passed, whatever Redis
 * would say. While the stage has waiters, one call every `livenessMs / 3` (unless a wait or a
 * renewal gave one meanwhile) keeps them in line for the whole process.
 *
 * Leases kept in the same ms (a turn's admissions, whose replies came together; a fused gate's
 * call's leases at its permit stages) and due within RENEW_TOGETHER_MS of one another share one
 * timer, set for the soonest, whatever permit stage on this clock keeps them: a turn of 32
 * admissions costs one setTimeout, and one clearTimeout once the last of them is given back,
 * instead of 32 of each (bench/RESULTS.md).
 */
export class LeaseKeeper {
  /** When this process last sent a sign of life for the stage (a wait, a renewal, a beat). */
  #signedAt = Number.NEGATIVE_INFINITY;
  #heartbeat: ClockTimer | undefined = undefined;
  readonly #every: number;

  constructor(private readonly s: LeaseKeeperSettings) {
    this.#every = Math.max(1, Math.floor(s.livenessMs / 3));
  }

  /** Keep `t`, valid until `validUntil` on this process's clock, alive until it is dropped. */
  keep(t: LeaseTicket, validUntil: number): void {
    t.validUntil = validUntil;
    this.#schedule(t);
  }

  /** Stop renewing `t` (it is being released). */
  drop(t: LeaseTicket): void {
    const renewal = t.renewal;
    if (renewal === undefined) return;
    t.renewal = undefined;
    renewal.leases.delete(t);
    // (Its timer goes with its last lease.)
    if (renewal.leases.size === 0) {
      const clock = this.s.clock;
      clock.clearTimeout(renewal.timer);
      if (openRenewals.get(clock) === renewal) openRenewals.delete(clock);
    }
  }

  /** Whether `t` holds a lease that has ended on this process's clock and is not yet known lost. */
  ended(t: LeaseTicket): boolean {
    return !t.lost && !t.released && t.leaseId !== "" && this.s.clock.now() >= t.validUntil;
  }

  /**
   * Renew with a fifth of the time left to spare, and at least half of it (up to a second): a
   * grant's short claim window (`claimMs`) then keeps room for a timer that fires late on a busy
   * event loop, while a long lease is still renewed rarely.
   */
  #schedule(t: LeaseTicket): void {
    const now = this.s.clock.now();
    const leftMs = t.validUntil - now;
    const spareMs = Math.max(leftMs * 0.2, Math.min(leftMs * 0.5, 1000));
    this.#renewIn(t, Math.max(1, Math.floor(leftMs - spareMs)), now);
  }

  /**
   * Renew `t` in `ms` (at least 1), counted from `now` (the clock's time, read by the caller when
   * it has it): with the leases kept within the same ms whose renewal is due as soon, or up to
   * RENEW_TOGETHER_MS sooner (renewed a little early, never late), else on a timer of its own.
   * (Timers are set by delays, never by this clock's time of day, so that a clock stepped while
   * they run moves no renewal.)
   */
  #renewIn(t: LeaseTicket, ms: number, now = this.s.clock.now()): void {
    const clock = this.s.clock;
    let renewal = openRenewals.get(clock);
    // (Joined, it is renewed no later than its own time: that renewal's timer was set before
    // now, for no longer. A clock stepped back since is taken as a new ms.)
    const since = renewal === undefined ? -1 : now - renewal.at;
    if (
      renewal === undefined ||
      !(since >= 0 && since < 1) ||
      ms < renewal.ms ||
      ms > renewal.ms + RENEW_TOGETHER_MS
    ) {
      const fresh: Renewal = { at: now, ms, leases: new Set(), timer: undefined };
      fresh.timer = unrefTimer(clock.setTimeout(() => fire(clock, fresh), ms));
      renewal = fresh;
      openRenewals.set(clock, fresh);
    }
    renewal.leases.add(t);
    t.renewal = renewal;
    t.keeper = this;
  }

  /** Renew `t`, one of this keeper's leases whose renewal's time has come (see `fire`). @internal */
  renewNow(t: LeaseTicket): void {
    this.#renew(t);
  }

  #renew(t: LeaseTicket): void {
    if (t.released || t.renewing || t.lost) return;
    const { clock, link } = this.s;
    // Frozen past the lease's end (the timer ran late): it is lost, whatever Redis would say.
    if (clock.now() >= t.validUntil) {
      this.s.lost(t);
      return;
    }
    t.renewing = true;
    const sentAt = clock.now();
    this.#signedAt = sentAt;
    link
      .run(this.s.stage, "semaphore-renew", this.s.keys, [
        link.now(),
        t.leaseId,
        this.s.leaseMs,
        this.s.token,
        this.s.livenessMs,
      ])
      .then(
        (reply: [number, number]) => {
          t.renewing = false;
          link.sawServerTime(Number(reply[1]), sentAt);
          if (t.released || t.lost) return;
          if (Number(reply[0]) === 1) this.keep(t, sentAt + this.s.leaseMs);
          else this.s.lost(t);
        },
        (error: unknown) => {
          t.renewing = false;
          if (t.released || t.lost) return;
          const leftMs = t.validUntil - clock.now();
          if (leftMs <= 0) return this.s.lost(t, error);
          this.s.log().warn({ err: error, lease: t.leaseId }, "lease renewal failed; retrying");
          this.#renewIn(t, Math.max(1, Math.min(1000, Math.floor(leftMs / 10))));
        },
      );
  }

  /**
   * A waiter lined up, with a call sent at `signedAt` that gave a sign of life: make sure the
   * process keeps giving them while any waiter is left.
   */
  keepAlive(signedAt: number): void {
    if (signedAt > this.#signedAt) this.#signedAt = signedAt;
    if (this.#heartbeat !== undefined) return;
    this.#heartbeat = unrefTimer(this.s.clock.setTimeout(this.#beat, this.#every));
  }

  /** No waiter left (or the stage closed): no sign of life is needed until the next one. */
  quiet(): void {
    if (this.#heartbeat !== undefined && !this.s.waiting()) {
      this.s.clock.clearTimeout(this.#heartbeat);
      this.#heartbeat = undefined;
    }
  }

  readonly #beat = (): void => {
    this.#heartbeat = undefined;
    if (!this.s.waiting()) return;
    const { clock, link } = this.s;
    const now = clock.now();
    if (now - this.#signedAt >= this.#every) {
      this.#signedAt = now;
      link
        .run(this.s.stage, "semaphore-renew", this.s.keys, [
          link.now(),
          "",
          0,
          this.s.token,
          this.s.livenessMs,
        ])
        .then(
          (reply: [number, number]) => link.sawServerTime(Number(reply[1]), now),
          (error: unknown) =>
            this.s.log().warn({ err: error }, "could not give a sign of life; waiters may lose their place"),
        );
    }
    this.keepAlive(this.#signedAt);
  };
}

/** A renewal's time has come on `clock`: each of its leases renewed by its own stage's keeper. */
function fire(clock: Clock, renewal: Renewal): void {
  if (openRenewals.get(clock) === renewal) openRenewals.delete(clock);
  for (const t of renewal.leases) {
    t.renewal = undefined;
    t.keeper?.renewNow(t);
  }
  renewal.leases.clear();
}
