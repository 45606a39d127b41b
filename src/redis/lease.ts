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
  /** Names this process in Redis: its members are `<token>-<n>:<cost>`. */
  token: string;
  /** How long a sign of life lasts, ms. */
  livenessMs: number;
  /** Whether any waiter of the stage is left in this process. */
  waiting: () => boolean;
  /** A lease ran out before its release; called once per ticket. */
  lost: (t: LeaseTicket, cause?: unknown) => void;
}

/**
 * Keeps a permit stage's leases alive in Redis, and its process's sign of life. A lease is
 * renewed at 80% of what is left of it (a grant not yet claimed has a short one: the renewal
 * claims it) and judged lost once its end on this process's clock has passed, whatever Redis
 * would say. While the stage has waiters, one call every `livenessMs / 3` (unless a wait or a
 * renewal gave one meanwhile) keeps them in line for the whole process.
 *
 * One timer serves all of a stage's leases: it is set for the earliest renewal due, and each time
 * it fires it renews every lease due by then. (A timer per lease cost a setTimeout and a
 * clearTimeout per admission, about a tenth of the client's CPU per call on a fused gate with
 * two permit stages at 64 callers: bench/RESULTS.md.)
 */
export class LeaseKeeper {
  /** When this process last sent a sign of life for the stage (a wait, a renewal, a beat). */
  #signedAt = Number.NEGATIVE_INFINITY;
  #heartbeat: ClockTimer | undefined = undefined;
  readonly #every: number;
  /** Each lease kept alive, with when its renewal is due (or its retry), on this process's clock. */
  readonly #due = new Map<LeaseTicket, number>();
  /** The timer for the earliest renewal due, and when it fires (Infinity: none set). */
  #timer: ClockTimer | undefined = undefined;
  #timerAt = Number.POSITIVE_INFINITY;

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
    // (With leases left, the timer stays as it is: fired with nothing due, it is set for the
    // next one. With none, it goes.)
    if (this.#due.delete(t) && this.#due.size === 0 && this.#timer !== undefined) {
      this.s.clock.clearTimeout(this.#timer);
      this.#timer = undefined;
      this.#timerAt = Number.POSITIVE_INFINITY;
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
    const leftMs = t.validUntil - this.s.clock.now();
    const spareMs = Math.max(leftMs * 0.2, Math.min(leftMs * 0.5, 1000));
    this.#renewIn(t, Math.max(1, Math.floor(leftMs - spareMs)));
  }

  /** Renew `t` in `ms` (at least 1). */
  #renewIn(t: LeaseTicket, ms: number): void {
    const now = this.s.clock.now();
    const at = now + ms;
    this.#due.set(t, at);
    if (at < this.#timerAt) this.#arm(at, now);
  }

  /** Set the timer to fire at `at` (`now` being now), in place of the one set, if any. */
  #arm(at: number, now: number): void {
    const clock = this.s.clock;
    if (this.#timer !== undefined) clock.clearTimeout(this.#timer);
    this.#timerAt = at;
    this.#timer = unrefTimer(clock.setTimeout(this.#fire, Math.max(1, at - now)));
  }

  /** Renew every lease due by now; set the timer for the next one due. */
  readonly #fire = (): void => {
    this.#timer = undefined;
    this.#timerAt = Number.POSITIVE_INFINITY;
    const now = this.s.clock.now();
    let next = Number.POSITIVE_INFINITY;
    const due: LeaseTicket[] = [];
    for (const [t, at] of this.#due) {
      if (at <= now) due.push(t);
      else if (at < next) next = at;
    }
    for (const t of due) this.#due.delete(t);
    // (Set before the renewals: one that fails at once sets its retry, earlier or not.)
    if (next < this.#timerAt) this.#arm(next, now);
    for (const t of due) this.#renew(t);
  };

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
