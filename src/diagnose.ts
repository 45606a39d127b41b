/**
 * Where the constraint is: the provider's allowance, the concurrency bound, this process, or the
 * producer. Read from the stages' snapshots (Little's law over their last window, what waits now,
 * what Redis last said of the fleet), with the numbers that say so.
 */
import { InvalidOptionsError } from "./errors.js";
import type { FleetSnapshot, FlowSnapshot, Snapshot, Stage } from "./types.js";
import { checkTargets, got, isArray, messageOf, unknownOption } from "./validate.js";

/**
 * What bounds the throughput now:
 * - `provider`: the provider's allowance: calls wait for a rate (a token bucket, an interval
 *   gate), an AIMD limiter the provider's refusals set is full, or the provider refused calls;
 *   more workers will not help; quota, cost per call or a batch endpoint will;
 * - `bound`: the concurrency bound you set (fleet-wide on Redis) is full and calls wait for it:
 *   raise it if the provider allows more, else it is the provider's limit at this latency;
 * - `process`: work is waiting, yet the calls in flight stay well below the bound: the gap is
 *   inside this process (too few workers, a busy event loop, a connection pool below the bound);
 * - `producer`: nothing waits and the bound is far from full: the producer offers no more work;
 * - `idle`: no call was released in the window and none waits.
 */
export type Constraint = "provider" | "bound" | "process" | "producer" | "idle";

/** Options of `diagnose`. */
export interface DiagnoseOptions {
  /**
   * Work waiting in your own code before it reaches the stages (a job queue's depth, records
   * not yet submitted). Without it, only what waits at the stages counts. @default 0
   */
  backlog?: number;
  /** Calls the provider refused in the window (429s). Any at all point at the provider. @default 0 */
  rejected?: number;
  /** From what share of its limit a concurrency bound counts as full. @default 0.85 */
  full?: number;
}

/** One stage's figures in a diagnosis. */
export interface StageDiagnosis {
  name: string;
  kind: string;
  backend: string;
  /** Its Little's law figures (absent for a stage that does not measure them). */
  flow: FlowSnapshot | undefined;
  /** What Redis last said of the whole fleet (Redis permit stages). */
  fleet: FleetSnapshot | undefined;
  limit: number;
  waiting: number;
  /** One line with the numbers: `sem (semaphore): 16.0/s × 0.250 s = 4.0 in flight (mean 4.0) of 8 (50%)`. */
  line: string;
}

/** What `diagnose` found. */
export interface Diagnosis {
  constraint: Constraint;
  /** The verdict in one sentence, with the numbers behind it. */
  summary: string;
  /** Each stage looked at, in order (a gate's stages in its place, a stage shared by gates once). */
  stages: StageDiagnosis[];
}

const RATE_KINDS = new Set(["tokenBucket", "intervalGate"]);

/**
 * Say where the constraint is, from the snapshots of `targets` (stages or gates; a gate's
 * stages are looked at one by one). Synchronous: it reads each stage's last window and, on
 * Redis, what the last reply said of the fleet. Throws `InvalidOptionsError` naming the field
 * for a bad target or option.
 */
export function diagnose(targets: Stage | readonly Stage[], options: DiagnoseOptions = {}): Diagnosis {
  const o = checkOptions(options);
  const list = checkTargets<Stage>("diagnose", targets, "snapshot", true);
  // A gate's stages are looked at one by one, each once however many gates share it.
  const seen = new Set<Stage>();
  const snaps: Snapshot[] = [];
  const visit = (t: Stage, field: string) => {
    if (seen.has(t)) return;
    seen.add(t);
    const inner = (t as { stages?: unknown }).stages;
    if (isArray(inner)) {
      for (const s of inner as Stage[]) visit(s, field);
      return;
    }
    try {
      snaps.push(t.snapshot());
    } catch (error) {
      throw new InvalidOptionsError(
        undefined,
        field,
        `diagnose: ${field}.snapshot() threw (${messageOf(error)})`,
      );
    }
  };
  for (let i = 0; i < list.length; i++) visit(list[i]!, isArray(targets) ? `targets.${i}` : "targets");
  const stages = snaps.map(describe);
  return { ...verdict(snaps, o), stages };
}

/**
 * The most replicas an autoscaler should run: the fleet-wide bound ÷ the bound of one process,
 * rounded down (at least 1). Above it, a new replica cannot get a permit to use: it only adds
 * refused calls. Throws `InvalidOptionsError` naming `fleetBound` or `perProcessBound`.
 */
