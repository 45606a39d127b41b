/**
 * `wrapFetch`: a fetch-shaped function whose every request passes a gate, with retries, a
 * reserve of the provider's window and settling from the response.
 *
 * @module floodgate/fetch
 */
import { fetchErrorOutcome as errorOutcome, statusOutcome } from "../base/classify.js";
import { type Clock, systemClock } from "../clock.js";
import { InvalidOptionsError, isFloodgateError } from "../errors.js";
import type { Gate, Settled } from "../gate.js";
import type { Outcome, Ticket } from "../types.js";
import { isArray } from "../validate.js";
import { checkReserve, parseRateLimit, type ReserveOptions, reservePauseMs } from "./rate-limit.js";
import {
  backoffMs,
  checkRetry,
  describeAttempts,
  methodOf,
  type RetryAttempt,
  RetryError,
  type RetryOptions,
  type RetryPolicy,
  replayable,
  retryPolicy,
  sleep,
} from "./retry.js";
import { type HeadersLike, parseRetryAfter } from "./retry-after.js";
import { checkCallShape, got, keyedGate, readingOptions, show } from "./show.js";

export {
  parseRateLimit,
  parseResetMs,
  type RateLimitWindow,
  type RateLimitWindowName,
  type ReserveOptions,
} from "./rate-limit.js";
export {
  backoffMs,
  type RetryAttempt,
  RetryError,
  type RetryEvent,
  type RetryOptions,
} from "./retry.js";
export { type HeadersLike, type HeaderValue, parseRetryAfter } from "./retry-after.js";

/** What `wrapFetch` needs of a gate: `run` and `pause` (and its `clock`, when it has one). */
export type FetchGate = Pick<Gate, "run" | "pause"> & {
  readonly clock?: Clock;
  readonly keyedBy?: "key" | "host" | undefined;
};

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
  /**
   * Longest wait for admission, in milliseconds; `AdmitTimeoutError` after it. With retries, each
   * attempt's admission gets this long. @default `options.timeoutMs`
   */
  timeoutMs?: number;
  /**
   * Retries for this call: fields here override `options.retry` (and turn retries on when the
   * wrapper has none); `false` sends the call once. @default `options.retry`
   */
  retry?: RetryOptions | false;
}

/** What `settle` returns: the call's actual cost, for every stage or by stage name; `undefined` keeps the estimate. */
export type SettleValue = number | Readonly<Record<string, number>> | undefined;

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

/** Options for `wrapFetch(gate, fetchImpl, options)`; `R` is the fetch function's response type. */
export interface WrapFetchOptions<R extends ResponseLike = ResponseLike> {
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
   * Longest pause, in milliseconds, one response's Retry-After (or reserve) may put on its host,
   * and longest wait before a retry that Retry-After asks for; longer values are cut to it. `0`
   * turns pausing off, and retries then wait the backoff whatever Retry-After says. A finite
   * number >= 0. @default 86400000 (a day)
   */
  maxPauseMs?: number;
  /**
   * Wall-clock time in epoch milliseconds, used only to turn a Retry-After date (or a reset
   * given as a moment) into a delay. @default `Date.now`, looked up at each call
   */
  now?: () => number;
  /**
   * The clock the waits between retries run on.
   * @default the gate's clock (a `FakeClock` in tests), else `systemClock`
   */
  clock?: Clock;
  /**
   * Retry failed calls (opt-in): 429, 500, 502, 503 and 504 responses and network failures, for
   * GET, HEAD, OPTIONS, PUT and DELETE, with full-jitter exponential backoff; Retry-After, when
   * present, sets the wait instead. Each attempt passes the gate again. See `RetryOptions`.
   * @default no retries
   */
  retry?: RetryOptions;
  /**
   * Leave part of the provider's window to other traffic: when a response's
   * `x-ratelimit-remaining-*` is at or below the reserve, pause its host on the gate until the
   * matching `x-ratelimit-reset-*`. See `ReserveOptions`. @default no reserve
   */
  reserve?: ReserveOptions;
  /**
   * Reserve, then settle: the call's actual cost once its response is in, settled on the ticket
   * (`ticket.settle`) before it is released. Return a number to settle every stage, a record by
   * stage name (`{ tpm: usage.total_tokens }`) to settle those stages, or `undefined` to keep
   * the estimate. It may read a clone of the body (`await response.clone().json()`); the ticket
   * is held until it resolves. Called for every attempt.
   */
  settle?: (response: R, url: URL) => SettleValue | PromiseLike<SettleValue>;
}

