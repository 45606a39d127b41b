/**
 * Checking what a caller gives `wrapFetch` and `floodgateInterceptor`: the gate, the options and
 * each call's `floodgate` options, through one path whose messages name the wrapper.
 */
import type { Clock } from "../clock.js";
import { InvalidOptionsError, isFloodgateError } from "../errors.js";
import { got, isArray, messageOf, unknownOption } from "../validate.js";
import { checkReserve } from "./rate-limit.js";
import { checkRetry } from "./retry.js";

export { got, show } from "../validate.js";

/** Throws the wrapper's `InvalidOptionsError` for `field`. */
export type Fail = (field: string, message: string) => never;

/** What differs between the wrappers' checks; the rules themselves are shared. */
export interface WrapperSpec {
  /** The wrapper's name, as its messages begin. */
  readonly name: string;
  /** Throws `InvalidOptionsError` with the message prefixed by the wrapper's name. */
  readonly fail: Fail;
  /** The gate method the wrapper calls besides `pause`. */
  readonly method: "run" | "admit";
  /** The wrapper's options, in the order they are checked. */
  readonly options: ReadonlySet<string>;
  /** How the `key` option is called, for its message. */
  readonly keyArgs: string;
  /** Where a call's `floodgate` options are given, and the keys they take. */
  readonly where: "init" | "opts";
  readonly callKeys: ReadonlySet<string>;
}

/** A wrapper's `name`, and the `fail` whose messages start with `name: `. */
export function specNamed(name: string): Pick<WrapperSpec, "name" | "fail"> {
  return {
    name,
    fail: (field, message) => {
      throw new InvalidOptionsError(undefined, field, `${name}: ${message}`);
    },
  };
}

/**
 * Run `check`, which reads options the caller gave; a getter or Proxy trap that throws on the way
 * becomes `fail(field, …)` rather than escaping as it is.
 * @internal
 */
export function readingOptions<T>(field: string, what: string, fail: Fail, check: () => T): T {
  try {
    return check();
  } catch (error) {
    if (isFloodgateError(error)) throw error;
    return fail(field, `${what} could not be read (${messageOf(error)})`);
  }
}

/**
 * Whether `gate` is keyed by a call's `key`; a `key` option given for a gate that is not is
 * refused through `fail`, naming it.
 * @internal
 */
export function keyedGate(
  gate: { readonly keyedBy?: "key" | "host" | undefined },
  keyOption: unknown,
  fail: Fail,
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

/** Whether `g` has the methods a gate needs here (`run` or `admit`, and `pause`). */
function isGate(g: unknown, method: "run" | "admit"): boolean {
  if (typeof g !== "object" || g === null) return false;
  const o = g as Record<string, unknown>;
  return typeof o[method] === "function" && typeof o.pause === "function";
}

/**
 * Check the gate a wrapper is built on.
 * @internal
 */
export function checkGate(spec: WrapperSpec, gate: unknown): void {
  if (!readingOptions("gate", "gate", spec.fail, () => isGate(gate, spec.method))) {
    spec.fail("gate", `gate must be a Gate (an object with ${spec.method} and pause), ${got(gate)}`);
  }
}

/** Each option's rule; `value` is never undefined. */
const RULES: Readonly<Record<string, (value: unknown, spec: WrapperSpec) => void>> = {
  key(v, { fail, keyArgs }) {
    if (typeof v !== "function")
      fail("key", `key must be a function ${keyArgs} => string | undefined, ${got(v)}`);
  },
  timeoutMs(v, { fail }) {
    if (!(typeof v === "number" && v >= 0))
      fail("timeoutMs", `timeoutMs must be a number >= 0 or Infinity, ${got(v)}`);
  },
  maxPauseMs(v, { fail }) {
    if (!(typeof v === "number" && v >= 0 && Number.isFinite(v))) {
      fail("maxPauseMs", `maxPauseMs must be a finite number >= 0, ${got(v)}`);
    }
  },
  now(v, { fail }) {
    if (typeof v !== "function")
      fail("now", `now must be a function returning epoch milliseconds, ${got(v)}`);
  },
  clock(v, { fail }) {
    const c = v as Partial<Clock> | null;
    const isClock =
      typeof c === "object" &&
      c !== null &&
      typeof c.now === "function" &&
      typeof c.setTimeout === "function" &&
      typeof c.clearTimeout === "function";
    if (!isClock) fail("clock", `clock must be a Clock (now, setTimeout, clearTimeout), ${got(v)}`);
  },
  retry: (v, { fail }) => void checkRetry(v, "retry", fail),
  reserve: (v, { fail }) => void checkReserve(v, "reserve", fail),
  settle(v, { fail }) {
    if (typeof v !== "function")
      fail("settle", `settle must be a function (response, url) => cost, ${got(v)}`);
  },
};

/**
 * Check a wrapper's options, reading each once into a copy (a getter is not read again later),
 * and return the copy.
 * @internal
 */
export function checkOptions(spec: WrapperSpec, options: unknown): Record<string, unknown> {
  const fail: Fail = spec.fail;
  if (options === undefined) return {};
  if (typeof options !== "object" || options === null || isArray(options)) {
    fail("options", `options must be an object, ${got(options)}`);
  }
  return readingOptions("options", "options", fail, () => {
    const o: Record<string, unknown> = {};
    for (const k of Object.keys(options)) {
      if (!spec.options.has(k)) fail(k, unknownOption("", k, [...spec.options], spec.name));
      o[k] = (options as Record<string, unknown>)[k];
    }
    for (const k of spec.options) if (o[k] !== undefined) RULES[k]!(o[k], spec);
    return o;
  });
}

/**
 * Check a call's `floodgate` options (`init.floodgate` for fetch, `opts.floodgate` for undici):
 * `false`, or a copy of an object of known keys whose `key` and `host` are non-empty strings and
 * whose `retry` is a retry option. `cost`, `costs` and `timeoutMs` are left to the gate, which
 * checks them and names the field.
 * @internal
 */
export function checkCall(spec: WrapperSpec, call: unknown): Record<string, unknown> | false {
  const { where } = spec;
  const fail: Fail = spec.fail;
  if (call === undefined || call === false) return call === false ? false : {};
  if (typeof call !== "object" || call === null || isArray(call)) {
    fail("floodgate", `${where}.floodgate must be an object or false, ${got(call)}`);
  }
  const c = readingOptions("floodgate", `${where}.floodgate`, fail, () => {
    // A copy: what is checked here is what the gate is given.
    const copy: Record<string, unknown> = {};
    for (const k of Object.keys(call)) {
      if (!spec.callKeys.has(k)) {
        fail(`floodgate.${k}`, unknownOption("floodgate", k, [...spec.callKeys], `${where}.floodgate`));
      }
      copy[k] = (call as Record<string, unknown>)[k];
    }
    for (const k of ["key", "host"]) {
      const v = copy[k];
      if (v !== undefined && !(typeof v === "string" && v.length > 0)) {
        fail(`floodgate.${k}`, `${where}.floodgate.${k} must be a non-empty string, ${got(v)}`);
      }
    }
    return copy;
  });
  const retry = c.retry;
  if (retry !== undefined && retry !== false) {
    readingOptions("floodgate.retry", `${where}.floodgate.retry`, fail, () =>
      checkRetry(retry, "floodgate.retry", fail),
    );
  }
  return c;
}
