import { InvalidOptionsError } from "./errors.js";
import type { AdmitOptions, RunOptions, StageKind } from "./types.js";
import { got, isArray, meant, unreadable } from "./validate.js";

/**
 * Longest wait floodgate deals in, in milliseconds: `Number.MAX_SAFE_INTEGER` (about 285,000
 * years). A longer spacing, pause or refill wait is treated as this long, on both backends, so
 * that every timer and every Redis TTL stays a whole, finite number.
 */
export const LONGEST_MS = Number.MAX_SAFE_INTEGER;

/**
 * Options `admitOptions` has checked and copied. Handed on inside floodgate (a stage's `run` to
 * its `admit`, a fallback to its primary), they are not checked again.
 */
class Checked implements RunOptions {
  /** Whether `o` is one; a Proxy whose prototype trap throws is not. */
  static is(o: object): o is Checked {
    try {
      return o instanceof Checked;
    } catch {
      return false;
    }
  }

  constructor(
    public key: string | undefined,
    public host: string | undefined,
    public cost: number | undefined,
    public costs: Readonly<Record<string, number>> | undefined,
    public signal: AbortSignal | undefined,
    public timeoutMs: number | undefined,
    public classify: RunOptions["classify"],
    cls: string | undefined,
  ) {
    this.class = cls;
  }

  class: string | undefined;
}

const EMPTY: AdmitOptions = Object.freeze(
  new Checked(undefined, undefined, undefined, undefined, undefined, undefined, undefined, undefined),
);

/**
 * A stage's options for one call of a fused gate, made from the gate's own options, which
 * `admitOptions` has checked: its key (or none), the host, its cost, its class (or none). The
 * stage takes them as checked; floodgate's own stages are the only ones a gate fuses.
 */
export function fusedStageOptions(
  key: string | undefined,
  host: string | undefined,
  cost: number | undefined,
  cls: string | undefined,
): AdmitOptions {
  return new Checked(key, host, cost, undefined, undefined, undefined, undefined, cls);
}

/** The error of `run` (or `enqueue`) given something other than a function, or undefined. */
export function fnError(
  kind: StageKind,
  name: string,
  fn: unknown,
  entry: "run" | "enqueue" = "run",
): InvalidOptionsError | undefined {
  if (typeof fn === "function") return undefined;
  return new InvalidOptionsError(name, "fn", `${kind} "${name}": ${entry} needs a function`);
}

/** The fields of admit and run options, in the order they are checked. */
const FIELDS = ["key", "host", "class", "cost", "costs", "signal", "timeoutMs", "classify"] as const;

/**
 * The call that options were given to: `tryAdmit` never waits (no `signal`, `timeoutMs`), only
 * `run` and `enqueue` call a function (`classify`).
 */
export type Entry = "admit" | "tryAdmit" | "run";

const ALLOWED: Record<Entry, ReadonlySet<string>> = {
  run: new Set(FIELDS),
  admit: new Set(["key", "host", "class", "cost", "costs", "signal", "timeoutMs"]),
  tryAdmit: new Set(["key", "host", "class", "cost", "costs"]),
};

/** `field` is not one `entry` takes: refuse it, unless it is another entry's and not given. */
function refuseField(kind: StageKind, name: string, options: object, entry: Entry, field: string): void {
  const allowed = ALLOWED[entry];
  if (FIELDS.includes(field as (typeof FIELDS)[number])) {
    if (read(kind, name, options, field) === undefined) return;
    const why = field === "classify" ? "only run and enqueue call a function" : "tryAdmit never waits";
    throw new InvalidOptionsError(name, field, `${kind} "${name}": ${entry} takes no ${field} (${why})`);
  }
  const near = meant(field, allowed);
  throw new InvalidOptionsError(
    name,
    field,
    `${kind} "${name}": unknown option "${field}"${near ? ` (did you mean "${near}"?)` : ""}; ${entry} takes ${[...allowed].join(", ")}`,
  );
}

function fail(kind: StageKind, name: string, field: string, rule: string, value: unknown): never {
  throw new InvalidOptionsError(name, field, `${kind} "${name}": ${field} ${rule}, ${got(value)}`);
}