export function autoscalerCeiling(fleetBound: number, perProcessBound: number): number {
  for (const [field, v] of [
    ["fleetBound", fleetBound],
    ["perProcessBound", perProcessBound],
  ] as const) {
    if (typeof v !== "number" || !Number.isFinite(v) || v < 1) {
      throw new InvalidOptionsError(
        undefined,
        field,
        `autoscalerCeiling: ${field} must be a finite number >= 1, ${got(v)}`,
      );
    }
  }
  return Math.max(1, Math.floor(fleetBound / perProcessBound));
}

type Checked = Required<DiagnoseOptions>;

function checkOptions(options: unknown): Checked {
  if (typeof options !== "object" || options === null || isArray(options)) {
    throw new InvalidOptionsError(
      undefined,
      "options",
      `diagnose: options must be an object, ${got(options)}`,
    );
  }
  const read = (field: keyof DiagnoseOptions): unknown => {
    try {
      return (options as Record<string, unknown>)[field];
    } catch (error) {
      throw new InvalidOptionsError(
        undefined,
        field,
        `diagnose: ${field} could not be read (${messageOf(error)})`,
      );
    }
  };
  for (const key of Object.keys(options)) {
    if (key !== "backlog" && key !== "rejected" && key !== "full") {
      const text = unknownOption("", key, ["backlog", "rejected", "full"], "diagnose");
      throw new InvalidOptionsError(undefined, key, `diagnose: ${text}`);
    }
  }
  const count = (field: "backlog" | "rejected"): number => {
    const v = read(field);
    if (v === undefined) return 0;
    if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) {
      throw new InvalidOptionsError(
        undefined,
        field,
        `diagnose: ${field} must be an integer >= 0, ${got(v)}`,
      );
    }
    return v;
  };
  const full = read("full") ?? 0.85;
  if (typeof full !== "number" || !(full > 0 && full <= 1)) {
    throw new InvalidOptionsError(
      undefined,
      "full",
      `diagnose: full must be a number > 0 and <= 1, ${got(full)}`,
    );
  }
  return { backlog: count("backlog"), rejected: count("rejected"), full };
}

const pct = (x: number) => `${Math.round(x * 100)}%`;
const fixed = (x: number, d = 1) => x.toFixed(d);

function describe(s: Snapshot): StageDiagnosis {
  const f = s.flow;
  let line = `${s.name} (${s.kind}${s.backend === "memory" ? "" : `, ${s.backend}`}): `;
  if (f) {
    line +=
      `${fixed(f.throughput)}/s × ${fixed(f.serviceMs / 1000, 3)} s = ${fixed(f.littleInFlight)} in flight` +
      ` (mean ${fixed(f.meanInFlight)})`;
    if (Number.isFinite(s.limit)) line += ` of ${s.limit} (${pct(f.utilisation)})`;
    line += ` over ${fixed(f.windowMs / 1000)} s`;
  } else {
    line += `${s.inFlight} in flight${Number.isFinite(s.limit) ? ` of ${s.limit}` : ""}`;
  }
  if (s.fleet) line += `; fleet-wide ${s.fleet.inFlight} of ${s.fleet.limit}`;
  if (s.waiting > 0) line += `; ${s.waiting} waiting`;
  if (s.queueDepth > 0) line += `; queue depth ${s.queueDepth}`;
  if (s.shed > 0) line += `; ${s.shed} shed`;
  return {
    name: s.name,
    kind: s.kind,
    backend: s.backend,
    flow: f,
    fleet: s.fleet,
    limit: s.limit,
    waiting: s.waiting,
    line,
  };
}

/** How full a concurrency bound is: its mean in flight (or the fleet's, when fuller) ÷ its limit. */
function fullness(s: Snapshot): number {
  if (!Number.isFinite(s.limit) || s.limit <= 0) return 0;
  const own = s.flow ? s.flow.utilisation : s.inFlight / s.limit;
  const fleet = s.fleet && s.fleet.limit > 0 ? s.fleet.inFlight / s.fleet.limit : 0;
  return Math.max(own, fleet);
}

/**
 * What a stage's callers waited for it, in ms: in the flow's window when the stage measures one,
 * else in all (rate for a rate stage, permits for a bound).
 */
function waitedMs(s: Snapshot): number {
  if (s.flow) return s.flow.waitedMs;
  return RATE_KINDS.has(s.kind) ? s.tokenWaitMs : s.permitWaitMs;
}

/**
 * Whether callers waited for `s` long enough to call it binding: at least a tenth of the time
 * its calls held it (in the window: `released × serviceMs`; without a flow, `admitted ×` none),
 * so a few short waits (a turn of a line, a round trip) do not count.
 */
