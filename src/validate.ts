/**
 * The checks of everything a user builds with: each stage's options as a schema whose every rule
 * names its field and what it must be, and the helpers that turn a failed check into an
 * `InvalidOptionsError` saying so (`parseOptions`, `show`, `got`). Over 350 lines because the
 * schemas are read side by side, field against field; the checks of one admission's options are
 * in admit.ts.
 */
import { z } from "zod";
import type { Clock } from "./clock.js";
import { InvalidOptionsError } from "./errors.js";
import type { Logger, StageKind } from "./types.js";

const MAX_INT = 2 ** 31 - 1;

function int(min: number, max = MAX_INT) {
  const rule = max === MAX_INT ? `must be an integer >= ${min}` : `must be an integer in [${min}, ${max}]`;
  return z.number({ error: rule }).int({ error: rule }).min(min, { error: rule }).max(max, { error: rule });
}

function finite(rule: string) {
  return z.number({ error: rule }).refine(Number.isFinite, { error: rule });
}

const clock = z.custom<Clock>(
  (v) => typeof v === "object" && v !== null && typeof (v as Clock).now === "function",
  { error: "must be a Clock (an object with now, setTimeout and clearTimeout)" },
);
const logger = z.custom<Logger>(
  (v) => typeof v === "object" && v !== null && typeof (v as Logger).child === "function",
  { error: "must be a pino-shaped logger (an object with child, debug and warn)" },
);
const random = z.custom<() => number>((v) => typeof v === "function", { error: "must be a function" });

/** A string of at least one character (a host, a class, a gate's name). */
const nonEmpty = z
  .string({ error: "must be a non-empty string" })
  .min(1, { error: "must be a non-empty string" });

const stage = {
  clock: clock.optional(),
  logger: logger.optional(),
};

const onBackendError = z.enum(["fail-closed", "fail-open", "local"], {
  error: 'must be "fail-closed", "fail-open" or "local"',
});

/** Options of a stage: what every stage takes plus what to do when its backend fails. */
const stageWithPolicy = {
  ...stage,
  onBackendError: onBackendError.optional(),
  localShare: finite("must be a number in (0, 1]")
    .refine((v) => v > 0 && v <= 1, { error: "must be a number in (0, 1]" })
    .optional(),
};

/** Most traffic classes one stage may have. */
export const MAX_CLASSES = 16;

const trafficClass = z.strictObject({
  share: finite("must be a finite number > 0").refine((v) => v > 0, { error: "must be a finite number > 0" }),
  priority: z
    .number({ error: "must be an integer" })
    .int({ error: "must be an integer" })
    .min(-MAX_INT, { error: "must be an integer" })
    .max(MAX_INT, { error: "must be an integer" })
    .optional(),
  maxShare: finite("must be a number in (0, 1]")
    .refine((v) => v > 0 && v <= 1, { error: "must be a number in (0, 1]" })
    .optional(),
  lendable: finite("must be a number in [0, 1]")
    .refine((v) => v >= 0 && v <= 1, { error: "must be a number in [0, 1]" })
    .optional(),
});

/** `classes` and `defaultClass`, checked together. */
const classFields = {
  classes: z
    .record(nonEmpty, trafficClass, { error: "must be an object of classes by name" })
    .refine((c) => Object.keys(c).length >= 1 && Object.keys(c).length <= MAX_CLASSES, {
      error: `must name 1 to ${MAX_CLASSES} classes`,
    })
    .optional(),
  defaultClass: nonEmpty.optional(),
};

/** A `defaultClass` must name one of `classes`, and needs them. */
function defaultClassKnown(o: { classes?: Record<string, unknown>; defaultClass?: string }): boolean {
  if (o.defaultClass === undefined) return true;
  return o.classes !== undefined && Object.hasOwn(o.classes, o.defaultClass);
}

const defaultClassRule: { path: string[]; error: string } = {
  path: ["defaultClass"],
  error: "must name one of classes",
};

/** `reclaim`, on a stage that holds permits: it needs classes. */
const reclaimField = {
  reclaim: z.enum(["wait", "signal"], { error: 'must be "wait" or "signal"' }).optional(),
};
const reclaimRule: { path: string[]; error: string } = {
  path: ["reclaim"],
  error: "needs classes: a stage without classes lends nothing to take back",
};
function reclaimHasClasses(o: { classes?: unknown; reclaim?: string }): boolean {
  return o.reclaim === undefined || o.classes !== undefined;
}

export const semaphoreSchema = z
  .strictObject({
    ...stageWithPolicy,
    limit: int(1),
    leaseMs: int(100).optional(),
    ...classFields,
    ...reclaimField,
  })
  .refine(defaultClassKnown, defaultClassRule)
  .refine(reclaimHasClasses, reclaimRule);

