/**
 * A turn's releases of one stage's leases, made one step of a fused gate's `gate` call (the
 * release scripts take a turn's in one run), and that step's reply, in short or in full, told
 * to each release as its own.
 */
import { OWN, ownOnly, type Step } from "./gate-call.js";
import type { GateStep } from "./scripts.js";

/**
 * For each release script that takes a turn's releases of one stage's leases in one run: how
 * many arguments one release has, and which of them must be "" (classes) or "lease" (what a
 * semaphore's release gives back) for it to join a run.
 */
const TOGETHER: Partial<Record<GateStep, { n: number; at: number; is: string }>> = {
  "semaphore-release": { n: 8, at: 4, is: "lease" },
  "aimd-release": { n: 13, at: 12, is: "" },
};

/**
 * `steps` with the releases of one stage's leases that differ only in their own arguments (`OWN`)
 * put together as one step, where the first of them was: its arguments the first's, then each
 * other's own arguments in turn, as the script takes a turn's; it answers the list of
 * their replies, each of which settles its own step. `steps` itself when none go together.
 */
export function together(steps: Step[]): Step[] {
  // (Runs by their keys, a stage's own list: the same list for each of its steps.)
  let runs: Map<readonly string[], Step[]> | undefined;
  let runOf: Map<Step, Step[]> | undefined;
  let merged = false;
  for (const step of steps) {
    const rule = TOGETHER[step.script];
    if (rule === undefined || step.args.length !== rule.n || step.args[rule.at] !== rule.is) continue;
    runs ??= new Map();
    runOf ??= new Map();
    const run = runs.get(step.keys);
    if (run === undefined) {
      const first = [step];
      runs.set(step.keys, first);
      runOf.set(step, first);
    } else if (run[0]!.script === step.script && ownOnly(step, run[0]!)) {
      run.push(step);
      runOf.set(step, run);
      merged = true;
    }
  }
  if (!merged) return steps;
  const out: Step[] = [];
  for (const step of steps) {
    const run = runOf!.get(step);
    if (run === undefined || run.length < 2) out.push(step);
    else if (step === run[0]) out.push(oneStep(run));
  }
  return out;
}

/** One step for the releases `parts` (see `together`): it settles each of them with its reply. */
function oneStep(parts: readonly Step[]): Step {
  const first = parts[0]!;
  const args = [...first.args];
  const own = OWN[first.script]!;
  for (let x = 1; x < parts.length; x++) for (const j of own) args.push(parts[x]!.args[j]!);
  return {
    script: first.script,
    keys: first.keys,
    args,
    resolve: (replies) => {
      const list = replies as unknown[];
      if (list[0] === "n") settleTurn(first.script, list, parts);
      else for (let x = 0; x < parts.length; x++) parts[x]!.resolve(list[x]);
    },
    reject: (error) => {
      for (const part of parts) part.reject(error);
    },
    late: undefined,
  };
}

/** The grants of a release reply that made none. */
const NO_GRANTS: readonly string[] = [];

/**
 * Settle `parts`, a turn's releases of one stage's leases sent as one step, with its reply in
 * short (lua/gate.lua, each()): "n", one flag a lease ("1": it was still held, "0": not), then
 * what the stage's count was once they were all given back (a semaphore's used; an AIMD
 * limiter's limit, epoch and used). Each part gets the reply its script gives one release, with
 * those figures. A reply whose flags do not match the parts rejects them all.
 */
function settleTurn(script: GateStep, reply: readonly unknown[], parts: readonly Step[]): void {
  const flags = reply[1];
  if (typeof flags !== "string" || flags.length !== parts.length) {
    const error = new Error(
      `${script}: a turn's reply has ${String(flags).length} flags for ${parts.length} leases`,
    );
    for (const part of parts) part.reject(error);
    return;
  }
  const held =
    script === "semaphore-release"
      ? [1, 0, reply[2], NO_GRANTS]
      : [1, reply[2], reply[3], reply[4], NO_GRANTS];
  const gone = held.slice();
  gone[0] = 0;
  for (let x = 0; x < parts.length; x++) parts[x]!.resolve(flags.charCodeAt(x) === 49 ? held : gone);
}
