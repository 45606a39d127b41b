/**
 * The handlers `floodgateInterceptor` wraps around the caller's: they forward every callback of
 * undici's handler API (and of its older callback API), pause the host a response asks to pause,
 * and release the request's ticket once.
 */
import type { Duplex } from "node:stream";
import type { Dispatcher } from "undici";
import { dispatchErrorOutcome as errorOutcome, statusOutcome } from "../base/classify.js";
import type { Outcome, Ticket } from "../types.js";
import { type HostPause, pauseHost } from "./pause.js";
import { RATE_LIMIT_HEADERS } from "./rate-limit.js";
import { parseRetryAfter } from "./retry-after.js";
import type { HeadersLike } from "./types.js";

type Handler = Dispatcher.DispatchHandler;
type Controller = Dispatcher.DispatchController;
type Headers = Record<string, string | string[] | undefined>;

const noop = () => {};

/** What one admitted request shares between the handler classes: its ticket and its pause. */
export class Admitted {
  status = 0;
  #released = false;

  constructor(
    readonly ticket: Ticket,
    readonly pause: HostPause,
    readonly host: string | undefined,
    readonly now: (() => number) | undefined,
  ) {}

  /**
   * Note a response's status and pause its host for as long as its Retry-After asks, or until
   * its rate-limit window resets when the window is down to the reserve.
   */
  response(status: number, headers: HeadersLike): void {
    if (status < 200) return;
    this.status = status;
    if (this.pause.maxPauseMs <= 0 || !this.host) return;
    const wall = this.now ? this.now() : Date.now();
    // The handler callbacks cannot wait for the pause.
    void pauseHost(this.pause, this.host, headers, parseRetryAfter(headers, wall), wall);
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
export function refuse(handler: Handler, error: unknown, aborted: boolean): void {
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
export function waitSignal(signal: unknown): { signal: AbortSignal | undefined; stop: () => void } {
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

/** `handler` wrapped in the class that speaks its API. */
export function gateHandler(handler: Handler, call: Admitted): Handler {
  return typeof handler.onRequestStart === "function"
    ? new GateHandler(handler, call)
    : new LegacyGateHandler(handler, call);
}