export const penaltySchema = z.strictObject({
  factor: finite("must be a number in (0, 1)")
    .refine((v) => v > 0 && v < 1, { error: "must be a number in (0, 1)" })
    .optional(),
  recoveryMs: int(1).optional(),
  minFactor: finite("must be a number in (0, 1]")
    .refine((v) => v > 0 && v <= 1, { error: "must be a number in (0, 1]" })
    .optional(),
});

export const tokenBucketSchema = z
  .strictObject({
    ...stageWithPolicy,
    capacity: int(1),
    refillPerSecond: finite("must be a finite number > 0").refine((v) => v > 0, {
      error: "must be a finite number > 0",
    }),
    initialTokens: int(0).optional(),
    penalty: penaltySchema.optional(),
    keyed: z.boolean({ error: "must be true or false" }).optional(),
    ...classFields,
  })
  .refine(defaultClassKnown, defaultClassRule)
  .refine((o) => o.initialTokens === undefined || o.initialTokens <= o.capacity, {
    path: ["initialTokens"],
    error: (issue) => `must be an integer in [0, capacity] (capacity is ${(issue.input as any).capacity})`,
  });

export const queueSchema = z.strictObject({
  ...stageWithPolicy,
  maxSize: int(1),
  whenFull: z.enum(["block", "shed"], { error: 'must be "block" or "shed"' }).optional(),
});

export const intervalGateSchema = z.strictObject({
  ...stageWithPolicy,
  minIntervalMs: finite("must be a finite number >= 0").refine((v) => v >= 0, {
    error: "must be a finite number >= 0",
  }),
  jitterMs: finite("must be a finite number >= 0")
    .refine((v) => v >= 0, { error: "must be a finite number >= 0" })
    .optional(),
  random: random.optional(),
  defaultHost: nonEmpty.optional(),
});

export const aimdSchema = z
  .strictObject({
    ...stageWithPolicy,
    initial: int(1),
    min: int(1).optional(),
    max: int(1),
    backoffRatio: finite("must be a number in [0.5, 1)")
      .refine((v) => v >= 0.5 && v < 1, { error: "must be a number in [0.5, 1)" })
      .optional(),
    slowCallMs: finite("must be a finite number > 0")
      .refine((v) => v > 0, { error: "must be a finite number > 0" })
      .optional(),
    leaseMs: int(100).optional(),
    ...classFields,
    ...reclaimField,
  })
  .refine(defaultClassKnown, defaultClassRule)
  .refine(reclaimHasClasses, reclaimRule)
  .refine((o) => (o.min ?? 1) <= o.max, { path: ["max"], error: "must be >= min" })
  .refine((o) => o.initial >= (o.min ?? 1) && o.initial <= o.max, {
    path: ["initial"],
    error: "must be in [min, max]",
  });

export const gateSchema = z.strictObject({
  ...stage,
  name: nonEmpty.optional(),
  fuse: z.boolean({ error: "must be true or false" }).optional(),
});

export const memoryBackendSchema = z.strictObject({ ...stage, random: random.optional() });

export const redisBackendSchema = z.strictObject({
  ...stage,
  prefix: z
    .string({ error: "must be a string" })
    .refine((v) => !/[{}]/.test(v), { error: "must not contain braces" })
    .optional(),
  time: z.enum(["server", "clock"], { error: 'must be "server" or "clock"' }).optional(),
  commandTimeoutMs: int(1).optional(),
  pollMs: int(10).optional(),
  livenessMs: int(100).optional(),
  claimMs: int(20).optional(),
  onBackendError: onBackendError.optional(),
  random: random.optional(),
  subscriber: z
    .custom<any>(
      (v) =>
        typeof v === "object" && v !== null && typeof (v as { subscribe?: unknown }).subscribe === "function",
      {
        error: "must be a Redis client (ioredis, iovalkey or node-redis)",
      },
    )
    .optional(),
});

/** Longest text of a value quoted in a message. */
const SHOWN = 120;

/**
 * A short description of any value for an error message: strings quoted, numbers as written
 * (`-0`, `NaN`), BigInts with their `n`, symbols by description, functions as "a function", other
 * objects as JSON when they have one. Never throws, whatever the value (a BigInt, a Proxy, an
 * object whose `toString`, `valueOf`, `toJSON` or getters throw): what cannot be shown safely is
 * shown by its kind.
 */
