import { RESOLVED } from "./base/run.js";
import type { InvalidOptionsError } from "./errors.js";
import { HeldTicket } from "./ticket.js";
import type { Outcome, StageKind, Ticket } from "./types.js";

/** What a gate ticket needs of its gate. */
export interface TicketGate {
  readonly name: string;
  /**
   * A ticket of the gate is being released (with `outcome`) or refunded: count it out of the
   * calls in flight and give back its stages' tickets, unless a drain released them already.
   */
  giveBack(ticket: GateTicket, outcome: Outcome | undefined): Promise<void>;
  /** Aborts when the gate closes. */
  readonly closedSignal: AbortSignal;
  /** Run `fn`, which releases, refunds or settles the stages' tickets, as one backend call. */
  together(fn: () => Promise<void>): Promise<void>;
  /**
   * The error for a record of `settle` that names something other than a stage of the gate (the
   * field `actual.<name>`, as `costs` is refused), or undefined when every name is a stage's.
   */
  settleNamesError(value: Readonly<Record<string, number>>): InvalidOptionsError | undefined;
}

/** The tickets a gate holds for one call, released together in reverse order. */
export class GateTicket extends HeldTicket {
  #signal: AbortSignal | undefined;

  constructor(
    readonly gate: TicketGate,
    cost: number,
    readonly held: Ticket[],
    /** When the gate admitted the call, on the gate's clock. */
    readonly admittedAt: number,
  ) {
    super(cost);
  }

  get stage(): string {
    return this.gate.name;
  }

  protected get ownerKind(): StageKind {
    return "gate";
  }

  get signal(): AbortSignal {
    if (!this.#signal) {
      const signals = this.held.map((t) => t.signal);
      signals.push(this.gate.closedSignal);
      this.#signal = signals.length === 1 ? signals[0]! : AbortSignal.any(signals);
    }
    return this.#signal;
  }

  protected giveBack(outcome: Outcome | undefined): Promise<void> {
    return this.gate.giveBack(this, outcome);
  }

  /**
   * Settle every stage ticket with the checked value: each stage that prices by cost (a token
   * bucket) re-prices at its number, and every other stage ignores it. The gate ticket's own
   * `cost` never changes.
   */
  protected override async settleWith(value: number | Readonly<Record<string, number>>): Promise<void> {
    if (typeof value !== "number") {
      const error = this.gate.settleNamesError(value);
      if (error) throw error;
    }
    await this.gate.together(() => Promise.all(this.held.map((t) => t.settle(value))).then(noop));
  }
}

const noop = () => {};

/** Release (or, with no outcome, refund) tickets last to first; resolves when all are done. */
export function settleAll(tickets: readonly Ticket[], outcome: Outcome | undefined): Promise<void> {
  if (tickets.length === 1) return outcome ? tickets[0]!.release(outcome) : tickets[0]!.refund();
  // In memory every release is done at once: no promise to gather.
  let pending: Promise<void>[] | undefined;
  for (let i = tickets.length - 1; i >= 0; i--) {
    const t = tickets[i]!;
    const p = outcome ? t.release(outcome) : t.refund();
    if (p === RESOLVED) continue;
    if (pending) pending.push(p);
    else pending = [p];
  }
  return pending ? Promise.all(pending).then(noop) : RESOLVED;
}

/**
 * `settleAll` told to `resolve` (once all are done) or `reject` (with the first failure) rather
 * than by a promise, with none made per ticket: each release is a step of the backend call being
 * made (a fused Redis gate's). Every ticket floodgate hands out is a `HeldTicket`.
 */
export function settleSteps(
  tickets: readonly Ticket[],
  outcome: Outcome | undefined,
  resolve: () => void,
  reject: (error: unknown) => void,
): void {
  let left = tickets.length + 1;
  let failed = false;
  const done = (error?: unknown) => {
    if (error !== undefined && !failed) {
      failed = true;
      reject(error);
    }
    if (--left === 0 && !failed) resolve();
  };
  for (let i = tickets.length - 1; i >= 0; i--) (tickets[i] as HeldTicket).releaseStep(outcome, done);
  done();
}
