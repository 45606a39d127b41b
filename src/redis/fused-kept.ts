/**
 * A fused gate's tries whose steps Redis keeps while their calls wait in the gate's permit line
 * (lua/gate.lua, grants): a release that admits one sends its grant to the caller's process, on
 * the gate's wake channel or in a reply, and the grant settles the kept steps here. A grant can
 * come before the reply that said its try was kept (the two travel on different connections): it
 * is held until then.
 */
import type { Ticket } from "../types.js";
import type { LineWait, Refusal } from "./fused-waits.js";
import type { GateReply } from "./gate-call.js";
import { grantReplies } from "./gate-reply.js";

/**
 * What one try of every stage gave: all tickets, or the reply and what it says of the wait
 * (`Refusal`: the stage the call waits for, -1 when admitted or none; the rest when refused).
 */
export interface Attempt extends Pick<Refusal, "blame">, Partial<Omit<Refusal, "blame">> {
  tickets: Ticket[] | undefined;
  reply: GateReply | undefined;
  /** The call waits in the permit line with this try's steps kept, for a release to admit. */
  held?: Held;
  /** The replies to the kept steps of the call's earlier try, which a release admitted. */
  collected?: unknown[];
}

/** A try whose steps Redis keeps while its call waits in the permit line. */
export interface Held {
  try: number;
  /** Settle the try's steps: with a grant's replies, or with none (they did not run). Once. */
  settle: (replies: unknown[] | undefined) => void;
  /** What the try gives once settled. */
  result: Promise<Attempt>;
  /** A grant settled it. */
  granted: boolean;
  /** How many steps the try has: a grant's replies are one per step, then the line's rate waits. */
  steps: number;
  /** A later try run late collected a grant of these steps after `settle` settled them as not run. */
  collectedLate: (replies: unknown[]) => void;
  /** The line's rate waits when the grant was made (`lineRateMs`, `lineRateKey`), if it said. */
  rate?: LineWait;
}

/** The kept tries of one fused gate's callers in this process, by member. */
export class KeptTries {
  readonly #holds = new Map<string, Held>();
  /** Grants that came before the reply that said their try was kept, by member. */
  readonly #early = new Map<string, { try: number; replies: unknown[] }>();

  /** `member` waits with `held` kept; a grant of it that came first settles it now. */
  keep(member: string, held: Held): void {
    this.#holds.set(member, held);
    const early = this.#early.get(member);
    this.#early.delete(member);
    if (early?.try === held.try) grant(held, early.replies);
  }

  /** Forget `member`'s kept try; returns undefined, for its variable. */
  unhold(member: string): undefined {
    this.#holds.delete(member);
    return undefined;
  }

  /** `member`'s call is done with its admission: nothing of it is kept here. */
  end(member: string): void {
    this.#holds.delete(member);
    this.#early.delete(member);
  }

  /**
   * A grant ("g|<member>|<try>|<replies>": a release admitted the member's kept steps): it
   * settles the kept try it names, which returns the member to wake; a grant of a call whose try
   * is out (`trying`) and not yet kept here is held for it.
   */
  granted(message: string, trying: (member: string) => boolean): string | undefined {
    const a = message.indexOf("|", 2);
    const b = message.indexOf("|", a + 1);
    if (a < 0 || b < 0) return undefined;
    const member = message.slice(2, a);
    const tryNo = Number(message.slice(a + 1, b));
    const held = this.#holds.get(member);
    if (held?.try === tryNo) {
      grant(held, grantReplies(message.slice(b + 1)));
      return member;
    }
    if (held === undefined && trying(member)) {
      this.#early.set(member, { try: tryNo, replies: grantReplies(message.slice(b + 1)) });
    }
    return undefined;
  }
}

/** Settle `held` with a grant's `replies`, once: one per step, then the line's rate waits. */
function grant(held: Held, replies: unknown[]): void {
  if (held.granted) return;
  held.granted = true;
  const rate = replies[held.steps];
  if (Array.isArray(rate) && replies.length === held.steps + 1) {
    held.rate = { lineRateMs: Number(rate[0]), lineRateKey: String(rate[1] ?? "") };
  }
  held.settle(replies);
}