export function show(value: unknown): string {
  try {
    switch (typeof value) {
      case "string":
        return JSON.stringify(value.length > SHOWN ? `${value.slice(0, SHOWN)}…` : value);
      case "number":
        return Object.is(value, -0) ? "-0" : String(value);
      case "bigint":
        return `${value}n`;
      case "symbol":
        return String(value);
      case "function":
        return "a function";
      case "undefined":
      case "boolean":
        return String(value);
    }
    if (value === null) return "null";
    if (Array.isArray(value)) {
      const json = JSON.stringify(value);
      return json.length > SHOWN ? "an array" : json;
    }
    const json = JSON.stringify(value);
    if (json !== undefined && json.length <= SHOWN) return json;
  } catch {
    // A Proxy, a getter or a toJSON that throws, a BigInt or a cycle inside: shown by kind.
  }
  return "an object";
}

/**
 * "got" and the value received with its type, for the end of an error message:
 * `got "1000" (string)`, `got 2 (number)`, `got null`, `got a function`.
 */
export function got(value: unknown): string {
  const shown = show(value);
  // null, undefined, and what is shown by its kind ("a function", "an object") say their type.
  if (value === null || value === undefined || /^an? /.test(shown)) return `got ${shown}`;
  const type = typeof value !== "object" ? typeof value : isArray(value) ? "array" : "object";
  return `got ${shown} (${type})`;
}

/** `Array.isArray`, false for a revoked Proxy (which makes it throw). */
export function isArray(value: unknown): value is unknown[] {
  try {
    return Array.isArray(value);
  } catch {
    return false;
  }
}

/** A thrown value's message for another message; never throws. */
/** The error for options, or one `field` of them, whose reading threw (a getter, a Proxy trap). */
export function unreadable(
  where: string,
  name: string | undefined,
  field: string,
  error: unknown,
): InvalidOptionsError {
  return new InvalidOptionsError(name, field, `${where}: ${field} could not be read (${messageOf(error)})`);
}

export function messageOf(error: unknown): string {
  try {
    if (error instanceof Error) return String(error.message);
  } catch {
    // A message getter that throws.
  }
  return show(error);
}

/**
 * The field a misspelt option most likely meant, or undefined: the one it matches but for case
 * (`timeoutMS` → `timeoutMs`), else the only one within two letters of it (`limt` → `limit`),
 * else the only one it begins (`refillPerSec` → `refillPerSecond`).
 */
export function meant(field: string, known: Iterable<string>): string | undefined {
  const low = field.toLowerCase();
  let best: string | undefined;
  let bestDistance = 3;
  let tied = false;
  for (const k of known) {
    const other = k.toLowerCase();
    if (other === low) return k;
    if (low.length < 3) continue;
    // (Counted up to one past the best so far: a count equal to it is a tie, not a cut-off.)
    const d = editDistance(low, other, bestDistance + 1);
    if (d < bestDistance) {
      best = k;
      bestDistance = d;
      tied = false;
    } else if (d === bestDistance && d < 3) tied = true;
  }
  if (best !== undefined) return tied ? undefined : best;
  // An option cut short, of four letters or more: the only one it begins.
  let begun: string | undefined;
  if (low.length >= 4) {
    for (const k of known) {
      if (!k.toLowerCase().startsWith(low)) continue;
      if (begun !== undefined) return undefined;
      begun = k;
    }
  }
  return begun;
}

/** Letters to add, drop or change to make `a` into `b`, counted up to `most` (then `most`). */
function editDistance(a: string, b: string, most: number): number {
  if (Math.abs(a.length - b.length) >= most) return most;
  let previous = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const row = [i];
    let least = i;
    for (let j = 1; j <= b.length; j++) {
      const d = Math.min(
        previous[j]! + 1,
        row[j - 1]! + 1,
        previous[j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1),
      );
      row[j] = d;
      if (d < least) least = d;
    }
    if (least >= most) return most;
    previous = row;
  }
  return Math.min(previous[b.length]!, most);
}

/**
 * The text for an unknown option `key` at `path` ("" at the top): the option it most likely
 * meant, if any, and the options `owner` takes (`known`).
 */
export function unknownOption(path: string, key: string, known: readonly string[], owner: string): string {
  const at = (k: string) => (path === "" ? k : `${path}.${k}`);
  const near = meant(key, known);
  const hint = near === undefined ? "" : ` (did you mean "${at(near)}"?)`;
  return `unknown option "${at(key)}"${hint}; ${owner} takes ${known.join(", ")}`;
}

/**
 * The options an object schema takes at `path` (through optional fields), or undefined where
 * that is not an object schema.
 */