const DEFAULT_MAX_PAUSE_MS = 86_400_000;
const OPTION_KEYS = new Set(["key", "timeoutMs", "maxPauseMs", "now", "clock", "retry", "reserve", "settle"]);
const CALL_KEYS = new Set(["key", "host", "cost", "costs", "timeoutMs", "retry"]);

function fail(field: string, message: string): never {
  throw new InvalidOptionsError(undefined, field, `wrapFetch: ${message}`);
}

/** Whether `g` has the methods a gate needs here (`run` or `admit`, and `pause`). */
function isGate(g: unknown, method: "run" | "admit"): boolean {
  if (typeof g !== "object" || g === null) return false;
  const o = g as Record<string, unknown>;
  return typeof o[method] === "function" && typeof o.pause === "function";
}

function checkOptions(gate: unknown, fetchImpl: unknown, options: unknown): WrapFetchOptions {
  const g = gate as Partial<FetchGate> | null | undefined;
  if (!readingOptions("gate", "gate", fail, () => isGate(g, "run"))) {
    fail("gate", `gate must be a Gate (an object with run and pause), ${got(gate)}`);
  }
  if (fetchImpl !== undefined && typeof fetchImpl !== "function") {
    fail("fetchImpl", `fetchImpl must be a function or undefined, ${got(fetchImpl)}`);
  }
  if (options === undefined) return {};
  if (typeof options !== "object" || options === null || isArray(options)) {
    fail("options", `options must be an object, ${got(options)}`);
  }
  return readingOptions("options", "options", fail, () => checkFields(options));
}

/** Check each option, reading each once into a copy (a getter is not read again later). */
function checkFields(options: object): WrapFetchOptions {
  const o: Record<string, unknown> = {};
  for (const k of Object.keys(options)) {
    if (!OPTION_KEYS.has(k)) fail(k, `unknown option "${k}"`);
    o[k] = (options as Record<string, unknown>)[k];
  }
  return checkValues(o as WrapFetchOptions);
}

function checkValues(o: WrapFetchOptions): WrapFetchOptions {
  if (o.key !== undefined && typeof o.key !== "function") {
    fail("key", `key must be a function (url, init) => string | undefined, ${got(o.key)}`);
  }
  if (o.timeoutMs !== undefined && !(typeof o.timeoutMs === "number" && o.timeoutMs >= 0)) {
    fail("timeoutMs", `timeoutMs must be a number >= 0 or Infinity, ${got(o.timeoutMs)}`);
  }
  if (
    o.maxPauseMs !== undefined &&
    !(typeof o.maxPauseMs === "number" && o.maxPauseMs >= 0 && Number.isFinite(o.maxPauseMs))
  ) {
    fail("maxPauseMs", `maxPauseMs must be a finite number >= 0, ${got(o.maxPauseMs)}`);
  }
  if (o.now !== undefined && typeof o.now !== "function") {
    fail("now", `now must be a function returning epoch milliseconds, ${got(o.now)}`);
  }
  const c = o.clock as Partial<Clock> | undefined;
  if (
    c !== undefined &&
    !(
      typeof c === "object" &&
      c !== null &&
      typeof c.now === "function" &&
      typeof c.setTimeout === "function" &&
      typeof c.clearTimeout === "function"
    )
  ) {
    fail("clock", `clock must be a Clock (now, setTimeout, clearTimeout), ${got(o.clock)}`);
  }
  if (o.retry !== undefined) checkRetry(o.retry, "retry", fail);
  if (o.reserve !== undefined) checkReserve(o.reserve, "reserve", fail);
  if (o.settle !== undefined && typeof o.settle !== "function") {
    fail("settle", `settle must be a function (response, url) => cost, ${got(o.settle)}`);
  }
  return o;
}

