import { InvalidOptionsError, isFloodgateError } from "../errors.js";
import type { Gate, Settled } from "../gate.js";
import type { Outcome } from "../types.js";
import { type HeadersLike, parseRetryAfter } from "./retry-after.js";

export { type HeadersLike, type HeaderValue, parseRetryAfter } from "./retry-after.js";

/** What `wrapFetch` needs of a gate: `run` and `pause`. A `Gate` has both. */
export type FetchGate = Pick<Gate, "run" | "pause">;

/** The part of a response the wrapper reads. */
export interface ResponseLike {
  status: number;
  headers: HeadersLike;
}

/** Any fetch-shaped function: `globalThis.fetch`, undici's `fetch`, a test double. */
export type FetchLike = (input: any, init?: any) => Promise<ResponseLike>;

/**
 * Per-call admission options, given as `init.floodgate`. They override what `wrapFetch` derives
 * from the URL and its options; the field is removed before the call reaches the fetch function.
 */
export interface FetchCallOptions {
  /** Token bucket key. @default `options.key(url, init)`, else the URL's host */
  key?: string;
  /** Host for interval gates and for the pause a Retry-After causes. @default the URL's host (`new URL(input).host`) */
  host?: string;
  /** Weight of the call at every stage. An integer >= 0. @default 1 */
  cost?: number;
  /** Cost at each stage by stage name, overriding `cost` there. */
  costs?: Readonly<Record<string, number>>;
  /** Longest wait for admission, in milliseconds; `AdmitTimeoutError` after it. @default `options.timeoutMs` */
  timeoutMs?: number;
}

/** The `init` a wrapped fetch takes: the fetch function's own, plus `floodgate`. */
export type FloodgateRequestInit<Init> = (Init extends object ? Init : {}) & {
  /** Admission options for this call, or `false` to send it without passing the gate. */
  floodgate?: FetchCallOptions | false;
};

/** A fetch function behind a gate: same arguments (plus `init.floodgate`), same result. */
export type WrappedFetch<F extends FetchLike> = (
  input: Parameters<F>[0],
  init?: FloodgateRequestInit<NonNullable<Parameters<F>[1]>>,
) => ReturnType<F>;

/** Options for `wrapFetch(gate, fetchImpl, options)`. */
export interface WrapFetchOptions {
  /**
   * The token bucket key of a call, from its URL and `init`. Return `undefined` to use the host.
   * @default the URL's host
   */
  key?: (url: URL, init: Readonly<Record<string, unknown>> | undefined) => string | undefined;
  /**
   * Longest wait for admission, in milliseconds, for calls that do not set their own. `0` admits
   * only when free right now; `Infinity` waits for ever. @default Infinity
   */
  timeoutMs?: number;
  /**
   * Longest pause, in milliseconds, one response's Retry-After may put on its host; longer values
   * are cut to it. `0` turns pausing off. A finite number >= 0. @default 86400000 (a day)
   */
  maxPauseMs?: number;
  /**
   * Wall-clock time in epoch milliseconds, used only to turn a Retry-After date into a delay.
   * @default `Date.now`, looked up at each call
   */
  now?: () => number;
}

const DEFAULT_MAX_PAUSE_MS = 86_400_000;
const OPTION_KEYS = new Set(["key", "timeoutMs", "maxPauseMs", "now"]);
const CALL_KEYS = new Set(["key", "host", "cost", "costs", "timeoutMs"]);
/** Failures that say nothing about the server: the name did not resolve. */
const DNS_CODES = new Set(["ENOTFOUND", "EAI_AGAIN", "EAI_NONAME", "EAI_FAIL"]);
const TIMEOUT_CODES = new Set([
  "ETIMEDOUT",
  "ESOCKETTIMEDOUT",
  "UND_ERR_CONNECT_TIMEOUT",
  "UND_ERR_HEADERS_TIMEOUT",
  "UND_ERR_BODY_TIMEOUT",
]);

function fail(field: string, message: string): never {
  throw new InvalidOptionsError(undefined, field, `wrapFetch: ${message}`);
}

function show(value: unknown): string {
  if (typeof value === "string") return JSON.stringify(value);
  if (typeof value === "function") return "a function";
  if (typeof value === "object" && value !== null) return Array.isArray(value) ? "an array" : "an object";
  return String(value);
}

