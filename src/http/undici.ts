/**
 * `floodgateInterceptor`: an undici interceptor that passes every request through a gate.
 *
 * @module floodgate/undici
 */
import type { Dispatcher } from "undici";
import type { AdmitOptions, Ticket } from "../types.js";
import { Admitted, gateHandler, refuse, waitSignal } from "./handlers.js";
import { checkCall, checkGate, checkOptions, keyedGate, specNamed, type WrapperSpec } from "./options.js";
import { DEFAULT_MAX_PAUSE_MS, type HostPause } from "./pause.js";
import type {
  DispatchCallOptions,
  FloodgateDispatchOptions,
  InterceptorGate,
  InterceptorOptions,
} from "./types.js";

export { parseRateLimit, parseResetMs } from "./rate-limit.js";
export { parseRetryAfter } from "./retry-after.js";
export type {
  DispatchCallOptions,
  FloodgateDispatchOptions,
  HeadersLike,
  HeaderValue,
  InterceptorGate,
  InterceptorOptions,
  RateLimitWindow,
  RateLimitWindowName,
  ReserveOptions,
} from "./types.js";

type Handler = Dispatcher.DispatchHandler;

const SPEC: WrapperSpec = {
  ...specNamed("floodgateInterceptor"),
  method: "admit",
  options: new Set(["key", "timeoutMs", "maxPauseMs", "now", "reserve"]),
  keyArgs: "(opts)",
  where: "opts",
  callKeys: new Set(["key", "host", "cost", "costs", "class", "timeoutMs"]),
};
const noop = () => {};

/** The host of a dispatch's origin (`string | URL`), or undefined when it has none. */
function hostOf(origin: unknown): string | undefined {
  if (origin instanceof URL) return origin.host || undefined;
  if (typeof origin !== "string" || origin.length === 0) return undefined;
  try {
    return new URL(origin).host || undefined;
  } catch {
    return undefined;
  }
}

/**
 * An undici interceptor that passes every request through `gate`, for `Dispatcher.compose`:
 *
 * ```ts
 * import { Agent, interceptors, request } from "undici";
 * const dispatcher = new Agent().compose(floodgateInterceptor(gate), interceptors.retry());
 * await request("https://api.example.com/v1/items", { dispatcher, signal });
 * ```
 *
 * `compose` calls the last interceptor first, so with `compose(floodgateInterceptor(gate),
 * interceptors.retry())` every retry attempt passes the gate again, and holds a ticket only while
 * it is in flight. Put the gate last (`compose(retry(), floodgateInterceptor(gate))`) to admit a
 * request once for all its attempts.
 *
 * - Host: the origin's host. Key: `options.key(opts)`, else the host. `opts.floodgate = { key,
 *   host, cost, costs, class, timeoutMs }` overrides them for one request, and `opts.floodgate = false`
 *   sends it without the gate; `opts.floodgate` is removed before the request goes on.
 * - Admission is asynchronous: the interceptor returns `true` at once and dispatches once the
 *   gate admits. If the gate refuses (timeout, shed, closed) or `opts.signal` aborts while
 *   waiting, the handler's error callback gets the error (`signal.reason` for an abort) and
 *   nothing stays held. undici acts on an abort only once a request has started, so the
 *   interceptor listens to `opts.signal` itself while waiting. undici's `fetch` passes no signal
 *   in the dispatch options; give fetch users `wrapFetch` from `floodgate/fetch` instead.
 * - The ticket is released once, when the response ends, errors or upgrades: 429 and 503 as
 *   `dropped`, timeouts and socket failures as `dropped`, an abort as `ignored`, other responses
 *   as `success`.
 * - Retry-After: a response carrying `retry-after` (seconds or HTTP date) or `retry-after-ms`
 *   pauses its host on the gate (`gate.pause(host, ms)`, at most `maxPauseMs`) before the handler
 *   sees the response. With `options.reserve`, so does a response whose rate-limit headers say
 *   the window is down to the reserve, until the window resets.
 * - Retries: compose undici's `interceptors.retry()` after this one (above); it honours
 *   Retry-After itself. This interceptor has no retry option of its own.
 *
 * Works with undici 7 (whose `compose` hands interceptors handlers of the `onRequestStart` /
 * `onResponse*` API) and with handlers of the older `onConnect` / `onHeaders` API. This module
 * imports undici for its types only.
 *
 * @param gate a `Gate` (anything with `admit` and `pause`).
 * @param options see `InterceptorOptions`.
 * @throws InvalidOptionsError naming the field, at once, when an option is invalid; for a request
 *   whose `opts.floodgate` is invalid, the handler's error callback gets it.
 */
export function floodgateInterceptor(
  gate: InterceptorGate,
  options?: InterceptorOptions,
): Dispatcher.DispatcherComposeInterceptor {
  checkGate(SPEC, gate);
  const o = checkOptions(SPEC, options) as InterceptorOptions;
  const keyOf = o.key;
  // A request's key is derived (from options.key, else the host) only for a gate keyed by it.
  const keyed = keyedGate(gate, keyOf, SPEC.fail);
  const defaultTimeoutMs = o.timeoutMs;
  const pause: HostPause = { gate, maxPauseMs: o.maxPauseMs ?? DEFAULT_MAX_PAUSE_MS, reserve: o.reserve };
  const now = o.now;

  return (dispatch) => {
    // A method keeps its name through every transform; a function expression named like the
    // exported factory it shadows is renamed by some (esbuild makes it `floodgateInterceptor2`).
    const named = {
      floodgateInterceptor(opts: Dispatcher.DispatchOptions, handler: Handler): boolean {
        const { floodgate: raw, ...rest } = opts as FloodgateDispatchOptions;
        let call: DispatchCallOptions | false;
        let host: string | undefined;
        let key: string | undefined;
        try {
          call = checkCall(SPEC, raw) as DispatchCallOptions | false;
          if (call !== false) {
            host = call.host ?? hostOf(rest.origin);
            key = call.key ?? (keyed ? (keyOf?.(rest) ?? host) : undefined);
          }
        } catch (error) {
          refuse(handler, error, false);
          return true;
        }
        if (call === false) return dispatch(rest, handler);
        const wait = waitSignal(rest.signal);
        const admit: AdmitOptions = {
          key,
          host,
          cost: call.cost,
          costs: call.costs,
          class: call.class,
          timeoutMs: call.timeoutMs ?? defaultTimeoutMs,
          signal: wait.signal,
        };

        const refused = (error: unknown) => {
          wait.stop();
          refuse(handler, error, wait.signal?.aborted === true && error === wait.signal.reason);
        };
        const admitted = (ticket: Ticket) => {
          wait.stop();
          if (wait.signal?.aborted) {
            // Admitted just after the abort: give the ticket back as if never taken.
            ticket.refund().catch(noop);
            refuse(handler, wait.signal.reason, true);
            return;
          }
          const state = new Admitted(ticket, pause, host, now);
          try {
            dispatch(rest, gateHandler(handler, state));
          } catch (error) {
            // A dispatcher that throws instead of calling the error callback, or a handler
            // whose callbacks cannot even be read.
            if (state.released) throw error;
            state.release("ignored");
            refuse(handler, error, false);
          }
        };

        let pending: Promise<Ticket>;
        try {
          pending = gate.admit(admit);
        } catch (error) {
          refused(error);
          return true;
        }
        pending.then(admitted, refused).catch((error) => {
          // The handler's own callback threw; nothing is held, so surface it as undici would.
          queueMicrotask(() => {
            throw error;
          });
        });
        return true;
      },
    };
    return named.floodgateInterceptor;
  };
}
