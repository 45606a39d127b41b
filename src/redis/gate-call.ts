/**
 * A fused gate's `gate` script call (lua/gate.lua) as this process sends it: each call with its
 * steps, the stage script calls the link gathered for it, encoded so that what a call or a step
 * repeats of one before it goes once. A turn's releases of one stage's leases are made one step
 * in turn-releases.ts; the replies are read in gate-reply.ts.
 */

import type { GateStep } from "./scripts.js";

/** A stage's script call gathered by `RedisLink.gather`, sent as one step of a `gate` call. */
export interface Step {
  script: GateStep;
  keys: readonly string[];
  args: readonly (string | number)[];
  resolve: (reply: unknown) => void;
  reject: (error: unknown) => void;
  /** Told, with the step's keys, arguments and reply, when its call ran after it was failed (see `RedisLink.step`). */
  late?: Late | undefined;
}

/**
 * What a script call gives back when it ran after it was failed for not answering in time (see
 * `RedisLink.run`): told the call's keys and arguments and its reply (a step's own, in a `gate`
 * call; undefined when that call's reply holds none for the step), so one function serves every
 * call of a stage. Told too, with no reply, when the client fails such a call by itself later: it
 * may have run, and gives back what can be given back without knowing what it took.
 */
export type Late = (keys: readonly string[], args: readonly (string | number)[], reply: unknown) => void;

/** The reply of a `gate` call to one of its calls (see lua/gate.lua). */
export interface GateReply {
  /** 1: admitted (or ran); 0: refused, nothing held. */
  status: number;
  /** Refused by metering stages only, first in its lane: ms until the slowest could admit; else -1. */
  waitMs: number;
  /** Where the caller waits: in the gate's permit line, in its lane, or in neither. */
  inLine: "permits" | "lane" | undefined;
  /** The waiters told to ask again (in this process or another). */
  woken: readonly string[];
  /** The script's replies to the call's steps, in order (null for a step not run). */
  replies: unknown[];
  /**
   * Status 2: the replies to the steps of the call's earlier try that were kept, which a release
   * admitted (this try's steps did not run).
   */
  collected?: unknown[];
  /**
   * The call waits in the permit line with its steps kept (mode "hold"): they are left unsettled
   * until this settles them, with the replies of a grant, or with none (they did not run).
   */
  hold?: (replies: unknown[] | undefined) => void;
  /**
   * With `hold`: a later try of the call, run after it was failed, collected a grant made to the
   * kept steps (its reply's status 2), though `hold` had settled them as not run (the caller gave
   * up). Each kept step's late handler is told its reply in the grant, and gives back what the
   * grant took for it; nothing is done when `hold` settled the steps with a grant.
   */
  collectedLate?: (replies: unknown[]) => void;
  /**
   * A call waiting in the permit line: how long, in all, the line's firsts have kept their place
   * waiting for a rate (ms, growing; those behind them wait for it too), and the first key (as
   * Redis has it) of the step the latest waited for, a token bucket's or interval gate's.
   */
  lineRateMs?: number;
  lineRateKey?: string;
  /**
   * The permit line took the call with its lane since its previous try (its lane's first was
   * refused permits): how long ago (ms, on the server's clock, at this decision), `lineRateMs` as
   * it was then, and the first key (as Redis has it) of the permit stage that refused.
   */
  moved?: { agoMs: number; lineRateMs: number; key: string };
  /**
   * Right behind the first of its line (the permit line or its lane), which its steps did not run
   * for: ms until that first's place ends, should it not ask again (its process frozen or dead).
   */
  aheadMs?: number;
}

/** What every call of one `gate` script call shares: see lua/gate.lua. */
export interface GateHead {
  /** The gate's keys: its permit line, the line's expiries, its sequence, kept steps, their expiries. */
  keys: readonly string[];
  op: "all" | "each" | "leave" | "grant";
  waiterTtlMs: number;
  channel: string;
}