/** `get()`, or an error naming `field` when it throws (a getter, a Proxy trap). */
function guarded<T>(kind: StageKind, name: string, field: string, get: () => T): T {
  try {
    return get();
  } catch (error) {
    throw unreadable(`${kind} "${name}"`, name, field, error);
  }
}

/** `options[field]`, or an error naming the field when reading it throws. */
function read(kind: StageKind, name: string, options: object, field: string): unknown {
  return guarded(kind, name, field, () => (options as Record<string, unknown>)[field]);
}

/** `value` is left out or a string of at least one character; else the error naming `field`. */
function nonEmptyOrUndefined(kind: StageKind, name: string, field: string, value: unknown): void {
  if (value !== undefined && !(typeof value === "string" && value.length > 0)) {
    fail(kind, name, field, "must be a non-empty string", value);
  }
}

function isCount(n: unknown): n is number {
  return typeof n === "number" && Number.isInteger(n) && n >= 0;
}

/** A signal as the stages use it: an object with `aborted`, `addEventListener`, `removeEventListener`. */
function isSignal(v: unknown): v is AbortSignal {
  if (typeof v !== "object" || v === null) return false;
  try {
    const s = v as AbortSignal;
    return (
      typeof s.aborted === "boolean" &&
      typeof s.addEventListener === "function" &&
      typeof s.removeEventListener === "function"
    );
  } catch {
    return false;
  }
}

/**
 * `v` as integers >= 0 by stage name (`costs`, or a record given to `settle`), copied into an
 * object with no prototype, so no stage name finds `toString`. `field` and `rule` name it in
 * errors; an entry that is not a count is named `field.entry`.
 */
function countsByName(
  kind: StageKind,
  name: string,
  field: string,
  rule: string,
  v: unknown,
): Readonly<Record<string, number>> {
  if (typeof v !== "object" || v === null || isArray(v)) fail(kind, name, field, rule, v);
  const keys = guarded(kind, name, field, () => Object.keys(v));
  const out: Record<string, number> = Object.create(null);
  for (const k of keys) {
    const entry = `${field}.${k}`;
    const n = guarded(kind, name, entry, () => (v as Record<string, unknown>)[k]);
    if (!isCount(n)) fail(kind, name, entry, "must be an integer >= 0", n);
    out[k] = n + 0;
  }
  return out;
}

/**
 * The options of one admission (or run), checked once and copied: every field must have its
 * documented type (`undefined` means "not given"; `null` is refused like any other wrong value),
 * and the copy is what the stage reads afterwards, so a getter is read once. Cheap on the common
 * path (`undefined` options). Throws `InvalidOptionsError` naming the field; callers turn it into
 * a rejection.
 */
