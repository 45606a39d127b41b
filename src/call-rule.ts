/**
 * What a call must name for a stage that keeps separate budgets (a keyed token bucket's `key`, an
 * interval gate's `host`), checked when the call is made.
 */
import { InvalidOptionsError } from "./errors.js";
import type { AdmitOptions } from "./types.js";
import { got } from "./validate.js";

/** The one bucket of a token bucket that is not keyed. */
export const UNKEYED = "default";

/**
 * The bucket a call takes from: its `key` on a keyed bucket (where a call without one is
 * refused), the one bucket otherwise (where a `key` given to the stage itself is refused).
 */
export function bucketKey(name: string, keyed: boolean, o: AdmitOptions): string {
  if (keyed) {
    if (o.key === undefined) {
      throw new InvalidOptionsError(
        name,
        "key",
        `tokenBucket "${name}": key is required: the bucket is keyed (keyed: true), so every call names its key`,
      );
    }
    return o.key;
  }
  if (o.key !== undefined) {
    throw new InvalidOptionsError(
      name,
      "key",
      `tokenBucket "${name}": key given to a bucket that is not keyed (one bucket for all calls), ${got(o.key)}; build it with keyed: true to give each key its own bucket`,
    );
  }
  return UNKEYED;
}

/** The host a call is spaced under: its `host`, else the stage's `defaultHost`, else refused. */
export function gateHost(name: string, defaultHost: string | undefined, o: AdmitOptions): string {
  const host = o.host ?? defaultHost;
  if (host === undefined) {
    throw new InvalidOptionsError(
      name,
      "host",
      `intervalGate "${name}": host is required: name each call's host ({ host: "api.example.com" }), or build the interval gate with defaultHost`,
    );
  }
  return host;
}

/**
 * Which call option a stage keeps separate budgets by, and the check of a call's options
 * against it: a keyed bucket needs `key`, an unkeyed one refuses it, an interval gate needs
 * `host` unless it has a default.
 */
export interface CallRule {
  readonly keyedBy: "key" | "host" | undefined;
  check(name: string, o: AdmitOptions): void;
}

/** The rule of a stage with one budget for all calls. */
export const ONE_BUDGET: CallRule = { keyedBy: undefined, check() {} };

/** The rule of a token bucket, keyed (`keyed: true`) or not. */
export function bucketRule(keyed: boolean): CallRule {
  return { keyedBy: keyed ? "key" : undefined, check: (name, o) => void bucketKey(name, keyed, o) };
}

/** The rule of an interval gate with its `defaultHost`, if any. */
export function hostRule(defaultHost: string | undefined): CallRule {
  return { keyedBy: "host", check: (name, o) => void gateHost(name, defaultHost, o) };
}

/** Both rules: `a`'s key (`keyedBy`), and a call checked by `a`, then by `b`. */
export function bothRules(a: CallRule, b: CallRule): CallRule {
  return {
    keyedBy: a.keyedBy,
    check: (name, o) => {
      a.check(name, o);
      b.check(name, o);
    },
  };
}