function knownKeys(schema: z.ZodType, path: readonly PropertyKey[]): string[] | undefined {
  const shapeOf = (s: unknown): Record<string, unknown> | undefined => {
    let at = s as { shape?: unknown; unwrap?: () => unknown } | undefined;
    while (at !== undefined && at.shape === undefined && typeof at.unwrap === "function") {
      at = at.unwrap() as typeof at;
    }
    const shape = at?.shape;
    return typeof shape === "object" && shape !== null ? (shape as Record<string, unknown>) : undefined;
  };
  let shape = shapeOf(schema);
  for (const p of path) {
    if (shape === undefined || typeof p !== "string" || !Object.hasOwn(shape, p)) return undefined;
    shape = shapeOf(shape[p]);
  }
  return shape === undefined ? undefined : Object.keys(shape);
}

function valueAt(input: unknown, path: readonly PropertyKey[]): unknown {
  let v = input;
  for (const p of path) v = v == null ? undefined : (v as Record<PropertyKey, unknown>)[p];
  return v;
}

/**
 * Parse options with `schema`; on failure throw `InvalidOptionsError` whose message names the
 * stage, the field, the rule and the value received:
 * `tokenBucket "de-rate": capacity must be an integer >= 1, got 0 (number)`.
 */
export function parseOptions<S extends z.ZodType>(
  schema: S,
  kind: StageKind | "memory" | "redis",
  name: string | undefined,
  input: unknown,
): z.output<S> {
  const where = name === undefined ? kind : `${kind} "${name}"`;
  if (typeof input !== "object" || input === null || isArray(input)) {
    throw new InvalidOptionsError(name, "options", `${where}: options must be an object, ${got(input)}`);
  }
  let result: ReturnType<typeof schema.safeParse>;
  try {
    result = schema.safeParse(input);
  } catch (error) {
    // A getter or Proxy trap of the options threw while they were read.
    throw unreadable(where, name, "options", error);
  }
  if (result.success) return result.data;
  const issues = result.error.issues;
  // An unknown option is most likely a typo of the missing one: name it first.
  const issue = issues.find((i) => i.code === "unrecognized_keys") ?? issues[0]!;
  if (issue.code === "unrecognized_keys") {
    const key = issue.keys[0]!;
    const path = issue.path.join(".");
    const field = path === "" ? key : `${path}.${key}`;
    // With the one it most likely meant, and the options taken there.
    const known = knownKeys(schema, issue.path);
    const text =
      known === undefined ? `unknown option "${field}"` : unknownOption(path, key, known, path || kind);
    throw new InvalidOptionsError(name, field, `${where}: ${text}`);
  }
  const field = issue.path.join(".");
  let value: unknown;
  try {
    value = valueAt(input, issue.path);
  } catch {
    value = undefined;
  }
  throw new InvalidOptionsError(name, field, `${where}: ${field} ${issue.message}, ${got(value)}`);
}

/** Stage names become part of Redis keys: non-empty, printable, no braces. */
export function checkName(kind: StageKind, name: unknown): string {
  if (typeof name !== "string" || name.length === 0 || name.length > 200 || /[{}\s]/.test(name)) {
    throw new InvalidOptionsError(
      undefined,
      "name",
      `${kind}: name must be a non-empty string of at most 200 characters without spaces or braces, ${got(name)}`,
    );
  }
  return name;
}

/**
 * `targets` (one, or a list) checked by `where` (`instrument`, `diagnose`, `drainOnSignals`):
 * each must have a function `method`. Throws `InvalidOptionsError` naming `targets` (or
 * `targets.i` in a list) for one that has not, a list that cannot be read, or, with `nonEmpty`,
 * an empty list.
 */
export function checkTargets<T>(where: string, targets: unknown, method: string, nonEmpty: boolean): T[] {
  const many = isArray(targets);
  let list: unknown[];
  try {
    list = many ? Array.from(targets as unknown[]) : [targets];
  } catch (error) {
    throw new InvalidOptionsError(
      undefined,
      "targets",
      `${where}: targets could not be read (${messageOf(error)})`,
    );
  }
  if (nonEmpty && list.length === 0) {
    throw new InvalidOptionsError(
      undefined,
      "targets",
      `${where}: targets must hold at least one gate or stage`,
    );
  }
  for (let i = 0; i < list.length; i++) {
    const t = list[i];
    let ok = false;
    try {
      ok = typeof (t as Record<string, unknown> | null)?.[method] === "function";
    } catch {
      ok = false;
    }
    if (!ok) {
      const field = many ? `targets.${i}` : "targets";
      throw new InvalidOptionsError(
        undefined,
        field,
        `${where}: ${field} must be a gate or a stage, ${got(t)}`,
      );
    }
  }
  return list as T[];
}
