/**
 * Retrying a fetch call: which calls may be retried, how long to wait between attempts, and the
 * error that reports every attempt once they have all failed.
 */

import type { Clock } from "../clock.js";
import { FloodgateError } from "../errors.js";
import { got, unknownOption } from "../validate.js";
import type { ResponseLike, RetryAttempt, RetryEvent, RetryOptions } from "./types.js";

/** `RetryOptions` with every default filled in. */
export interface RetryPolicy {
  retries: number;
  baseMs: number;
  maxMs: number;
  methods: ReadonlySet<string>;
  statuses: ReadonlySet<number>;
  networkErrors: boolean;
  random: () => number;
  onRetry: ((event: RetryEvent) => void) | undefined;
}

/**
 * Every attempt of a retried call failed. `attempts` lists each one's status (or error) in order;
 * `response` is the last attempt's response with its body unread, when it produced one, and
 * `cause` its error otherwise. `instanceof` works across two installed copies of floodgate.
 */
export class RetryError extends FloodgateError {
  static override readonly code = "RETRIES_EXHAUSTED" as const;

  readonly attempts: readonly RetryAttempt[];
  /** The last attempt's response, when it produced one. Its body has not been read. */
  readonly response: ResponseLike | undefined;
  /** The status of the last attempt, when it produced a response. */
  readonly status: number | undefined;

  constructor(message: string, attempts: readonly RetryAttempt[], response: ResponseLike | undefined) {
    const last = attempts[attempts.length - 1];
    super(
      "RETRIES_EXHAUSTED",
      message,
      response === undefined && last?.error !== undefined ? { cause: last.error } : {},
    );
    this.attempts = attempts;
    this.response = response;
    this.status = response?.status;
  }
}

const DEFAULT_METHODS = ["GET", "HEAD", "OPTIONS", "PUT", "DELETE"];
const DEFAULT_STATUSES = [429, 500, 502, 503, 504];
const RETRY_KEYS = new Set([
  "retries",
  "baseMs",
  "maxMs",
  "methods",
  "statuses",
  "networkErrors",
  "random",
  "onRetry",
]);

/**
 * Check a `retry` option; throws through `fail(field, message)`.
 * @internal
 */
export function checkRetry(
  value: unknown,
  field: string,
  fail: (field: string, message: string) => never,
): RetryOptions {
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    fail(field, `${field} must be an object, ${got(value)}`);
  }
  for (const k of Object.keys(value))
    if (!RETRY_KEYS.has(k)) fail(`${field}.${k}`, unknownOption(field, k, [...RETRY_KEYS], field));
  const r = value as RetryOptions;
  if (r.retries !== undefined && !(Number.isInteger(r.retries) && r.retries >= 0)) {
    fail(`${field}.retries`, `${field}.retries must be an integer >= 0, ${got(r.retries)}`);
  }
  for (const k of ["baseMs", "maxMs"] as const) {
    const v = r[k];
    if (v !== undefined && !(typeof v === "number" && Number.isFinite(v) && v >= 0)) {
      fail(`${field}.${k}`, `${field}.${k} must be a finite number >= 0, ${got(v)}`);
    }
  }
  if (
    r.methods !== undefined &&
    !(Array.isArray(r.methods) && r.methods.every((m) => typeof m === "string" && m.length > 0))
  ) {
    fail(`${field}.methods`, `${field}.methods must be an array of method names, ${got(r.methods)}`);
  }
  if (
    r.statuses !== undefined &&
    !(Array.isArray(r.statuses) && r.statuses.every((s) => Number.isInteger(s) && s >= 100 && s <= 999))
  ) {
    fail(`${field}.statuses`, `${field}.statuses must be an array of HTTP statuses, ${got(r.statuses)}`);
  }
  if (r.networkErrors !== undefined && typeof r.networkErrors !== "boolean") {
    fail(`${field}.networkErrors`, `${field}.networkErrors must be a boolean, ${got(r.networkErrors)}`);
  }
  for (const k of ["random", "onRetry"] as const) {
    const v = r[k];
    if (v !== undefined && typeof v !== "function") {
      fail(`${field}.${k}`, `${field}.${k} must be a function, ${got(v)}`);
    }
  }
  return r;
}

