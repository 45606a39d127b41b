/**
 * How a Gate hands its stages to a backend that can decide them all in one step (memory stages
 * on one clock: at one instant with no promise in between; a Redis backend: one script call per
 * admission and per release). Stages that can be fused carry their `FusionHost` under `FUSE`; a
 * Gate whose call-holding stages all carry the same one asks it for a `FusedAdmission`.
 */
import type { Clock } from "./clock.js";
import { AdmitTimeoutError, InvalidOptionsError } from "./errors.js";
import type { AdmitOptions, Outcome, Stage, Ticket, TryAdmitOptions } from "./types.js";
import { messageOf } from "./validate.js";

/** The property under which a stage carries the host that can fuse it with others. */
export const FUSE: unique symbol = Symbol("floodgate.fuse");

/** Mark `stage` as one a Gate may fuse with the other stages of `host`. */
export function fusable(stage: object, host: FusionHost | undefined): void {
  if (host !== undefined) Object.defineProperty(stage, FUSE, { value: host });
}

/** A backend that can decide several of its stages at once. */
export interface FusionHost {
  /** A fused admission for `stages` of the gate named `gate`. */
  fuse(gate: string, stages: readonly Stage[]): FusedAdmission;
}

/** What a fused gate's admission needs of the gate. */
export interface FusedCall {
  /** Each stage's options for this call, as the Gate hands them (cost, key, host, class). */
  optionsFor(stage: Stage): TryAdmitOptions;
  /** The caller's signal, when it gave one. */
  signal: AbortSignal | undefined;
  /** When the caller stops waiting, on the gate's clock (Infinity: never). */
  deadline: number;
  /** The caller's `timeoutMs`, for the error when it runs out. */
  timeoutMs: number | undefined;
  /** The gate's clock, which `deadline` is on. */
  clock: Clock;
  /** The call's options as the gate was given them (checked): a memory stage reads them as they are. */
  o: AdmitOptions;
}

/** Admission and release of a gate's stages, all at once. */
export interface FusedAdmission {
  /**
   * Every stage's ticket, in order, admitted together; or, with `wait` false, undefined when
   * they do not all admit now. Nothing is held while the call waits.
   */
  admit(call: FusedCall, wait: boolean): Promise<Ticket[] | undefined>;
  /**
   * Every stage's ticket when they all admit a call with options `o` (the gate's, checked) at
   * this instant and nobody waits ahead, with no promise in between; else undefined (then
   * `admit` decides, and says why). Memory gates have it.
   */
  admitNow?(o: AdmitOptions): Ticket[] | undefined;
  /** Run `fn`, which releases, refunds or settles tickets of the stages, as one backend call. */
  together(fn: () => Promise<void>): Promise<void>;
  /**
   * Release (with `outcome`) or refund `tickets` of the stages, last to first, as one backend
   * call: `together` of `settleAll`, with no promise per ticket. Redis gates have it.
   */
  settle?(tickets: readonly Ticket[], outcome: Outcome | undefined): Promise<void>;
  /** The gate closed: every waiting call rejects with `reason`, and so does any later wait. */
  close(reason: unknown): void;
}

/**
 * What a fused gate's call that could wait no longer rejects with: naming the stage it waited
 * for last (`waitedFor`), when it waited for one, so that the binding limit shows in the error.
 * With `retryAfterMs` (refused at once: a rate could not admit it before its deadline, as a lone
 * token bucket refuses), the error carries it and says which stage.
 */
export function gateTimeout(
  gate: string,
  call: FusedCall,
  waitedFor: Stage | undefined,
  retryAfterMs?: number,
): AdmitTimeoutError {
  const stage = waitedFor === undefined ? "" : `${waitedFor.kind} "${waitedFor.name}"`;
  const at =
    retryAfterMs !== undefined
      ? `; ${stage || "its rates"} could admit it in ${retryAfterMs} ms at the soonest`
      : stage && `; it waited for ${stage}`;
  return new AdmitTimeoutError(
    gate,
    `gate "${gate}": not admitted within timeoutMs (${call.timeoutMs})${at}`,
    {
      retryAfterMs,
    },
  );
}

/** The error for a caller's signal that cannot be listened to. */
export function badSignal(gate: string, error: unknown): InvalidOptionsError {
  return new InvalidOptionsError(
    gate,
    "signal",
    `gate "${gate}": signal must be an AbortSignal (addEventListener threw: ${messageOf(error)})`,
  );
}

/** The host every stage in `stages` carries, or undefined when they do not all carry the same one. */
export function sharedHost(stages: readonly Stage[]): FusionHost | undefined {
  let host: FusionHost | undefined;
  for (const s of stages) {
    const h = (s as { [FUSE]?: FusionHost })[FUSE];
    if (h === undefined || (host !== undefined && h !== host)) return undefined;
    host = h;
  }
  return host;
}
