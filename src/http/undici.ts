/**
 * `floodgateInterceptor`: an undici interceptor that passes every request through a gate.
 *
 * @module floodgate/undici
 */
import type { Duplex } from "node:stream";
import type { Dispatcher } from "undici";
import { dispatchErrorOutcome as errorOutcome, statusOutcome } from "../base/classify.js";
import { InvalidOptionsError } from "../errors.js";
import type { Gate } from "../gate.js";
import type { AdmitOptions, Outcome, Ticket } from "../types.js";
import { isArray } from "../validate.js";
import {
  checkReserve,
  parseRateLimit,
  RATE_LIMIT_HEADERS,
  type ReserveOptions,
  reservePauseMs,
} from "./rate-limit.js";
import { type HeadersLike, parseRetryAfter } from "./retry-after.js";
import { checkCallShape, got, keyedGate, readingOptions } from "./show.js";

export {
  parseRateLimit,
  parseResetMs,
  type RateLimitWindow,
  type RateLimitWindowName,
  type ReserveOptions,
} from "./rate-limit.js";
export { type HeadersLike, type HeaderValue, parseRetryAfter } from "./retry-after.js";

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

type Handler = Dispatcher.DispatchHandler;
type Controller = Dispatcher.DispatchController;
type Headers = Record<string, string | string[] | undefined>;

const DEFAULT_MAX_PAUSE_MS = 86_400_000;
const OPTION_KEYS = new Set(["key", "timeoutMs", "maxPauseMs", "now", "reserve"]);
const CALL_KEYS = new Set(["key", "host", "cost", "costs", "timeoutMs"]);
const noop = () => {};

function fail(field: string, message: string): never {
  throw new InvalidOptionsError(undefined, field, `floodgateInterceptor: ${message}`);
}

/** Whether `g` has the methods a gate needs here (`run` or `admit`, and `pause`). */
function isGate(g: unknown, method: "run" | "admit"): boolean {
  if (typeof g !== "object" || g === null) return false;
  const o = g as Record<string, unknown>;
  return typeof o[method] === "function" && typeof o.pause === "function";
}

function checkOptions(gate: unknown, options: unknown): InterceptorOptions {
  const g = gate as Partial<InterceptorGate> | null | undefined;
  if (!readingOptions("gate", "gate", fail, () => isGate(g, "admit"))) {
    fail("gate", `gate must be a Gate (an object with admit and pause), ${got(gate)}`);
  }
  if (options === undefined) return {};
  if (typeof options !== "object" || options === null || isArray(options)) {
    fail("options", `options must be an object, ${got(options)}`);
  }
  return readingOptions("options", "options", fail, () => checkFields(options));
}

