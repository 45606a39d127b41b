import { isFloodgateError } from "../errors.js";

import { got, isArray, messageOf } from "../validate.js";

export { got, show } from "../validate.js";

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
    fail("floodgate", `${where}.floodgate must be an object or false, ${got(call)}`);
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
        fail(`floodgate.${k}`, `${where}.floodgate.${k} must be a non-empty string, ${got(v)}`);
      }
    }
    return c;
  });
}

/**
 * Whether `gate` is keyed by a call's `key`; a `key` option given for a gate that is not is
 * refused through `fail`, naming it.
 * @internal
 */
export function keyedGate(
  gate: { readonly keyedBy?: "key" | "host" | undefined },
  keyOption: unknown,
  fail: (field: string, message: string) => never,
): boolean {
  const keyed = readingOptions("gate", "gate.keyedBy", fail, () => gate.keyedBy === "key");
  if (keyOption !== undefined && !keyed) {
    fail(
      "key",
      "key is given, but no stage of the gate is keyed by it; build the token bucket with keyed: true",
    );
  }
  return keyed;
}