/** One call of a `gate` script call. */
export interface GateCall {
  /** The caller's place in line ("" for none). */
  member: string;
  mode: "hold" | "wait" | "try";
  /** The try's number (for the grant of its kept steps), or "". */
  try: number | "";
  /** The number of the caller's earlier try whose steps were kept, or "". */
  held: number | "";
  /** The call's lane and the lane's expiries. */
  lane: readonly string[];
  /** Makes the call's stage script calls, gathered as its steps; given the number gathered so far. */
  fn: (steps: () => number) => void;
}

/** What a step the gate script did not run is rejected with (someone is ahead in the gate's line). */
export const NOT_RUN = new Error("not run: another caller is ahead in the gate's line");

/**
 * The keys and arguments of the `gate` script call for `calls` under `head`, each call's steps
 * (the stage script calls `RedisLink.gather` collected for it) in `stepsOf`; `now` is its ARGV[1].
 */
export function encodeGateCall(
  head: GateHead,
  calls: readonly GateCall[],
  stepsOf: readonly (readonly Step[])[],
  now: string,
): { keys: string[]; args: (string | number)[] } {
  const keys = [...head.keys];
  const args: (string | number)[] = [now, head.op, head.waiterTtlMs, head.channel, calls.length];
  // Each script's steps sent so far, by their keys (a stage's own list, or a bucket's or host's
  // one key): a step that repeats one is sent as the arguments that differ (lua/gate.lua).
  const earlier = new Map<string, Map<unknown, number>>();
  const all: Step[] = [];
  // The fields of the call before this one when it went as a repeat ("*"), else undefined.
  let before: string[] | undefined;
  for (let c = 0; c < calls.length; c++) {
    const call = calls[c]!;
    const steps = stepsOf[c]!;
    // A call's fields go as one argument, a JSON list of strings: a client pays for each
    // argument of a command far more than for its length (bench/RESULTS.md).
    const fields: string[] = [call.member, call.mode, String(call.try), String(call.held)];
    // A call of the lane of the call before it, whose steps repeat that call's but for their
    // own arguments, goes as those alone.
    if (c > 0 && sameLane(call.lane, calls[c - 1]!.lane) && repeats(steps, stepsOf[c - 1]!)) {
      fields.push("*");
      for (const step of steps) for (const i of OWN[step.script]!) fields.push(String(step.args[i]!));
      // One that differs from that repeat in its name alone goes as the name (lua/gate.lua).
      args.push(before !== undefined && renames(fields, before) ? call.member : callJson(fields));
      before = fields;
      continue;
    }
    before = undefined;
    keys.push(call.lane[0]!, call.lane[1]!);
    fields.push(String(steps.length));
    for (const step of steps) {
      let sameScript = earlier.get(step.script);
      if (sameScript === undefined) {
        sameScript = new Map();
        earlier.set(step.script, sameScript);
      }
      const id = step.keys.length === 1 ? step.keys[0] : step.keys;
      const at = sameScript.get(id);
      const base = at === undefined ? undefined : all[at - 1];
      // A release that differs from the earlier one only in its own arguments goes as those
      // (it is not numbered: a later step repeats the earlier one).
      if (base !== undefined && REPEATING.has(step.script) && ownOnly(step, base)) {
        fields.push("~", String(at));
        for (const i of OWN[step.script]!) fields.push(String(step.args[i]!));
        continue;
      }
      all.push(step);
      sameScript.set(id, all.length);
      if (base !== undefined && base.args.length === step.args.length) {
        const n = fields.length + 2;
        fields.push("=", String(at), "");
        for (let i = 1; i < step.args.length; i++) {
          const x = step.args[i]!;
          const y = base.args[i]!;
          // (Alike when equal, or when they differ as number and string only.)
          if (x !== y && (typeof x === typeof y || String(x) !== String(y)))
            fields.push(String(i + 1), String(x));
        }
        fields[n] = String((fields.length - n - 1) / 2);
        continue;
      }
      fields.push(step.script, String(step.keys.length), String(step.args.length));
      for (const key of step.keys) keys.push(key);
      for (let i = 1; i < step.args.length; i++) fields.push(String(step.args[i]!));
    }
    args.push(callJson(fields));
  }
  return { keys, args };
}