/** Check each option, reading each once into a copy (a getter is not read again later). */
function checkFields(options: object): InterceptorOptions {
  const o: InterceptorOptions = {};
  for (const k of Object.keys(options)) {
    if (!OPTION_KEYS.has(k)) fail(k, `unknown option "${k}"`);
    (o as Record<string, unknown>)[k] = (options as Record<string, unknown>)[k];
  }
  if (o.key !== undefined && typeof o.key !== "function") {
    fail("key", `key must be a function (opts) => string | undefined, ${got(o.key)}`);
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
  if (o.reserve !== undefined) checkReserve(o.reserve, "reserve", fail);
  return o;
}

function checkCall(call: unknown): DispatchCallOptions | false {
  return checkCallShape(call, "opts", CALL_KEYS, fail) as DispatchCallOptions | false;
}

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

/** What one admitted request shares between the handler classes: its ticket and its pause. */
class Admitted {
  status = 0;
  #released = false;

  constructor(
    readonly ticket: Ticket,
    readonly gate: InterceptorGate,
    readonly host: string | undefined,
    readonly maxPauseMs: number,
    readonly now: (() => number) | undefined,
    readonly reserve: ReserveOptions | undefined,
  ) {}

  /**
   * Note a response's status and pause its host for as long as its Retry-After asks, or until
   * its rate-limit window resets when the window is down to the reserve.
   */
  response(status: number, headers: HeadersLike): void {
    if (status < 200) return;
    this.status = status;
    if (this.maxPauseMs <= 0 || !this.host) return;
    const wall = this.now ? this.now() : Date.now();
    let ms = parseRetryAfter(headers, wall);
    if (this.reserve) {
      const reset = reservePauseMs(parseRateLimit(headers, wall), this.reserve);
      if (reset !== undefined && (ms === undefined || reset > ms)) ms = reset;
    }
    if (ms === undefined || ms <= 0) return;
    // The handler callbacks cannot wait; a failed pause (Redis unreachable) does not fail the request.
    try {
      this.gate.pause(this.host, Math.min(ms, this.maxPauseMs)).catch(noop);
    } catch {
      // A pause that throws at once is treated like one that rejects.
    }
  }

  release(outcome: Outcome): void {
    if (this.#released) return;
    this.#released = true;
    this.ticket.release(outcome).catch(noop);
  }

  get released(): boolean {
    return this.#released;
  }
}

/**
 * Forwards every callback of undici's handler API to the caller's handler, releasing the ticket
 * once: on the response's end, on an error or on an upgrade.
 */
class GateHandler implements Handler {
  readonly #handler: Handler;
  readonly #call: Admitted;

  constructor(handler: Handler, call: Admitted) {
    this.#handler = handler;
    this.#call = call;
  }

  onRequestStart(controller: Controller, context: unknown): void {
    this.#handler.onRequestStart?.(controller, context);
  }

  onRequestUpgrade(controller: Controller, statusCode: number, headers: Headers, socket: Duplex): void {
    this.#call.release("success");
    this.#handler.onRequestUpgrade?.(controller, statusCode, headers, socket);
  }

  onResponseStart(
    controller: Controller,
    statusCode: number,
    headers: Headers,
    statusMessage?: string,
  ): void {
    this.#call.response(statusCode, headers);
    this.#handler.onResponseStart?.(controller, statusCode, headers, statusMessage);
  }

  onResponseData(controller: Controller, chunk: Buffer): void {
    this.#handler.onResponseData?.(controller, chunk);
  }

  onResponseEnd(controller: Controller, trailers: Headers): void {
    this.#call.release(statusOutcome(this.#call.status));
    this.#handler.onResponseEnd?.(controller, trailers);
  }

  onResponseError(controller: Controller | null, error: Error): void {
    this.#call.release(errorOutcome(error, this.#call.status, controller?.aborted === true));
    if (!this.#handler.onResponseError) throw error;
    this.#handler.onResponseError(controller as Controller, error);
  }
}

/** Raw headers (`[name, value, name, value, …]` as Buffers or strings) as a record. */
function rawToRecord(raw: readonly (Buffer | string)[] | null | undefined): Headers {
  const out: Headers = {};
  if (!raw) return out;
  for (let i = 0; i + 1 < raw.length; i += 2) {
    const name = raw[i]!.toString().toLowerCase();
    if (name !== "retry-after" && name !== "retry-after-ms" && !RATE_LIMIT_HEADERS.has(name)) continue;
    const value = raw[i + 1]!.toString();
    const prev = out[name];
    out[name] = prev === undefined ? value : Array.isArray(prev) ? [...prev, value] : [prev, value];
  }
  return out;
}

/**
 * The same for a handler written against undici's older callback API (`onConnect`, `onHeaders`,
 * `onData`, `onComplete`, `onError`, `onUpgrade`), as undici 6 passes to interceptors.
 */
class LegacyGateHandler implements Handler {
  readonly #handler: Handler;
  readonly #call: Admitted;
  #aborted = false;

  constructor(handler: Handler, call: Admitted) {
    this.#handler = handler;
    this.#call = call;
  }

  onConnect(abort: (err?: Error) => void, context?: unknown): void {
    const onConnect = this.#handler.onConnect as
      | ((abort: (err?: Error) => void, context?: unknown) => void)
      | undefined;
    onConnect?.call(
      this.#handler,
      (err?: Error) => {
        this.#aborted = true;
        abort(err);
      },
      context,
    );
  }

  onResponseStarted(): void {
    this.#handler.onResponseStarted?.();
  }

  onHeaders(statusCode: number, headers: Buffer[], resume: () => void, statusText: string): boolean {
    this.#call.response(statusCode, rawToRecord(headers));
    return this.#handler.onHeaders?.(statusCode, headers, resume, statusText) ?? true;
  }

  onData(chunk: Buffer): boolean {
    return this.#handler.onData?.(chunk) ?? true;
  }

  onComplete(trailers: string[] | null): void {
    this.#call.release(statusOutcome(this.#call.status));
    this.#handler.onComplete?.(trailers);
  }

  onError(error: Error): void {
    this.#call.release(errorOutcome(error, this.#call.status, this.#aborted));
    if (!this.#handler.onError) throw error;
    this.#handler.onError(error);
  }

  onUpgrade(statusCode: number, headers: Buffer[] | string[] | null, socket: Duplex): void {
    this.#call.release("success");
    this.#handler.onUpgrade?.(statusCode, headers, socket);
  }

  onBodySent(chunkSize: number, totalBytesSent: number): void {
    this.#handler.onBodySent?.(chunkSize, totalBytesSent);
  }
}

/** The controller handed to `onResponseError` when a request fails before it was dispatched. */
class RefusedController implements Controller {
  readonly paused = false;
  rawHeaders = null;
  rawTrailers = null;
  constructor(
    readonly aborted: boolean,
    readonly reason: Error | null,
  ) {}
  abort(): void {}
  pause(): void {}
  resume(): void {}
}

/** Tell `handler` the request failed before it was sent, through whichever API it speaks. */
function refuse(handler: Handler, error: unknown, aborted: boolean): void {
  const err = error as Error;
  if (typeof handler.onRequestStart === "function" || typeof handler.onResponseError === "function") {
    if (!handler.onResponseError) throw err;
    handler.onResponseError(new RefusedController(aborted, aborted ? err : null), err);
  } else if (handler.onError) {
    handler.onError(err);
  } else {
    throw err;
  }
}

/** `opts.signal` as an `AbortSignal` for the wait, and a function that stops listening. */
function waitSignal(signal: unknown): { signal: AbortSignal | undefined; stop: () => void } {
  if (signal === null || signal === undefined) return { signal: undefined, stop: noop };
  if (signal instanceof AbortSignal) return { signal, stop: noop };
  // undici also accepts an EventEmitter that emits "abort".
  const emitter = signal as {
    aborted?: unknown;
    reason?: unknown;
    once?: Function;
    removeListener?: Function;
  };
  if (typeof emitter.once !== "function") return { signal: undefined, stop: noop };
  const controller = new AbortController();
  const reason = () => emitter.reason ?? new DOMException("This operation was aborted", "AbortError");
  if (emitter.aborted === true) {
    controller.abort(reason());
    return { signal: controller.signal, stop: noop };
  }
  const onAbort = () => controller.abort(reason());
  emitter.once.call(emitter, "abort", onAbort);
  return { signal: controller.signal, stop: () => emitter.removeListener?.call(emitter, "abort", onAbort) };
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
 *   host, cost, costs, timeoutMs }` overrides them for one request, and `opts.floodgate = false`
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
  const o = checkOptions(gate, options);
  const keyOf = o.key;
  // A request's key is derived (from options.key, else the host) only for a gate keyed by it.
  const keyed = keyedGate(gate, keyOf, fail);
  const defaultTimeoutMs = o.timeoutMs;
  const maxPauseMs = o.maxPauseMs ?? DEFAULT_MAX_PAUSE_MS;
  const now = o.now;
  const reserve = o.reserve;

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
          call = checkCall(raw);
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
          const state = new Admitted(ticket, gate, host, maxPauseMs, now, reserve);
          const wrapped =
            typeof handler.onRequestStart === "function"
              ? new GateHandler(handler, state)
              : new LegacyGateHandler(handler, state);
          try {
            dispatch(rest, wrapped);
          } catch (error) {
            // A dispatcher that throws instead of calling the error callback.
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
