/**
 * What one try of a fused gate gave: each stage answers its own step (`tryStep`) as the `gate`
 * call's reply settles it; once all have, the try's caller is told its tickets, or why it waits
 * and for which stage; a try whose steps Redis keeps is told at once, with what its steps give
 * once a grant or the caller's next try settles them.
 */
import { settleAll } from "../gate-ticket.js";
import type { Ticket } from "../types.js";
import type { Attempt, Held } from "./fused-kept.js";
import type { FusedWaits } from "./fused-waits.js";
import { type GateReply, NOT_RUN } from "./gate-call.js";

/** What the stages of one try answer (`tryStep`), as they do. */
export class Answers {
  /** Each stage's ticket, in order, once it has answered (undefined: refused, or failed). */
  readonly tickets: (Ticket | undefined)[];
  /** Each stage's step in the try's `gate` call (-1: it made no script call). */
  readonly stepOf: number[];
  /** Stages yet to answer. */
  #left: number;
  readonly #answered: boolean[];
  /** A stage refused, failed, or did not run. */
  refused = false;
  /** The first failure a stage answered with, but for not having run (`NOT_RUN`). */
  failure: unknown = undefined;
  /** A stage's step did not run. */
  notRun = false;
  #whenAll: (() => void) | undefined = undefined;

  constructor(n: number) {
    this.tickets = new Array<Ticket | undefined>(n);
    this.stepOf = new Array<number>(n);
    this.#answered = new Array<boolean>(n).fill(false);
    this.#left = n;
  }

  /** Stage `i` answered (`StepDone`); once only. */
  answer(i: number, ticket: Ticket | undefined, error: unknown): void {
    if (this.#answered[i]) return;
    this.#answered[i] = true;
    if (error !== undefined) {
      if (error === NOT_RUN) this.notRun = true;
      else this.failure ??= error;
      this.refused = true;
    } else if (ticket === undefined) this.refused = true;
    else this.tickets[i] = ticket;
    if (--this.#left === 0 && this.#whenAll) this.#whenAll();
  }

  /** Call `fn` once every stage has answered (at once if all have). */
  whenAll(fn: () => void): void {
    if (this.#left === 0) fn();
    else this.#whenAll = fn;
  }

  /** The tickets of the stages that admitted, in order. */
  admitted(): Ticket[] {
    const out: Ticket[] = [];
    for (const t of this.tickets) if (t !== undefined) out.push(t);
    return out;
  }
}

/** What reading a try's answers needs of its gate. */
export interface OutcomeHost {
  /** The gate's name, for its errors. */
  name: string;
  /** Longest a waiter goes without asking Redis again, ms. */
  pollMs: number;
  /** The stage each call waits for (`FusedWaits.refused`). */
  waits: FusedWaits;
  /** Run `fn` (the gate's releases) with this turn's others in one `gate` call. */
  together(fn: () => Promise<void>): Promise<void>;
  /** The wake-ups and grants a reply carries, for this process's callers. */
  wakeAll(messages: readonly string[]): void;
}

/** The try a reply is for, as its caller waits on it. */
export interface TryEnd {
  /** The try's number. */
  try: number;
  resolve: (a: Attempt) => void;
  reject: (error: unknown) => void;
}

/** Tells a fused gate's tries what they gave. */
export class TryOutcomes {
  readonly #host: OutcomeHost;

  constructor(host: OutcomeHost) {
    this.#host = host;
  }

  /**
   * A try's `gate` call is back (with `reply`, or `failed` with `error`, or undefined: not sent,
   * no stage made a step): tell `t` what it gave, once its stages have answered; for a try whose
   * steps Redis keeps, at once, with what they give once settled (`held`).
   */
  answered(reply: GateReply | undefined, failed: boolean, error: unknown, answers: Answers, t: TryEnd): void {
    if (reply) this.#host.wakeAll(reply.woken);
    const hold = reply?.hold;
    if (hold) {
      const result = new Promise<Attempt>((resolve, reject) => {
        answers.whenAll(() => {
          try {
            resolve(this.#settled(reply, failed, error, answers));
          } catch (e) {
            reject(e);
          }
        });
      });
      result.catch(() => {});
      let steps = 0;
      for (const step of answers.stepOf) if (step >= 0) steps++;
      const held: Held = {
        try: t.try,
        settle: hold,
        collectedLate: reply!.collectedLate!,
        result,
        granted: false,
        steps,
      };
      const attempt = this.#refused(reply!, answers.stepOf);
      attempt.held = held;
      t.resolve(attempt);
      return;
    }
    answers.whenAll(() => {
      let attempt: Attempt | Promise<Attempt>;
      try {
        attempt = this.#settled(reply, failed, error, answers);
      } catch (e) {
        t.reject(e);
        return;
      }
      const collected = reply?.collected;
      if (attempt instanceof Promise) {
        attempt.then((a) => {
          if (collected) a.collected = collected;
          t.resolve(a);
        }, t.reject);
        return;
      }
      if (collected) attempt.collected = collected;
      t.resolve(attempt);
    });
  }

  /**
   * What one try gave once its stages have answered: all their tickets, or the reply and the
   * stage it waits for; a promise when tickets that did admit go back first. Throws a stage's
   * failure, or the `gate` call's.
   */
  #settled(
    reply: GateReply | undefined,
    failed: boolean,
    error: unknown,
    answers: Answers,
  ): Attempt | Promise<Attempt> {
    if (!answers.refused) return { tickets: answers.tickets as Ticket[], reply, blame: -1 };
    const rest = (): Attempt => {
      if (answers.failure !== undefined) throw answers.failure;
      if (failed) throw error;
      if (reply && reply.status === 1 && answers.notRun) {
        throw new Error(
          `gate "${this.#host.name}": the gate script admitted a call without running every step`,
        );
      }
      if (reply && reply.status === 1) {
        // Redis admitted them all but a stage refused here (its own callers wait ahead in this
        // process): ask again shortly.
        const again = { ...reply, status: 0, waitMs: Math.min(5, this.#host.pollMs) };
        return { tickets: undefined, reply: again, blame: -1 };
      }
      return reply ? this.#refused(reply, answers.stepOf) : { tickets: undefined, reply, blame: -1 };
    };
    // Not all admitted: give back what did (a stage that refused on its own, before Redis).
    const admitted = answers.admitted();
    if (admitted.length > 0) return this.#host.together(() => settleAll(admitted, undefined)).then(rest);
    return rest();
  }

  /** A refused try, as its reply says (`FusedWaits.refused`): the stage it waits for, and more. */
  #refused(reply: GateReply, stepOf: readonly number[]): Attempt {
    return { tickets: undefined, reply, ...this.#host.waits.refused(reply, stepOf) };
  }
}