function waitedLong(s: Snapshot): boolean {
  const ms = waitedMs(s);
  const held = s.flow ? s.flow.released * s.flow.serviceMs : 0;
  return ms > 0 && ms >= WAITED_SHARE * held;
}

const WAITED_SHARE = 0.1;

function verdict(snaps: readonly Snapshot[], o: Checked): { constraint: Constraint; summary: string } {
  if (o.rejected > 0) {
    return {
      constraint: "provider",
      summary: `the provider: it refused ${o.rejected} calls; its allowance is below what the stages let through (lower the rate or the bound to match it)`,
    };
  }
  const rates = snaps.filter((s) => RATE_KINDS.has(s.kind));
  const bounds = snaps.filter((s) => Number.isFinite(s.limit) && s.kind !== "queue" && s.kind !== "gate");
  // The stage callers waited for most (a fused gate's waits are counted at the stage that refused);
  // but a bound that was seldom full (under `full` on average) yields to a rate they waited for
  // too: a bound that held the throughput down would be full while its callers wait, and callers
  // also queue behind a holder whose next caller then waits for the rate.
  const waits = [...rates, ...bounds]
    .filter(waitedLong)
    .sort((a, b) => waitedMs(b) - waitedMs(a) || b.waiting - a.waiting);
  const rateWaited = waits.find((s) => RATE_KINDS.has(s.kind));
  let waited = waits[0];
  if (waited && rateWaited && !RATE_KINDS.has(waited.kind) && fullness(waited) < o.full) waited = rateWaited;
  const full = bounds.filter((s) => fullness(s) >= o.full).sort((a, b) => fullness(b) - fullness(a))[0];
  const binding = waited ?? full;
  if (binding) {
    const f = binding.flow;
    const rate = RATE_KINDS.has(binding.kind);
    const figures = rate
      ? `${f ? `it lets ${fixed(f.throughput)}/s through; ` : ""}`
      : f
        ? `${fixed(f.throughput)}/s × ${fixed(f.serviceMs / 1000, 3)} s = ${fixed(f.littleInFlight)} in flight (mean ${fixed(f.meanInFlight)}) of ${binding.limit}; `
        : `${binding.inFlight} in flight of ${binding.limit}; `;
    const fleet = binding.fleet ? `fleet-wide ${binding.fleet.inFlight} of ${binding.fleet.limit}; ` : "";
    const waits =
      `calls waited ${fixed(waitedMs(binding) / 1000, 2)} s for it${binding.flow ? ` in the last ${fixed(binding.flow.windowMs / 1000)} s` : " in all"}` +
      `${binding.waiting > 0 ? `, ${binding.waiting} wait now` : ""}`;
    const what = `${binding.kind} "${binding.name}" (${figures}${fleet}${waits})`;
    if (rate) {
      return {
        constraint: "provider",
        summary: `the provider's allowance: ${what}; more workers will not help, more quota would`,
      };
    }
    if (binding.kind === "aimd") {
      return {
        constraint: "provider",
        summary: `the provider's allowance: the limit the provider's refusals set, ${what}`,
      };
    }
    return {
      constraint: "bound",
      summary: `the concurrency bound: ${what}; raise it only if the provider allows more at this latency`,
    };
  }
  const released = snaps.reduce((n, s) => n + (s.flow?.released ?? 0) + s.inFlight, 0);
  const waiting = snaps.reduce((n, s) => n + s.waiting, 0);
  const queued = snaps.reduce((n, s) => n + (s.kind === "queue" ? s.queueDepth : 0), 0);
  const behind = o.backlog + queued + waiting;
  if (released === 0 && behind === 0) {
    return { constraint: "idle", summary: "idle: no call was released in the window and none waits" };
  }
  const top = [...bounds].sort((a, b) => fullness(b) - fullness(a))[0];
  const used = top
    ? `${top.kind} "${top.name}" has ${fixed(top.flow?.meanInFlight ?? top.inFlight)} of ${top.limit} in flight on average (${pct(fullness(top))})`
    : "no stage bounds the calls in flight";
  if (behind > 0) {
    return {
      constraint: "process",
      summary:
        `this process: ${behind} jobs wait, yet ${used}; the gap is inside your own code` +
        " (too few workers, a busy event loop, a connection pool below the bound)",
    };
  }
  return {
    constraint: "producer",
    summary: `the producer: nothing waits and ${used}; the stages could take more work than they are given`,
  };
}
