/**
 * Permits freed at a fused gate's permit stages outside the gate: by a stage's own script run
 * alone or by another gate, in any process. A release through the gate decides the gate's permit
 * line itself; these do not, so while a caller of this process waits in that line, each sends
 * one `grant` call that decides the line's first there and then, as a release through the gate
 * would. Without it, the line would wait for its next poll.
 */
import type { Stage } from "../types.js";
import { PERMIT_KINDS } from "./fused-waits.js";
import type { GateHead } from "./gate-call.js";
import type { RedisLink } from "./link.js";
import type { RedisPermitStage } from "./permit-stage.js";

/** What a fused gate tells its `FreedPermits`. */
export interface FreedSettings {
  stages: readonly Stage[];
  link: RedisLink;
  /** The gate's wake channel as Redis names it: how lua/gate.lua names a gate that freed permits. */
  onWire: string;
  /** This gate in this process (`<onWire>|<token>`), as another gate sharing a stage is told of it. */
  from: string;
  /** The head of the gate's releases: permits freed by them were decided by the gate itself. */
  releases: GateHead;
  /** Send one `grant` call for the gate's permit line; settles once it is back. */
  grant: () => Promise<void>;
  /** Whether the gate has closed. */
  closed: () => boolean;
}

/** A permit stage as this needs it: its `wake:freed` channel, and who it told here. */
type PermitStage = Partial<Pick<RedisPermitStage, "freedChannel" | "toldHere" | "onFreed">>;

/** One fused gate's hearing of permits freed outside it, for its callers in this process. */
export class FreedPermits {
  readonly #s: FreedSettings;
  /** Members of this process waiting in the gate's permit line. */
  readonly #forPermits = new Set<string>();
  /** Members of this process first in the gate's permit line (see `#hear`). */
  readonly #firsts = new Set<string>();
  /** Whether this process listens for permits freed at the gate's permit stages by any process. */
  #hearing = false;
  /** A `grant` call is out; another is due once it is back. */
  #granting = false;
  #grantAgain = false;
  /** Stop being told of permits freed by another gate of this process, one per permit stage. */
  readonly #unhook: (() => void)[] = [];

  constructor(settings: FreedSettings) {
    this.#s = settings;
    // Permits another gate of this process frees here are told to it. (In any process, a stage's
    // script run alone, or another gate, says so on the stage's `wake:freed` channel: `#hear`.)
    for (const stage of settings.stages) {
      const permits = stage as PermitStage;
      if (PERMIT_KINDS.has(stage.kind) && permits.onFreed) {
        this.#unhook.push(permits.onFreed((by) => this.#freedElsewhere(by), settings.from));
      }
    }
  }

  /** Where `member`'s latest try left it: in the gate's permit line or not, first there or not. */
  placed(member: string, inPermitLine: boolean, first: boolean): void {
    if (inPermitLine) this.#forPermits.add(member);
    else this.#forPermits.delete(member);
    if (first) {
      this.#firsts.add(member);
      this.#hear();
    } else this.#firsts.delete(member);
  }

  /** `member` waits no more. */
  gone(member: string): void {
    this.#forPermits.delete(member);
    this.#firsts.delete(member);
  }

  /** The gate closed: hear no more from the gates of this process. */
  close(): void {
    for (const stop of this.#unhook.splice(0)) stop();
  }

  /**
   * Listen, from the first time a caller of this process is first in the permit line, for permits
   * freed at the gate's permit stages in any process, by their own scripts or by another gate
   * (lua/prelude.lua, floodgate_freed): while a caller of this process is first, each such message
   * sends one `grant` call, unless it was dealt with already (`#toldAlready`). (Without a
   * subscription, the first finds them at its next poll.)
   */
  #hear(): void {
    if (this.#hearing) return;
    this.#hearing = true;
    for (const stage of this.#s.stages) {
      const permits = stage as PermitStage;
      const channel = permits.freedChannel;
      if (!PERMIT_KINDS.has(stage.kind) || channel === undefined) continue;
      this.#s.link
        .listen(channel, (by) => {
          if (this.#firsts.size === 0 || (by !== "" && this.#toldAlready(by, permits))) return;
          this.#freedElsewhere(undefined);
        })
        .catch(() => {
          this.#hearing = false;
        });
    }
  }

  /**
   * Whether permits a gate freed (`by`: "<its wake channel>|<token>", lua/gate.lua) were dealt
   * with already: by this gate's own release, in any process, which decided its line itself; or
   * by another gate of this process that shares the stage, which told this one (`onFreed`).
   */
  #toldAlready(by: string, stage: PermitStage): boolean {
    const bar = by.lastIndexOf("|");
    return by.slice(0, bar) === this.#s.onWire || stage.toldHere?.(by) === true;
  }

  /**
   * Permits freed at one of the gate's permit stages outside the gate: in this process by a
   * release through the gate of `by`, or (undefined) as the stage's `wake:freed` channel says, by
   * its script run alone or by another gate, in any process. A release through this gate decided
   * its line already. Otherwise, while a caller of this process waits in the permit line, one
   * `grant` call at a time.
   */
  #freedElsewhere(by: GateHead | undefined): void {
    if (by === this.#s.releases || this.#forPermits.size === 0 || this.#s.closed()) return;
    if (this.#granting) {
      this.#grantAgain = true;
      return;
    }
    this.#granting = true;
    const done = () => {
      this.#granting = false;
      if (!this.#grantAgain) return;
      this.#grantAgain = false;
      this.#freedElsewhere(undefined);
    };
    this.#s.grant().then(done, done);
  }
}