export function admitOptions(
  kind: StageKind,
  name: string,
  options: AdmitOptions | undefined,
  entry: Entry = "run",
): RunOptions {
  if (options === undefined) return EMPTY;
  if (typeof options !== "object" || options === null || isArray(options)) {
    fail(kind, name, "options", "must be an object", options);
  }
  if (Checked.is(options)) return options;
  let key: unknown, host: unknown, cost: unknown, costs: unknown, signal: unknown, timeoutMs: unknown;
  let classify: unknown, cls: unknown;
  try {
    ({
      key,
      host,
      cost,
      costs,
      signal,
      timeoutMs,
      classify,
      class: cls,
    } = options as Record<string, unknown>);
    for (const field in options) {
      // The hot path: a known field, compared without a lookup.
      switch (field) {
        case "key":
        case "host":
        case "class":
        case "cost":
        case "costs":
          continue;
        case "signal":
        case "timeoutMs":
          if (entry !== "tryAdmit") continue;
          break;
        case "classify":
          if (entry === "run") continue;
          break;
      }
      refuseField(kind, name, options, entry, field);
    }
  } catch (error) {
    if (error instanceof InvalidOptionsError) throw error;
    // A getter or Proxy trap threw: read field by field to name the one.
    for (const field of FIELDS) read(kind, name, options, field);
    throw new InvalidOptionsError(name, "options", `${kind} "${name}": options could not be read`);
  }
  nonEmptyOrUndefined(kind, name, "key", key);
  nonEmptyOrUndefined(kind, name, "host", host);
  nonEmptyOrUndefined(kind, name, "class", cls);
  if (cost !== undefined && !isCount(cost)) fail(kind, name, "cost", "must be an integer >= 0", cost);
  if (costs !== undefined) {
    const byName = countsByName(
      kind,
      name,
      "costs",
      "must be an object of integers >= 0 by stage name",
      costs,
    );
    costs = byName;
    if (kind !== "gate") {
      // A stage's own call: costs may name only the stage, and then is its cost.
      for (const k in byName) {
        if (k !== name) {
          throw new InvalidOptionsError(
            name,
            `costs.${k}`,
            `${kind} "${name}": costs names "${k}", which is not this stage; on a stage's own call costs may name only "${name}"`,
          );
        }
      }
      if (byName[name] !== undefined) cost = byName[name];
      costs = undefined;
    }
  }
  if (signal !== undefined && !isSignal(signal)) fail(kind, name, "signal", "must be an AbortSignal", signal);
  if (timeoutMs !== undefined && !(typeof timeoutMs === "number" && timeoutMs >= 0)) {
    fail(kind, name, "timeoutMs", "must be a number >= 0 or Infinity", timeoutMs);
  }
  if (classify !== undefined && typeof classify !== "function") {
    fail(kind, name, "classify", "must be a function (settled) => outcome", classify);
  }
  return new Checked(
    key as string | undefined,
    host as string | undefined,
    // `-0` counts as 0.
    cost === undefined ? undefined : (cost as number) + 0,
    costs as Readonly<Record<string, number>> | undefined,
    signal as AbortSignal | undefined,
    timeoutMs === undefined ? undefined : (timeoutMs as number) + 0,
    classify as RunOptions["classify"],
    cls as string | undefined,
  );
}

/** The option that bounds a call's cost, by stage kind, and why. */
const COST_BOUND: Partial<Record<StageKind, string>> = {
  semaphore: "limit",
  queue: "maxSize",
  aimd: "min; the adaptive limit can fall to min",
  tokenBucket: "capacity",
};

/** A cost above what the stage can ever grant is refused at once, never waited on. */
export function tooCostly(
  kind: StageKind,
  name: string,
  cost: number,
  most: number,
  limitedBy?: string,
  field = "cost",
) {
  const bound = limitedBy ?? COST_BOUND[kind] ?? "the most the stage grants";
  const [option, why] = bound.split("; ");
  return new InvalidOptionsError(
    name,
    field,
    `${kind} "${name}": ${field} must be <= ${option} (${most}${why ? `; ${why}` : ""}), ${got(cost)}; it could never be admitted`,
  );
}

/**
 * What `ticket.settle(actual)` was given, checked: an integer >= 0, or a record of them by stage
 * name (copied into an object with no prototype). Throws `InvalidOptionsError` naming `actual`.
 */
export function settleValue(
  kind: StageKind,
  name: string,
  actual: unknown,
): number | Readonly<Record<string, number>> {
  const rule = "must be an integer >= 0 or a record of them by stage name";
  if (typeof actual === "number") {
    if (!isCount(actual)) fail(kind, name, "actual", "must be an integer >= 0", actual);
    return actual + 0;
  }
  return countsByName(kind, name, "actual", rule, actual);
}

/**
 * The arguments of `pause(host, ms)`, checked; the error naming the bad one, or undefined. `ms`
 * may be any finite number >= 0; one above `LONGEST_MS` pauses for `LONGEST_MS`.
 */
export function pauseError(
  name: string,
  host: unknown,
  ms: unknown,
  kind: StageKind = "intervalGate",
): InvalidOptionsError | undefined {
  if (typeof host !== "string" || host.length === 0) {
    return new InvalidOptionsError(
      name,
      "host",
      `${kind} "${name}": host must be a non-empty string, ${got(host)}`,
    );
  }
  if (typeof ms !== "number" || !(ms >= 0) || !Number.isFinite(ms)) {
    return new InvalidOptionsError(
      name,
      "ms",
      `${kind} "${name}": pause ms must be a finite number >= 0, ${got(ms)}`,
    );
  }
  return undefined;
}
