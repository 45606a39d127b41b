import { isFloodgateError } from "../errors.js";
import { isArray, messageOf } from "../validate.js";

/** A short description of a value for an error message: strings quoted, objects by kind. Never throws. */
export function show(value: unknown): string {
  try {
    if (typeof value === "string")
      return JSON.stringify(value.length > 120 ? `${value.slice(0, 120)}…` : value);
    if (typeof value === "function") return "a function";
    if (typeof value === "bigint") return `${value}n`;
    if (typeof value === "number" && Object.is(value, -0)) return "-0";
    if (typeof value === "object" && value !== null) return isArray(value) ? "an array" : "an object";
    return String(value);
  } catch {
    return "a value";
  }
}

/**
 * Run `check`, which reads options the caller gave; a getter or Proxy trap that throws on the way
 * becomes `fail(field, …)` rather than escaping as it is.
 * @internal
 */
export function readingOptions<T>(
  field: string,
  what: string,
  fail: (field: string, message: string) => never,
  check: () => T,
): T {
  try {
    return check();
  } catch (error) {
    if (isFloodgateError(error)) throw error;
    return fail(field, `${what} could not be read (${messageOf(error)})`);
  }
}

/**
 * The shape every per-call `floodgate` option shares (`init.floodgate` for fetch, `opts.floodgate`
 * for undici): `false`, or an object of known keys whose `key` and `host` are non-empty strings.
 * `where` names the holder in messages; `fail` throws the caller's error.
 */
export function checkCallShape(
  call: unknown,
  where: "init" | "opts",
  keys: ReadonlySet<string>,
  fail: (field: string, message: string) => never,
): Record<string, unknown> | false {
  if (call === undefined || call === false) return call === false ? false : {};
  if (typeof call !== "object" || call === null || isArray(call)) {
    fail("floodgate", `${where}.floodgate must be an object or false (got ${show(call)})`);
  }
  return readingOptions("floodgate", `${where}.floodgate`, fail, () => {
    // A copy: what is checked here is what the gate is given.
    const c: Record<string, unknown> = {};
    for (const k of Object.keys(call)) {
      if (!keys.has(k)) fail(`floodgate.${k}`, `unknown option "floodgate.${k}"`);
      c[k] = (call as Record<string, unknown>)[k];
    }
    for (const k of ["key", "host"]) {
      const v = c[k];
      if (v !== undefined && !(typeof v === "string" && v.length > 0)) {
        fail(`floodgate.${k}`, `${where}.floodgate.${k} must be a non-empty string (got ${show(v)})`);
      }
    }
    return c;
  });
}