/**
 * The retry policy of a call: the wrapper's options with the call's own on top, or `undefined`
 * when the call is not retried.
 * @internal
 */
export function retryPolicy(
  base: RetryOptions | undefined,
  call: RetryOptions | false | undefined,
): RetryPolicy | undefined {
  if (call === false || (base === undefined && call === undefined)) return undefined;
  // A field the call leaves undefined keeps the wrapper's.
  const o: RetryOptions = { ...base };
  for (const [k, v] of Object.entries(call ?? {})) if (v !== undefined) (o as Record<string, unknown>)[k] = v;
  return {
    retries: o.retries ?? 2,
    baseMs: o.baseMs ?? 100,
    maxMs: o.maxMs ?? 10_000,
    methods: new Set((o.methods ?? DEFAULT_METHODS).map((m) => m.toUpperCase())),
    statuses: new Set(o.statuses ?? DEFAULT_STATUSES),
    networkErrors: o.networkErrors ?? true,
    random: o.random ?? Math.random,
    onRetry: o.onRetry,
  };
}

/**
 * Full-jitter exponential backoff before retry `n` (0 for the first):
 * `random() * min(maxMs, baseMs * 2 ** n)` milliseconds, rounded up to a whole millisecond.
 * A `random` outside [0, 1) is clamped into it.
 */
export function backoffMs(n: number, policy: Pick<RetryPolicy, "baseMs" | "maxMs" | "random">): number {
  const ceiling = Math.min(policy.maxMs, policy.baseMs * 2 ** n);
  const r = policy.random();
  const unit = Number.isFinite(r) ? Math.min(Math.max(r, 0), 1) : 0;
  return Math.ceil(unit * ceiling);
}

/**
 * Whether a call's body can be sent again: none, a string, an `ArrayBuffer` or typed array,
 * `URLSearchParams`, a `Blob` or `FormData`. A stream (or anything else) cannot, and neither can
 * a `Request` that carries its own body.
 * @internal
 */
export function replayable(input: unknown, init: Readonly<Record<string, unknown>> | undefined): boolean {
  const body = init?.body;
  if (body === undefined || body === null) {
    // A Request's body is a stream, read by the first attempt.
    const own = typeof input === "object" && input !== null ? (input as { body?: unknown }).body : undefined;
    return own === undefined || own === null;
  }
  return (
    typeof body === "string" ||
    body instanceof ArrayBuffer ||
    ArrayBuffer.isView(body) ||
    body instanceof URLSearchParams ||
    body instanceof Blob ||
    body instanceof FormData
  );
}

/** The method of a fetch call, uppercase: `init.method`, else a `Request`'s, else `GET`. */
export function methodOf(input: unknown, init: Readonly<Record<string, unknown>> | undefined): string {
  const own =
    typeof input === "object" && input !== null ? (input as { method?: unknown }).method : undefined;
  const method = init?.method ?? own;
  return typeof method === "string" && method.length > 0 ? method.toUpperCase() : "GET";
}

/**
 * Wait `ms` milliseconds on `clock`. Rejects with `signal.reason` as soon as `signal` aborts, and
 * leaves neither a timer nor a listener behind either way.
 * @internal
 */
export function sleep(clock: Clock, ms: number, signal: AbortSignal | undefined): Promise<void> {
  if (signal?.aborted) return Promise.reject(signal.reason);
  return new Promise<void>((resolve, reject) => {
    const onAbort = () => {
      clock.clearTimeout(timer);
      signal!.removeEventListener("abort", onAbort);
      reject(signal!.reason);
    };
    const timer = clock.setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/**
 * Attempts as a short list for a message: `503, 429, ECONNRESET`.
 * @internal
 */
export function describeAttempts(attempts: readonly RetryAttempt[]): string {
  return attempts
    .map((a) => {
      if (a.status !== undefined) return String(a.status);
      const e = a.error as { code?: unknown; cause?: { code?: unknown }; name?: unknown } | undefined;
      const code = e?.code ?? e?.cause?.code ?? e?.name;
      return typeof code === "string" ? code : "error";
    })
    .join(", ");
}
