import type { Logger, Outcome, Settled, Ticket } from "../types.js";
import { resultOutcome } from "./classify.js";

export { defaultClassify } from "./classify.js";

/** The promise every release that has nothing left to wait for returns. */
export const RESOLVED: Promise<void> = Promise.resolve();

/** A ticket whose recorded outcome can be read: the ones stages and gates hand out. */
export interface RecordingTicket extends Ticket {
  readonly recorded: Outcome | undefined;
}

type Classify<T> = ((settled: Settled<T>) => Outcome) | undefined;

/** The outcome to release with: the recorded one, else `classify`'s (a throw counts as `ignored`). */
function outcomeOf<T>(
  ticket: RecordingTicket,
  ok: boolean,
  value: unknown,
  classify: Classify<T>,
  log: Logger,
) {
  const recorded = ticket.recorded;
  if (recorded !== undefined) return recorded;
  let outcome: unknown;
  try {
    // The default rule needs no `Settled` object; a classify of the caller's gets one.
    if (classify == null) return resultOutcome(ok, value);
    outcome = classify(ok ? { ok: true, value: value as T } : { ok: false, error: value });
  } catch (error) {
    log.warn({ err: error }, "classify threw; outcome ignored");
    return "ignored";
  }
  if (outcome === "success" || outcome === "dropped" || outcome === "ignored") return outcome;
  // Anything else would leave the ticket held: it is released as `ignored`.
  log.warn({ outcome: typeof outcome }, "classify returned no outcome; outcome ignored");
  return "ignored";
}

/**
 * Release `ticket` after its call, then hand back the call's result: returns the value or throws
 * the error, or, when the release has to wait (a Redis call), a promise of either.
 */
function finish<T>(
  ticket: RecordingTicket,
  ok: boolean,
  value: unknown,
  classify: Classify<T>,
  log: Logger,
): T | Promise<T> {
  const released = ticket.release(outcomeOf(ticket, ok, value, classify, log));
  if (released !== RESOLVED) {
    // (One promise for both ways the release can go.)
    const settle = (): T => {
      if (ok) return value as T;
      throw value;
    };
    return released.then(settle, (e: unknown) => {
      log.warn({ err: e }, "release failed");
      return settle();
    });
  }
  if (ok) return value as T;
  throw value;
}

/**
 * Call `fn` with an admitted `ticket`, release the ticket with the outcome (the one recorded in
 * `fn`, else `classify`'s) and settle as `fn` did. `fn` is called at once, in the caller's
 * context; a release that fails is logged, not thrown.
 */
export function callWith<T>(
  ticket: RecordingTicket,
  fn: (ticket: Ticket) => T | PromiseLike<T>,
  classify: Classify<T>,
  log: Logger,
): Promise<T> {
  let result: T | PromiseLike<T>;
  try {
    result = fn(ticket);
  } catch (error) {
    return settleNow(ticket, false, error, classify, log);
  }
  if (
    result !== null &&
    (typeof result === "object" || typeof result === "function") &&
    typeof (result as PromiseLike<T>).then === "function"
  ) {
    return Promise.resolve(result).then(
      (value) => finish(ticket, true, value, classify, log),
      (error: unknown) => finish<T>(ticket, false, error, classify, log),
    );
  }
  return settleNow(ticket, true, result, classify, log);
}

function settleNow<T>(
  ticket: RecordingTicket,
  ok: boolean,
  value: unknown,
  classify: Classify<T>,
  log: Logger,
): Promise<T> {
  try {
    return Promise.resolve(finish(ticket, ok, value, classify, log));
  } catch (error) {
    return Promise.reject(error);
  }
}