/**
 * A call's fields as JSON, as Redis would read them as arguments: a lone surrogate (which JSON
 * would send as an escape the script's decoder refuses) as U+FFFD, as its UTF-8 on the wire is.
 */
function callJson(fields: string[]): string {
  const json = JSON.stringify(fields);
  return json.includes("\\ud") ? JSON.stringify(fields.map(onWire)) : json;
}

/** `text` as Redis gets it (UTF-8): each lone surrogate as U+FFFD. */
export function onWire(text: string): string {
  return Buffer.from(text, "utf8").toString("utf8");
}

/**
 * The places (from 0: the script's ARGV[2] is 1) of each step's own arguments, which may differ
 * between steps sent as repeats of one another (lua/gate.lua, OWN): a permit's member, fence and
 * "again" flag; a bucket's cost, grant and longest wait; a host's spacing; a release's member and
 * what it releases (a semaphore's), or its member, outcome, epoch and slow flag (an AIMD
 * limiter's).
 */
export const OWN: Partial<Record<GateStep, readonly number[]>> = {
  "semaphore-acquire": [1, 8, 9],
  "token-bucket-take": [4, 6, 7],
  "interval-gate-take": [1],
  "semaphore-release": [1, 4],
  "aimd-release": [1, 3, 4, 8],
};

/** The scripts whose steps may go as repeats of an earlier step ("~"): the releases. */
const REPEATING: ReadonlySet<GateStep> = new Set(["semaphore-release", "aimd-release"]);

/** Whether step `a` differs from `b`, of its script, only in its own arguments (`OWN`). */
export function ownOnly(a: Step, b: Step): boolean {
  const own = OWN[a.script];
  if (own === undefined || a.args.length !== b.args.length || own[own.length - 1]! >= a.args.length)
    return false;
  for (let i = 1; i < a.args.length; i++) {
    const x = a.args[i]!;
    const y = b.args[i]!;
    if (x !== y && (typeof x === typeof y || String(x) !== String(y)) && !own.includes(i)) return false;
  }
  return true;
}

/** A name a call may go by alone (see `renames`): never a JSON list, nor a string Redis would change. */
const NAME = /^[\w.-]+$/;

/**
 * Whether a repeat's fields (`fields`) are those of the repeat before it (`before`) with its
 * name, `fields[0]`, wherever `before` had its own: it may then go as that name alone, which
 * lua/gate.lua reads back so (floodgate_call, lua/prelude.lua). A fused call's stages give
 * their leases and grants its name when they can (`BaseStage.tryStep`), so a turn's first tries
 * mostly do.
 */
function renames(fields: readonly string[], before: readonly string[]): boolean {
  const name = fields[0]!;
  const was = before[0]!;
  if (fields.length !== before.length || !NAME.test(name)) return false;
  for (let x = 1; x < fields.length; x++) {
    const y = before[x]!;
    if (fields[x] !== (y === was ? name : y)) return false;
  }
  return true;
}

/** Whether two calls' lanes (see `GateCall`) are one. */
function sameLane(a: readonly string[], b: readonly string[]): boolean {
  return a === b || (a[0] === b[0] && a[1] === b[1]);
}

/**
 * Whether `steps` repeat `before` but for their own arguments (`OWN`): the same scripts, each
 * with one, on the same keys, with the same other arguments.
 */
function repeats(steps: readonly Step[], before: readonly Step[]): boolean {
  if (steps.length === 0 || steps.length !== before.length) return false;
  for (let s = 0; s < steps.length; s++) {
    const a = steps[s]!;
    const b = before[s]!;
    if (a.script !== b.script || !ownOnly(a, b)) return false;
    if (a.keys !== b.keys) {
      if (a.keys.length !== b.keys.length) return false;
      for (let k = 0; k < a.keys.length; k++) if (a.keys[k] !== b.keys[k]) return false;
    }
  }
  return true;
}
