/**
 * The replies of a fused gate's `gate` script call (lua/gate.lua) read: each call's reply, and each
 * of its steps settled with its own, as its stage's script would have answered it alone (a step
 * the script did not run rejected with NOT_RUN); and what a call run late gives back.
 */

import { endTurn, startTurn } from "../base/flow.js";
import type { Clock } from "../clock.js";
import { type GateReply, NOT_RUN, type Step } from "./gate-call.js";

const LINES = [undefined, "permits", "lane"] as const;

/** The `woken` of a reply that woke no one (lua/gate.lua sends 0). */
const NO_ONE: readonly string[] = [];

/**
 * The reply of a `gate` call to one call: {status, waitMs, inLine, woken, replies, held, now,
 * and, waiting in the permit line, its firsts' rate waits (their ms in all, the latest's key),
 * and, taken into that line with its lane since its previous try, "<when>|<ms then>|<key>", and,
 * right behind the first of its line, ms until that first's place ends}. A field the reply has
 * not, before one it has, is null.
 */
type GateCallReply = [
  number,
  number,
  number,
  string[],
  unknown[],
  unknown,
  number?,
  (number | null)?,
  (string | null)?,
  (string | null)?,
  number?,
];

/**
 * The replies of a `gate` script call to the calls of `stepsOf` (sent at `sentAt`, local ms): each
 * step settled with its own reply (`link`'s stages reading its clock once for them all), and one
 * reply per call. `link` notes the server's time the replies say.
 */
export function readGateReplies(
  replies: (GateCallReply | 1 | unknown[])[],
  stepsOf: readonly (readonly Step[])[],
  sentAt: number,
  link: { readonly clock: Clock; sawServerTime(at: number, sentAt: number): void },
): GateReply[] {
  // Calls admitted in one pass answer 1; their steps' replies follow the last call's reply.
  const flat = replies.length > stepsOf.length ? (replies[stepsOf.length] as unknown[]) : undefined;
  let at = 0;
  if (flat) link.sawServerTime(Number(flat[flat.length - 1]), sentAt);
  // (The stages the replies settle read the clock once for them all.)
  const turnStarted = startTurn(link.clock);
  try {
    return stepsOf.map((steps, c): GateReply => {
      const reply = replies[c]!;
      if (reply === 1) {
        const answers = new Array<unknown>(steps.length);
        at = admittedAtOnce(steps, flat!, at, answers);
        settleSteps(steps, answers);
        return { status: 1, waitMs: -1, inLine: undefined, woken: NO_ONE, replies: answers };
      }
      return gateReply(reply as GateCallReply, steps, sentAt, link);
    });
  } finally {
    endTurn(turnStarted);
  }
}

/** A call's reply to a `gate` call, for any call but one admitted in one pass (see `readGateReplies`). */
function gateReply(
  reply: GateCallReply,
  steps: readonly Step[],
  sentAt: number,
  link: { sawServerTime(at: number, sentAt: number): void },
): GateReply {
  if (reply[6] !== undefined) link.sawServerTime(Number(reply[6]), sentAt);
  const answers = reply[4];
  const status = Number(reply[0]);
  const out: GateReply = {
    status,
    waitMs: Number(reply[1]),
    inLine: LINES[Number(reply[2])],
    woken: Array.isArray(reply[3]) ? reply[3] : NO_ONE,
    replies: answers,
  };
  if (status === 2) out.collected = grantReplies(String(reply[5]));
  if (reply[7] !== undefined && reply[7] !== null) {
    out.lineRateMs = Number(reply[7]);
    out.lineRateKey = String(reply[8] ?? "");
  }
  if (typeof reply[9] === "string") {
    const [at, rate, ...key] = reply[9].split("|");
    const agoMs = Number(reply[6]) - Number(at);
    if (agoMs >= 0) out.moved = { agoMs, lineRateMs: Number(rate) || 0, key: key.join("|") };
  }
  if (reply[10] !== undefined) out.aheadMs = Number(reply[10]);
  if (Number(reply[5]) === 1) {
    let settled: "no" | "granted" | "not run" = "no";
    out.hold = (granted) => {
      if (settled !== "no") return;
      settled = granted ? "granted" : "not run";
      settleSteps(steps, granted ?? []);
    };
    out.collectedLate = (granted) => {
      if (settled === "not run") tellLate(steps, granted);
    };
  } else settleSteps(steps, answers);
  return out;
}

/**
 * A `gate` call of `stepsOf` ran after it was failed, and answered `replies`: each step that says
 * so gives back, told its own reply (read as `readGateReplies` reads it; undefined where there is
 * none).
 * @internal Exported for its test.
 */
export function ranLate(stepsOf: readonly (readonly Step[])[], replies: unknown): void {
  const list = Array.isArray(replies) ? replies : [];
  const flat = list.length > stepsOf.length ? list[stepsOf.length] : undefined;
  let at = 0;
  for (let c = 0; c < stepsOf.length; c++) {
    const steps = stepsOf[c]!;
    const reply = list[c];
    let answers: readonly unknown[] | undefined;
    if (reply === 1 && Array.isArray(flat)) {
      const once = new Array<unknown>(steps.length);
      at = admittedAtOnce(steps, flat, at, once);
      answers = once;
    } else if (Array.isArray(reply) && Array.isArray(reply[4])) answers = reply[4];
    tellLate(steps, answers);
  }
}

/** Tell each of `steps` that says so that its call ran late, with its reply in `answers` (if any). */
function tellLate(steps: readonly Step[], answers: readonly unknown[] | undefined): void {
  for (let s = 0; s < steps.length; s++) steps[s]!.late?.(steps[s]!.keys, steps[s]!.args, answers?.[s]);
}

/**
 * The replies of `steps`, admitted in one pass, from `flat` at `at` (lua/gate.lua, fast()): each
 * as its script answers an admission at once. Returns where the next call's replies begin.
 */
function admittedAtOnce(
  steps: readonly Step[],
  flat: readonly unknown[],
  at: number,
  answers: unknown[],
): number {
  const now = flat[flat.length - 1];
  for (let i = 0; i < steps.length; i++) {
    const script = steps[i]!.script;
    if (script === "semaphore-acquire") {
      answers[i] = [1, flat[at], flat[at + 1], flat[at + 2], flat[at + 3], 0, 0, now];
      at += 4;
    } else if (script === "interval-gate-take") {
      answers[i] = [1, flat[at], flat[at + 1]];
      at += 2;
    } else answers[i] = [1, 0];
  }
  return at;
}

/** Settle gathered steps with their replies: a step with none (or false, null) did not run. */
function settleSteps(steps: readonly Step[], answers: readonly unknown[]): void {
  for (let i = 0; i < steps.length; i++) {
    const r = answers[i];
    if (r === false || r === null || r === undefined) steps[i]!.reject(NOT_RUN);
    else steps[i]!.resolve(r);
  }
}

/** The steps' replies of a grant (lua/gate.lua sends them as JSON); [] when unreadable. */
export function grantReplies(json: string): unknown[] {
  try {
    const replies: unknown = JSON.parse(json);
    return Array.isArray(replies) ? replies : [];
  } catch {
    return [];
  }
}