function checkOptions(gate: unknown, fetchImpl: unknown, options: unknown): WrapFetchOptions {
  const g = gate as Partial<FetchGate> | null | undefined;
  if (typeof g !== "object" || g === null || typeof g.run !== "function" || typeof g.pause !== "function") {
    fail("gate", `gate must be a Gate (an object with run and pause) (got ${show(gate)})`);
  }
  if (fetchImpl !== undefined && typeof fetchImpl !== "function") {
    fail("fetchImpl", `fetchImpl must be a function or undefined (got ${show(fetchImpl)})`);
  }
  if (options === undefined) return {};
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    fail("options", `options must be an object (got ${show(options)})`);
  }
  for (const k of Object.keys(options)) if (!OPTION_KEYS.has(k)) fail(k, `unknown option "${k}"`);
  const o = options as WrapFetchOptions;
  if (o.key !== undefined && typeof o.key !== "function") {
    fail("key", `key must be a function (url, init) => string | undefined (got ${show(o.key)})`);
  }
  if (o.timeoutMs !== undefined && !(typeof o.timeoutMs === "number" && o.timeoutMs >= 0)) {
    fail("timeoutMs", `timeoutMs must be a number >= 0 or Infinity (got ${show(o.timeoutMs)})`);
  }
  if (
    o.maxPauseMs !== undefined &&
    !(typeof o.maxPauseMs === "number" && o.maxPauseMs >= 0 && Number.isFinite(o.maxPauseMs))
  ) {
    fail("maxPauseMs", `maxPauseMs must be a finite number >= 0 (got ${show(o.maxPauseMs)})`);
  }
  if (o.now !== undefined && typeof o.now !== "function") {
    fail("now", `now must be a function returning epoch milliseconds (got ${show(o.now)})`);
  }
  return o;
}

function checkCall(call: unknown): FetchCallOptions | false {
  if (call === undefined || call === false) return call === false ? false : {};
  if (typeof call !== "object" || call === null || Array.isArray(call)) {
    fail("floodgate", `init.floodgate must be an object or false (got ${show(call)})`);
  }
  for (const k of Object.keys(call))
    if (!CALL_KEYS.has(k)) fail(`floodgate.${k}`, `unknown option "floodgate.${k}"`);
  const c = call as FetchCallOptions;
  for (const k of ["key", "host"] as const) {
    const v = c[k];
    if (v !== undefined && !(typeof v === "string" && v.length > 0)) {
      fail(`floodgate.${k}`, `init.floodgate.${k} must be a non-empty string (got ${show(v)})`);
    }
  }
  // cost, costs and timeoutMs are checked by the gate, which names the field.
  return c;
}

/** The URL a fetch call goes to: a string, a `URL`, or a `Request` (its `url`). */
function urlOf(input: unknown): URL {
  if (input instanceof URL) return input;
  if (typeof input === "object" && input !== null && typeof (input as { url?: unknown }).url === "string") {
    return new URL((input as { url: string }).url);
  }
  return new URL(String(input));
}

/** The signal that cancels a call: `init.signal`, else a `Request`'s own. */
function signalOf(input: unknown, init: Record<string, unknown> | undefined): AbortSignal | undefined {
  const s =
    init?.signal ?? (typeof input === "object" && input !== null ? (input as Request).signal : undefined);
  return s instanceof AbortSignal ? s : undefined;
}

/** The `code` of an error or of any error in its `cause` chain. */
function codeOf(error: unknown): string | undefined {
  for (let e = error, depth = 0; typeof e === "object" && e !== null && depth < 5; depth++) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === "string") return code;
    e = (e as { cause?: unknown }).cause;
  }
  return undefined;
}

/**
 * The outcome of a fetch call that threw. A timeout (`TimeoutError`, a timeout code) and a
 * network failure (an error carrying a `cause` or a system `code`: refused, reset) are
 * `dropped`. The caller's abort, a floodgate error from a gate further in, a name that did not
 * resolve and other errors (a bug) are `ignored`.
 */
function errorOutcome(error: unknown, signal: AbortSignal | undefined): Outcome {
  if (typeof error !== "object" || error === null) return "ignored";
  const { name, cause } = error as { name?: unknown; cause?: unknown };
  const code = codeOf(error);
  if (name === "TimeoutError" || (code !== undefined && TIMEOUT_CODES.has(code))) return "dropped";
  if (name === "AbortError" || (signal?.aborted && error === signal.reason)) return "ignored";
  // A gate further in (a nested wrapped fetch) refused the call: that says nothing about the server.
  if (isFloodgateError(error)) return "ignored";
  if (code !== undefined) return DNS_CODES.has(code) ? "ignored" : "dropped";
  return cause !== undefined ? "dropped" : "ignored";
}

