import { InvalidOptionsError } from "./errors.js";
import type { AdmitOptions, StageKind } from "./types.js";

const EMPTY: AdmitOptions = Object.freeze({});

/** The options of one admission, checked once. Cheap on the common path (`undefined` options). */
export function admitOptions(kind: StageKind, name: string, options: AdmitOptions | undefined): AdmitOptions {
  if (options === undefined) return EMPTY;
  if (typeof options !== "object" || options === null) {
    throw new InvalidOptionsError(name, "options", `${kind} "${name}": admit options must be an object`);
  }
  const { cost, timeoutMs, signal } = options;
  if (cost !== undefined && !(Number.isInteger(cost) && cost >= 0)) {
    throw new InvalidOptionsError(
      name,
      "cost",
      `${kind} "${name}": cost must be an integer >= 0 (got ${cost})`,
    );
  }
  if (timeoutMs !== undefined && !(timeoutMs >= 0)) {
    throw new InvalidOptionsError(
      name,
      "timeoutMs",
      `${kind} "${name}": timeoutMs must be a number >= 0 or Infinity (got ${timeoutMs})`,
    );
  }
  if (signal !== undefined && (typeof signal !== "object" || typeof signal.addEventListener !== "function")) {
    throw new InvalidOptionsError(name, "signal", `${kind} "${name}": signal must be an AbortSignal`);
  }
  return options;
}

/** A cost above what the stage can ever grant is refused at once, never waited on. */
export function tooCostly(kind: StageKind, name: string, cost: number, most: number, what: string) {
  return new InvalidOptionsError(
    name,
    "cost",
    `${kind} "${name}": cost must be <= ${what} (${most}) (got ${cost}); it could never be admitted`,
  );
}

/** The arguments of `pause(host, ms)`, checked; the error naming the bad one, or undefined. */
export function pauseError(name: string, host: unknown, ms: unknown): InvalidOptionsError | undefined {
  if (typeof host !== "string" || host.length === 0) {
    return new InvalidOptionsError(name, "host", `intervalGate "${name}": host must be a non-empty string`);
  }
  if (typeof ms !== "number" || !(ms >= 0) || !Number.isFinite(ms)) {
    return new InvalidOptionsError(
      name,
      "ms",
      `intervalGate "${name}": pause ms must be a finite number >= 0 (got ${String(ms)})`,
    );
  }
  return undefined;
}
