/**
 * The types `floodgate/fetch` and `floodgate/undici` share and publish: headers and responses as
 * both read them, and the options of `wrapFetch`, its retries, its reserve and the interceptor.
 */
import type { Dispatcher } from "undici";
import type { Clock } from "../clock.js";
import type { Gate } from "../gate.js";

/** One header's value as fetch, undici and `node:http` give it. */
export type HeaderValue = string | readonly string[] | undefined;

/**
 * Response headers: a fetch `Headers` (anything with `get(name)`), or a plain record as undici's
 * handlers and `node:http` give them (lowercase names; a repeated header is an array).
 */
export type HeadersLike =
  | { get(name: string): string | null | undefined }
  | Readonly<Record<string, HeaderValue | number>>;

/** Which allowance a window counts. `general` is a header without a suffix. */
export type RateLimitWindowName = "requests" | "tokens" | "general";

/** One window a response reports: what is left of it and when it starts again. */
export interface RateLimitWindow {
  name: RateLimitWindowName;
  /** What the window allows in all (`x-ratelimit-limit-*`), when the response says. */
  limit: number | undefined;
  /** What is left of it (`x-ratelimit-remaining-*`). */
  remaining: number;
  /** Milliseconds until the window starts again (`x-ratelimit-reset-*`), when readable. */
  resetMs: number | undefined;
}

/**
 * How much of the provider's window to leave for other traffic. Give exactly one of `share` and
 * `remaining`.
 */
export interface ReserveOptions {
  /**
   * Share of each window to leave, between 0 and 1: with `x-ratelimit-limit-requests: 500` and
   * `share: 0.2`, the host pauses once 100 or fewer requests remain. Works only for windows whose
   * response also carries the limit; the others are left alone. `0` pauses only when a window is
   * empty.
   */
  share?: number;
  /**
   * What to leave, as a count of the window's unit (requests or tokens), or a function of the
   * window (its `name`, `limit` and `remaining`) returning that count. A count that is not a
   * finite number >= 0, or a function that throws, keeps no reserve for that window.
   */
  remaining?: number | ((window: Readonly<RateLimitWindow>) => number);
}

/** One status or error passed to `onRetry`, before the wait. */
export interface RetryEvent {
  /** Which retry comes next: 1 for the second attempt. */
  retry: number;
  /** How long the call waits before it, in milliseconds. */
  delayMs: number;
  /** The status of the attempt that failed, when it produced a response. */
  status?: number;
  /** The error of the attempt that failed, when it threw. */
  error?: unknown;
}

/**
 * Options for `retry` in `wrapFetch` (and per call in `init.floodgate.retry`). Every field is
 * optional; `retry: {}` turns retries on with the defaults.
 */
export interface RetryOptions {
  /** Attempts after the first. An integer >= 0; `0` makes one attempt. @default 2 */
  retries?: number;
  /**
   * Backoff before retry `n` (from 0) is `random() * min(maxMs, baseMs * 2 ** n)` milliseconds
   * ("full jitter"). A finite number >= 0. @default 100
   */
  baseMs?: number;
  /** Upper bound of one backoff, in milliseconds. A finite number >= 0. @default 10000 */
  maxMs?: number;
  /**
   * Methods that may be retried, in any case. Only idempotent ones by default; add `"POST"` for
   * an API whose POSTs are safe to repeat (an idempotency key).
   * @default ["GET", "HEAD", "OPTIONS", "PUT", "DELETE"]
   */
  methods?: readonly string[];
  /** Response statuses that are retried. @default [429, 500, 502, 503, 504] */
  statuses?: readonly number[];
  /**
   * Retry a network failure (refused, reset) or a timeout. The caller's abort, a refusal by the
   * gate and a name that did not resolve are never retried. @default true
   */
  networkErrors?: boolean;
  /** Random numbers in [0, 1) for the jitter. @default `Math.random` */
  random?: () => number;
  /**
   * Told about each retry before the wait. Throwing stops retrying: the call rejects with that
   * error.
   */
  onRetry?: (event: RetryEvent) => void;
}

/** One attempt of a call, as `RetryError.attempts` lists them. */
export interface RetryAttempt {
  /** The response's status, when the attempt produced one. */
  status?: number;
  /** The error, when the attempt threw. */
  error?: unknown;
  /** How long the call waited after this attempt before the next one, in milliseconds. */
  delayMs?: number;
}

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
   * The call's traffic class, for the stages of the gate built with classes (docs/classes.md).
   * @default the stages' `defaultClass`
   */
  class?: string;
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

/** What the interceptor needs of a gate: `admit` and `pause`. A `Gate` has both. */
export type InterceptorGate = Pick<Gate, "admit" | "pause"> & {
  readonly keyedBy?: "key" | "host" | undefined;
};

/**
 * Per-request admission options, given as `opts.floodgate` in the dispatch options. They override
 * what the interceptor derives; the field is removed before the request goes on.
 */
export interface DispatchCallOptions {
  /** Token bucket key. @default `options.key(opts)`, else the origin's host */
  key?: string;
  /** Host for interval gates and for the pause a Retry-After causes. @default the origin's host */
  host?: string;
  /** Weight of the request at every stage. An integer >= 0. @default 1 */
  cost?: number;
  /** Cost at each stage by stage name, overriding `cost` there. */
  costs?: Readonly<Record<string, number>>;
  /**
   * The call's traffic class, for the stages of the gate built with classes (docs/classes.md).
   * @default the stages' `defaultClass`
   */
  class?: string;
  /** Longest wait for admission, in milliseconds; `AdmitTimeoutError` after it. @default `options.timeoutMs` */
  timeoutMs?: number;
}

/** Dispatch options with floodgate's per-request field. */
export type FloodgateDispatchOptions = Dispatcher.DispatchOptions & {
  /** Admission options for this request, or `false` to send it without passing the gate. */
  floodgate?: DispatchCallOptions | false;
  /** undici's request API passes the caller's signal down with the dispatch options. */
  signal?: AbortSignal | NodeJS.EventEmitter | null;
};

/** Options for `floodgateInterceptor(gate, options)`. */
export interface InterceptorOptions {
  /**
   * The token bucket key of a request, from its dispatch options. Return `undefined` to use the
   * host. @default the origin's host
   */
  key?: (opts: Readonly<Dispatcher.DispatchOptions>) => string | undefined;
  /**
   * Longest wait for admission, in milliseconds, for requests that do not set their own. `0`
   * admits only when free right now; `Infinity` waits for ever. @default Infinity
   */
  timeoutMs?: number;
  /**
   * Longest pause, in milliseconds, one response's Retry-After (or reserve) may put on its host;
   * longer values are cut to it. `0` turns pausing off. A finite number >= 0.
   * @default 86400000 (a day)
   */
  maxPauseMs?: number;
  /**
   * Wall-clock time in epoch milliseconds, used only to turn a Retry-After date (or a reset
   * given as a moment) into a delay. @default `Date.now`, looked up at each response
   */
  now?: () => number;
  /**
   * Leave part of the provider's window to other traffic: when a response's
   * `x-ratelimit-remaining-*` is at or below the reserve, pause its host on the gate until the
   * matching `x-ratelimit-reset-*`. See `ReserveOptions`. @default no reserve
   */
  reserve?: ReserveOptions;
}