/** 429 and 503 are `dropped` (the server is overloaded); any other response is `success`. */
function classify(settled: Settled<ResponseLike>, signal: AbortSignal | undefined): Outcome {
  if (!settled.ok) return errorOutcome(settled.error, signal);
  const status = settled.value.status;
  return status === 429 || status === 503 ? "dropped" : "success";
}

/**
 * Put a fetch function behind a gate. Each call waits for admission, is sent, and releases its
 * ticket when the response (its status and headers) arrives; reading the body is not held.
 *
 * - Host: `new URL(input).host` (for a `Request`, its `url`). Key: `options.key(url, init)`, else
 *   the host. `init.floodgate = { key, host, cost, costs, timeoutMs }` overrides them for one
 *   call, and `init.floodgate = false` sends the call without the gate. `init.floodgate` is
 *   removed before `fetchImpl` sees `init`.
 * - Cancelling: `init.signal` (else a `Request`'s signal) aborts the wait for admission, leaving
 *   nothing held, and is passed to `fetchImpl` as usual, so it aborts the call in flight too.
 *   Either way the call rejects with `signal.reason` unchanged.
 * - Outcomes: 429 and 503 responses, timeouts and network failures (refused, reset) release as
 *   `dropped`; other responses as `success`; an abort, a refusal by a gate further in, a name
 *   that did not resolve and any other error as `ignored`.
 * - Retry-After: a response carrying `retry-after` (seconds or HTTP date) or `retry-after-ms`
 *   pauses its host on every interval gate of `gate` (`gate.pause(host, ms)`, at most
 *   `maxPauseMs`) before the response is returned. A pause that fails (Redis unreachable) does
 *   not fail the call.
 *
 * ```ts
 * const gatedFetch = wrapFetch(gate);
 * const res = await gatedFetch("https://api.example.com/v1/items", { signal, floodgate: { cost: 2 } });
 * ```
 *
 * @param gate a `Gate` (anything with `run` and `pause`).
 * @param fetchImpl the fetch function to call. @default `globalThis.fetch`, looked up at each call
 * @param options see `WrapFetchOptions`.
 * @throws InvalidOptionsError naming the field, at once, when an argument or option is invalid.
 *   A call rejects with `InvalidOptionsError` when its `init.floodgate` is invalid, with
 *   `AdmitTimeoutError`, `ShedError` or `ClosedError` when the gate refuses it, and otherwise as
 *   `fetchImpl` does.
 */
export function wrapFetch<F extends FetchLike = typeof globalThis.fetch>(
  gate: FetchGate,
  fetchImpl?: F,
  options?: WrapFetchOptions,
): WrappedFetch<F> {
  const o = checkOptions(gate, fetchImpl, options);
  const keyOf = o.key;
  const defaultTimeoutMs = o.timeoutMs;
  const maxPauseMs = o.maxPauseMs ?? DEFAULT_MAX_PAUSE_MS;
  const wallNow = o.now;

  async function floodgateFetch(input: unknown, init?: Record<string, unknown>): Promise<ResponseLike> {
    const call = checkCall(init?.floodgate);
    let sendInit = init;
    if (init && "floodgate" in init) {
      const { floodgate: _, ...rest } = init;
      sendInit = rest;
    }
    const send = (): Promise<ResponseLike> => {
      const f = (fetchImpl ?? globalThis.fetch) as FetchLike;
      return sendInit === undefined ? f(input) : f(input, sendInit);
    };
    if (call === false) return send();
    const url = urlOf(input);
    const host = call.host ?? (url.host || undefined);
    const key = call.key ?? keyOf?.(url, sendInit) ?? host;
    const signal = signalOf(input, init);
    return gate.run(
      async () => {
        const response = await send();
        const ms =
          maxPauseMs > 0 && host
            ? parseRetryAfter(response.headers, wallNow ? wallNow() : Date.now())
            : undefined;
        if (ms !== undefined && ms > 0) {
          try {
            await gate.pause(host!, Math.min(ms, maxPauseMs));
          } catch {
            // The response matters more than the pause: a failed pause does not fail the call.
          }
        }
        return response;
      },
      {
        key,
        host,
        cost: call.cost,
        costs: call.costs,
        timeoutMs: call.timeoutMs ?? defaultTimeoutMs,
        signal,
        classify: (settled) => classify(settled, signal),
      },
    );
  }

  return floodgateFetch as unknown as WrappedFetch<F>;
}