function checkCall(call: unknown): FetchCallOptions | false {
  const c = checkCallShape(call, "init", CALL_KEYS, fail) as FetchCallOptions | false;
  if (c === false) return false;
  const retry = c.retry;
  if (retry !== undefined && retry !== false) {
    readingOptions("floodgate.retry", "init.floodgate.retry", fail, () =>
      checkRetry(retry, "floodgate.retry", fail),
    );
  }
  // cost, costs and timeoutMs are checked by the gate, which names the field.
  return c;
}

/** What a call's `init` says, read once: its floodgate options, the rest to send, signal, method, body. */
function readInit(input: unknown, given: unknown) {
  // `null` is no init, as fetch takes it; anything else that is not an object is refused.
  const init = given === null ? undefined : given;
  if (init !== undefined && (typeof init !== "object" || isArray(init))) {
    fail("init", `init must be an object, ${got(init)}`);
  }
  return readingOptions("init", "init", fail, () => {
    const i = init as Record<string, unknown> | undefined;
    const call = checkCall(i?.floodgate);
    let sendInit = i;
    if (i && "floodgate" in i) {
      const { floodgate: _, ...rest } = i;
      sendInit = rest;
    }
    return {
      call,
      sendInit,
      signal: signalOf(input, i),
      method: methodOf(input, sendInit),
      canReplay: replayable(input, sendInit),
    };
  });
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

/** What one attempt gives the retry loop: the response and how long its Retry-After asks to wait. */
interface Sent {
  response: ResponseLike;
  retryAfterMs: number | undefined;
}

function classify(settled: Settled<Sent>, signal: AbortSignal | undefined): Outcome {
  return settled.ok ? statusOutcome(settled.value.response.status) : errorOutcome(settled.error, signal);
}

const noop = () => {};

/** Let go of a response nobody will read, so its connection goes back to the pool. */
function discard(response: ResponseLike): void {
  const body = (response as { body?: { cancel?: unknown } | null }).body;
  if (typeof body?.cancel !== "function") return;
  try {
    (body.cancel as () => Promise<void>).call(body).catch(noop);
  } catch {
    // A body already locked by a reader is that reader's to finish.
  }
}

function isCount(n: unknown): boolean {
  return typeof n === "number" && Number.isInteger(n) && n >= 0;
}

/** Check what `settle` returned; a record is copied, so what is checked is what is settled. */
function checkSettled(value: unknown): SettleValue {
  if (value === undefined || isCount(value)) return value as SettleValue;
  const rule = "settle must return an integer >= 0, a record of them by stage name, or undefined";
  if (typeof value !== "object" || value === null || isArray(value)) fail("settle", `${rule}, ${got(value)}`);
  return readingOptions("settle", "what settle returned", fail, () => {
    const entries = Object.entries(value);
    if (entries.every(([, v]) => isCount(v))) return Object.fromEntries(entries) as SettleValue;
    const shown = `{ ${entries.map(([k, v]) => `${k}: ${show(v)}`).join(", ")} }`;
    return fail("settle", `${rule}, got ${shown}`);
  });
}

/**
 * Put a fetch function behind a gate. Each call waits for admission, is sent, and releases its
 * ticket when the response (its status and headers) arrives; reading the body is not held.
 *
 * - Host: `new URL(input).host` (for a `Request`, its `url`). Key: `options.key(url, init)`, else
 *   the host. `init.floodgate = { key, host, cost, costs, timeoutMs, retry }` overrides them for
 *   one call, and `init.floodgate = false` sends the call without the gate. `init.floodgate` is
 *   removed before `fetchImpl` sees `init`.
 * - Cancelling: `init.signal` (else a `Request`'s signal) aborts the wait for admission, leaving
 *   nothing held, the call in flight (it is passed to `fetchImpl` as usual) and the wait between
 *   retries. Each way the call rejects with `signal.reason` unchanged.
 * - Outcomes: 429 and 503 responses, timeouts and network failures (refused, reset) release as
 *   `dropped`; other responses as `success`; an abort, a refusal by a gate further in, a name
 *   that did not resolve and any other error as `ignored`.
 * - Retry-After: a response carrying `retry-after` (seconds or HTTP date) or `retry-after-ms`
 *   pauses its host on every interval gate of `gate` (`gate.pause(host, ms)`, at most
 *   `maxPauseMs`) before the response is returned. With `options.reserve`, so does a response
 *   whose rate-limit headers say the window is down to the reserve, until the window resets. A
 *   pause that fails (Redis unreachable) does not fail the call.
 * - Settling: with `options.settle`, the response's actual cost is settled on the ticket before
 *   it is released. A settle the backend cannot carry out (Redis unreachable) keeps the estimate
 *   and does not fail the call; an error thrown by `settle` itself, or a value that is not a cost,
 *   rejects the call (after the ticket is released with the response's outcome).
 * - Retries (with `options.retry` or `init.floodgate.retry`): a call whose method is retried and
 *   whose body can be sent again (none, a string, bytes, `URLSearchParams`, `Blob`, `FormData`;
 *   never a stream) is sent again after a 429, 500, 502, 503 or 504, a network failure or a
 *   timeout. Each attempt is a fresh `gate.run`: it waits for admission again and holds nothing
 *   while waiting to retry. The wait is Retry-After's (cut to `maxPauseMs`) when the response has
 *   one, else `random() * min(maxMs, baseMs * 2 ** n)` before retry `n` (from 0), on
 *   `options.clock`. A call that is not retried (another method, a stream body) is sent once, as
 *   without the option. When the last attempt fails too, the call rejects with `RetryError`,
 *   which lists every attempt's status or error and holds the last response, body unread.
 *
 * ```ts
 * const gatedFetch = wrapFetch(gate, fetch, { retry: { retries: 3 }, reserve: { share: 0.2 } });
 * const res = await gatedFetch("https://api.example.com/v1/items", { signal, floodgate: { cost: 2 } });
 * ```
 *
 * @param gate a `Gate` (anything with `run` and `pause`).
 * @param fetchImpl the fetch function to call. @default `globalThis.fetch`, looked up at each call
 * @param options see `WrapFetchOptions`.
 * @throws InvalidOptionsError naming the field, at once, when an argument or option is invalid.
 *   A call rejects with `InvalidOptionsError` when its `init.floodgate` is invalid or `settle`
 *   returns something that is not a cost, with `AdmitTimeoutError`, `ShedError` or `ClosedError`
 *   when the gate refuses it (on any attempt), with `RetryError` when every attempt failed, and
 *   otherwise as `fetchImpl` does.
 */
export function wrapFetch(
  gate: FetchGate,
  fetchImpl?: undefined,
  options?: WrapFetchOptions<Response>,
): WrappedFetch<typeof globalThis.fetch>;
export function wrapFetch<F extends FetchLike = typeof globalThis.fetch>(
  gate: FetchGate,
  fetchImpl?: F,
  options?: WrapFetchOptions<Awaited<ReturnType<F>>>,
): WrappedFetch<F>;
export function wrapFetch<F extends FetchLike>(
  gate: FetchGate,
  fetchImpl?: F,
  options?: WrapFetchOptions<Awaited<ReturnType<F>>>,
): WrappedFetch<F> {
  const o = checkOptions(gate, fetchImpl, options);
  const keyOf = o.key;
  // A call's key is derived (from options.key, else the host) only for a gate keyed by it.
  const keyed = keyedGate(gate, keyOf, fail);
  const defaultTimeoutMs = o.timeoutMs;
  const maxPauseMs = o.maxPauseMs ?? DEFAULT_MAX_PAUSE_MS;
  const wallNow = o.now;
  const clock = o.clock ?? gate.clock ?? systemClock;
  const reserve = o.reserve;
  const settle = o.settle as WrapFetchOptions["settle"];

  /** Pause `host` for as long as the response asks (Retry-After, or the reserve's reset). */
  async function pauseFor(
    host: string,
    response: ResponseLike,
    retryAfterMs: number | undefined,
    wall: number,
  ) {
    let ms = retryAfterMs;
    if (reserve) {
      const reset = reservePauseMs(parseRateLimit(response.headers, wall), reserve);
      if (reset !== undefined && (ms === undefined || reset > ms)) ms = reset;
    }
    if (ms === undefined || ms <= 0) return;
    try {
      await gate.pause(host, Math.min(ms, maxPauseMs));
    } catch {
      // The response matters more than the pause: a failed pause does not fail the call.
    }
  }

  /** Settle the ticket from the response; only the backend failing to do it is forgiven. */
  async function settleFrom(ticket: Ticket, response: ResponseLike, url: URL): Promise<void> {
    const returned = settle!(response, url);
    // A returned value whose `then` cannot even be read is not a cost (a Proxy, revoked or not).
    if (typeof returned === "object" && returned !== null) {
      readingOptions("settle", "what settle returned", fail, () => (returned as { then?: unknown }).then);
    }
    const actual = checkSettled(await returned);
    if (actual === undefined) return;
    try {
      await ticket.settle(actual);
    } catch (error) {
      if (isFloodgateError(error, "INVALID_OPTIONS")) throw error;
      // The backend could not settle (Redis unreachable): the estimate stands.
    }
  }

  async function floodgateFetch(
    input: unknown,
    given?: Record<string, unknown> | null,
  ): Promise<ResponseLike> {
    const { call, sendInit, signal, method, canReplay } = readInit(input, given);
    const send = (): Promise<ResponseLike> => {
      const f = (fetchImpl ?? globalThis.fetch) as FetchLike;
      return sendInit === undefined ? f(input) : f(input, sendInit);
    };
    if (call === false) return send();
    const url = urlOf(input);
    const host = call.host ?? (url.host || undefined);
    const key = call.key ?? (keyed ? (keyOf?.(url, sendInit) ?? host) : undefined);

    const attempt = async (ticket: Ticket): Promise<Sent> => {
      const response = await send();
      // What the server said decides the outcome, whatever happens after.
      ticket.record(statusOutcome(response.status));
      const wall = wallNow ? wallNow() : Date.now();
      const retryAfterMs = parseRetryAfter(response.headers, wall);
      if (maxPauseMs > 0 && host) await pauseFor(host, response, retryAfterMs, wall);
      if (settle) {
        try {
          await settleFrom(ticket, response, url);
        } catch (error) {
          discard(response);
          throw error;
        }
      }
      return { response, retryAfterMs };
    };
    const runOnce = () =>
      gate.run(attempt, {
        key,
        host,
        cost: call.cost,
        costs: call.costs,
        timeoutMs: call.timeoutMs ?? defaultTimeoutMs,
        signal,
        classify: (settled) => classify(settled, signal),
      });

    const policy = retryPolicy(o.retry, call.retry);
    if (!policy?.methods.has(method) || !canReplay) {
      return (await runOnce()).response;
    }
    return retrying(policy, runOnce, signal, `${method} ${url.origin}${url.pathname}`);
  }

  /** Run attempts until one succeeds, one fails in a way not retried, or retries run out. */
  async function retrying(
    policy: RetryPolicy,
    runOnce: () => Promise<Sent>,
    signal: AbortSignal | undefined,
    what: string,
  ): Promise<ResponseLike> {
    const attempts: RetryAttempt[] = [];
    for (let n = 0; ; n++) {
      let sent: Sent | undefined;
      let error: unknown;
      try {
        sent = await runOnce();
      } catch (e) {
        // Admission refused, the caller's abort, a bug: not the server's doing, so not retried.
        if (!policy.networkErrors || signal?.aborted || errorOutcome(e, signal) !== "dropped") throw e;
        error = e;
      }
      const status = sent?.response.status;
      if (sent && !policy.statuses.has(sent.response.status)) return sent.response;
      const failed: RetryAttempt = sent ? { status } : { error };
      attempts.push(failed);
      if (n >= policy.retries) {
        throw new RetryError(
          `wrapFetch: ${what} failed after ${attempts.length} attempt${attempts.length === 1 ? "" : "s"} (${describeAttempts(attempts)})`,
          attempts,
          sent?.response,
        );
      }
      const retryAfterMs = sent?.retryAfterMs;
      const delayMs =
        retryAfterMs !== undefined && maxPauseMs > 0
          ? Math.min(retryAfterMs, maxPauseMs)
          : backoffMs(n, policy);
      failed.delayMs = delayMs;
      if (sent) discard(sent.response);
      policy.onRetry?.(sent ? { retry: n + 1, delayMs, status } : { retry: n + 1, delayMs, error });
      await sleep(clock, delayMs, signal);
    }
  }

  return floodgateFetch as unknown as WrappedFetch<F>;
}
