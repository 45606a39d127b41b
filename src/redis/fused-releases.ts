/**
 * A fused gate's releases in this process (and its refunds and settles): those of one turn go in
 * one `gate` call (lua/gate.lua, "each"), every stage gathering its own step into it.
 */
import { settleSteps } from "../gate-ticket.js";
import type { Outcome, Ticket } from "../types.js";
import { TurnQueue } from "./batch.js";
import type { GateCall, GateHead } from "./gate-call.js";
import type { RedisLink } from "./link.js";

/**
 * Releases waiting to go with this turn's others: a function that makes them (`together`), or
 * tickets to release with an outcome or refund without (`settle`).
 */
interface Give {
  fn: (() => Promise<void>) | undefined;
  tickets: readonly Ticket[];
  outcome: Outcome | undefined;
  resolve: () => void;
  reject: (error: unknown) => void;
}

const NO_TICKETS: readonly Ticket[] = [];

/** What a fused gate's releases need of their gate. */
export interface ReleasesHost {
  /** The gate's name, for its script calls. */
  name: string;
  link: RedisLink;
  /** The head of the gate's releases (lua/gate.lua: "each"). */
  releases: GateHead;
  /** A call of the gate's own, whose steps `fn` makes. */
  ownCall: (fn: GateCall["fn"]) => GateCall;
  /** The wake-ups and grants a reply carries, for this process's callers. */
  wakeAll(messages: readonly string[]): void;
}

/** One fused gate's releases in this process, a turn's in one `gate` call. */
export class FusedReleases {
  readonly #host: ReleasesHost;
  readonly #gives = new TurnQueue<Give>((gives) => this.#give(gives));

  constructor(host: ReleasesHost) {
    this.#host = host;
  }

  /**
   * Run `fn` (releases, refunds, settles of the gate's stages) with its script calls gathered
   * into one `gate` call with this turn's others.
   */
  together(fn: () => Promise<void>): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      this.#gives.add({ fn, tickets: NO_TICKETS, outcome: undefined, resolve, reject });
    });
  }

  /** Release `tickets` with `outcome` (refund them without one), with this turn's others. */
  settle(tickets: readonly Ticket[], outcome: Outcome | undefined): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      this.#gives.add({ fn: undefined, tickets, outcome, resolve, reject });
    });
  }

  /** Run the `fn` of each of `gives` with their script calls gathered into one `gate` call. */
  #give(gives: Give[]): Promise<unknown> | undefined {
    const host = this.#host;
    const call = host.ownCall(() => {
      for (const g of gives) {
        if (g.fn) g.fn().then(g.resolve, g.reject);
        else settleSteps(g.tickets, g.outcome, g.resolve, g.reject);
      }
    });
    const sent = host.link.gather(host.name, host.releases, [call]);
    sent?.then(
      (replies) => host.wakeAll(replies[0]!.woken),
      () => {},
    );
    return sent;
  }
}
