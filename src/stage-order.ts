import type { Logger, Stage, StageKind } from "./types.js";

/** Stages that hold a call: a metering stage before one of them meters admissions, not call starts. */
const HOLDING: ReadonlySet<StageKind> = new Set(["semaphore", "aimd", "queue"]);

/**
 * Why the order of `stages` breaks what its metering stages promise, or undefined when it keeps
 * to the rule: stages that hold a call (queue, semaphore, AIMD) first, then token buckets, then
 * interval gates last. A stage after a metering stage can still make the call wait, so the
 * call would start later than its token or its host's slot allowed. Gates in the list are
 * looked into: their stages count where the gate stands.
 */
export function stageOrderWarning(stages: readonly Stage[]): string | undefined {
  let meter: Stage | undefined;
  for (const s of inOrder(stages)) {
    if (meter && (HOLDING.has(s.kind) || (meter.kind === "intervalGate" && s.kind === "tokenBucket"))) {
      return `${meter.kind} "${meter.name}" comes before ${s.kind} "${s.name}", which can still make a call wait after it: its ${meter.kind === "intervalGate" ? "spacing" : "rate"} then holds for admissions, not for the starts of calls. List stages that hold a call (queue, semaphore, aimd) first, token buckets next, interval gates last`;
    }
    if (s.kind === "tokenBucket" || s.kind === "intervalGate") {
      if (meter?.kind !== "intervalGate") meter = s;
    }
  }
  return undefined;
}

/**
 * The stages in the order a call takes them: a gate in the list is taken stage by stage, where
 * it stands.
 */
function* inOrder(stages: readonly Stage[], depth = 0): Generator<Stage> {
  for (const s of stages) {
    const nested = s.kind === "gate" ? (s as { stages?: unknown }).stages : undefined;
    // A gate holds its stages in an array; deeper than any real nesting is not looked into.
    if (Array.isArray(nested) && depth < 32) yield* inOrder(nested as Stage[], depth + 1);
    else yield s;
  }
}

let orderWarned = false;

/**
 * Say once that a gate's order breaks what its metering stages promise: on the gate's logger
 * when it was given one, else as a process warning (once per process, code
 * `FLOODGATE_STAGE_ORDER`), so that it is seen without a logger.
 */
export function warnOrder(log: Logger | undefined, gate: string, why: string): void {
  if (log) {
    log.warn({ gate }, why);
    return;
  }
  if (orderWarned) return;
  orderWarned = true;
  process.emitWarning(`gate "${gate}": ${why}`, { code: "FLOODGATE_STAGE_ORDER" });
}
