/** A short description of a value for an error message: strings quoted, objects by kind. */
export function show(value: unknown): string {
  if (typeof value === "string") return JSON.stringify(value);
  if (typeof value === "function") return "a function";
  if (typeof value === "object" && value !== null) return Array.isArray(value) ? "an array" : "an object";
  return String(value);
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
  if (typeof call !== "object" || call === null || Array.isArray(call)) {
    fail("floodgate", `${where}.floodgate must be an object or false (got ${show(call)})`);
  }
  for (const k of Object.keys(call))
    if (!keys.has(k)) fail(`floodgate.${k}`, `unknown option "floodgate.${k}"`);
  const c = call as Record<string, unknown>;
  for (const k of ["key", "host"]) {
    const v = c[k];
    if (v !== undefined && !(typeof v === "string" && v.length > 0)) {
      fail(`floodgate.${k}`, `${where}.floodgate.${k} must be a non-empty string (got ${show(v)})`);
    }
  }
  return c;
}
