import { settleValue } from "./admit.js";
import { RESOLVED } from "./base/run.js";
import { InvalidOptionsError } from "./errors.js";
import type { Outcome, StageKind, Ticket } from "./types.js";
import { got } from "./validate.js";

/** The error for an outcome that is not one of the three, or undefined. */
export function outcomeError(
  kind: StageKind,
  name: string,
  outcome: unknown,
): InvalidOptionsError | undefined {
  if (outcome === "success" || outcome === "dropped" || outcome === "ignored") return undefined;
  return new InvalidOptionsError(
    name,
    "outcome",
    `${kind} "${name}": outcome must be "success", "dropped" or "ignored", ${got(outcome)}`,
  );
}

/**
 * Every ticket floodgate hands out: a stage's, a gate's, and the one a Redis stage lets a call
 * through with while Redis is down (`fail-open`). The contract is written once here (outcomes
 * checked, release once, refund, settle checked, `close` and `await using`); what a ticket
 * gives back is its owner's business, in `giveBack` and `settleWith`.
 */
export abstract class HeldTicket implements Ticket {
  declare released: boolean;
  declare recorded: Outcome | undefined;
  /** What the call was admitted at; a token bucket's ticket is re-priced by `settle`. */
  declare cost: number;

  // Fields are set here, not declared with initializers: defined fields ([[Define]]) on every
  // ticket, overridden in subclasses, cost more than the rest of an admission together.
  constructor(cost: number) {
    this.cost = cost;
    this.released = false;
    this.recorded = undefined;
  }

  /** The name of the stage or gate that granted the ticket. */
  abstract get stage(): string;

  /** The kind of that stage, for error messages. */
  protected abstract get ownerKind(): StageKind;

  abstract get signal(): AbortSignal;

  /**
   * Give back what the ticket holds: `outcome` on release, `undefined` on refund. Called once;
   * returns `RESOLVED` when nothing is left to wait for.
   */
  protected abstract giveBack(outcome: Outcome | undefined): Promise<void>;

  /** Re-price at `value` (checked); tickets that price nothing by cost ignore it. */
  protected settleWith(_value: number | Readonly<Record<string, number>>): Promise<void> {
    return RESOLVED;
  }

  record(outcome: Outcome): void {
    const invalid = outcomeError(this.ownerKind, this.stage, outcome);
    if (invalid) throw invalid;
    this.recorded = outcome;
  }

  release(outcome?: Outcome): Promise<void> {
    if (outcome !== undefined) {
      const invalid = outcomeError(this.ownerKind, this.stage, outcome);
      if (invalid) return Promise.reject(invalid);
    }
    if (this.released) return RESOLVED;
    this.released = true;
    return this.giveBack(outcome ?? this.recorded ?? "ignored");
  }

  refund(): Promise<void> {
    if (this.released) return RESOLVED;
    this.released = true;
    return this.giveBack(undefined);
  }

  /**
   * `release(outcome)`, or with no outcome `refund()`, for a fused Redis gate's release, told to
   * `done` (with an error when it failed) rather than by a promise: once what the ticket holds is
   * given back, which a Redis stage gathers as a step of the gate's call. @internal
   */
  releaseStep(outcome: Outcome | undefined, done: (error?: unknown) => void): void {
    if (this.released) {
      done();
      return;
    }
    this.released = true;
    this.giveBackStep(outcome, done);
  }

  /** `giveBack`, told to `done`; by default its promise tells it. */
  protected giveBackStep(outcome: Outcome | undefined, done: (error?: unknown) => void): void {
    const given = this.giveBack(outcome);
    if (given === RESOLVED) done();
    else given.then(() => done(), done);
  }

  settle(actual: number | Readonly<Record<string, number>>): Promise<void> {
    let value: number | Readonly<Record<string, number>>;
    try {
      value = settleValue(this.ownerKind, this.stage, actual);
    } catch (error) {
      return Promise.reject(error);
    }
    return this.settleWith(value);
  }

  close(): Promise<void> {
    return this.release();
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.release();
  }
}
