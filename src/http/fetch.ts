/**
 * `wrapFetch`: a fetch-shaped function whose every request passes a gate, with retries, a
 * reserve of the provider's window and settling from the response.
 *
 * @module floodgate/fetch
 */
import { systemClock } from "../clock.js";
import { type FetchWrapper, fetchThrough, SPEC } from "./fetch-call.js";
import { checkGate, checkOptions, got, keyedGate } from "./options.js";
import { DEFAULT_MAX_PAUSE_MS } from "./pause.js";
import type { FetchGate, FetchLike, WrapFetchOptions, WrappedFetch } from "./types.js";

export { parseRateLimit, parseResetMs } from "./rate-limit.js";
export { backoffMs, RetryError } from "./retry.js";
export { parseRetryAfter } from "./retry-after.js";
export type {
  FetchCallOptions,
  FetchGate,
  FetchLike,
  FloodgateRequestInit,
  HeadersLike,
  HeaderValue,
  RateLimitWindow,
  RateLimitWindowName,
  ReserveOptions,
  ResponseLike,
  RetryAttempt,
  RetryEvent,
  RetryOptions,
  SettleValue,
  WrapFetchOptions,
  WrappedFetch,
} from "./types.js";

/**
 * Put a fetch function behind a gate. Each call waits for admission, is sent, and releases its
 * ticket when the response (its status and headers) arrives; reading the body is not held.
 *
 * - Host: `new URL(input).host` (for a `Request`, its `url`). Key: `options.key(url, init)`, else
 *   the host. `init.floodgate = { key, host, cost, costs, class, timeoutMs, retry }` overrides them for
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
  checkGate(SPEC, gate);
  if (fetchImpl !== undefined && typeof fetchImpl !== "function") {
    SPEC.fail("fetchImpl", `fetchImpl must be a function or undefined, ${got(fetchImpl)}`);
  }
  const o = checkOptions(SPEC, options) as WrapFetchOptions;
  const keyOf = o.key;
  const w: FetchWrapper = {
    gate,
    fetchImpl,
    keyOf,
    keyed: keyedGate(gate, keyOf, SPEC.fail),
    timeoutMs: o.timeoutMs,
    pause: { gate, maxPauseMs: o.maxPauseMs ?? DEFAULT_MAX_PAUSE_MS, reserve: o.reserve },
    now: o.now,
    clock: o.clock ?? gate.clock ?? systemClock,
    retry: o.retry,
    settle: o.settle as WrapFetchOptions["settle"],
  };
  const floodgateFetch = (input: unknown, init?: Record<string, unknown> | null) =>
    fetchThrough(w, input, init);
  return floodgateFetch as unknown as WrappedFetch<F>;
}
