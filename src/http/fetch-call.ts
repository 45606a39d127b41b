/**
 * One call through a wrapped fetch: reading its `init`, each attempt through the gate (pausing
 * the host and settling from the response), and the retries.
 */
import { fetchErrorOutcome as errorOutcome, statusOutcome } from "../base/classify.js";
import type { Clock } from "../clock.js";
import { isFloodgateError } from "../errors.js";
import type { Settled } from "../gate.js";
import type { Outcome, Ticket } from "../types.js";
import { isArray } from "../validate.js";
import { checkCall, type Fail, got, readingOptions, show, specNamed, type WrapperSpec } from "./options.js";
import { type HostPause, pauseHost } from "./pause.js";
import {
  backoffMs,
  describeAttempts,
  methodOf,
  RetryError,
  type RetryPolicy,
  replayable,
  retryPolicy,
  sleep,
} from "./retry.js";
import { parseRetryAfter } from "./retry-after.js";
import type {
  FetchCallOptions,
  FetchGate,
  FetchLike,
  ResponseLike,
  RetryAttempt,
  RetryOptions,
  SettleValue,
  WrapFetchOptions,
} from "./types.js";

/** How `wrapFetch` checks what it is given. @internal */
export const SPEC: WrapperSpec = {
  ...specNamed("wrapFetch"),
  method: "run",
  options: new Set(["key", "timeoutMs", "maxPauseMs", "now", "clock", "retry", "reserve", "settle"]),
  keyArgs: "(url, init)",
  where: "init",
  callKeys: new Set(["key", "host", "cost", "costs", "class", "timeoutMs", "retry"]),
};
const fail: Fail = SPEC.fail;

/**
 * What a wrapped fetch fixed when it was built, read by each of its calls.
 * @internal
 */
export interface FetchWrapper {
  readonly gate: FetchGate;
  readonly fetchImpl: FetchLike | undefined;
  readonly keyOf: WrapFetchOptions["key"];
  /** Whether a call's key is derived (from `keyOf`, else the host): only for a gate keyed by it. */
  readonly keyed: boolean;
  readonly timeoutMs: number | undefined;
  readonly pause: HostPause;
  readonly now: (() => number) | undefined;
  readonly clock: Clock;
  readonly retry: RetryOptions | undefined;
  readonly settle: WrapFetchOptions["settle"];
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
    const call = checkCall(SPEC, i?.floodgate) as FetchCallOptions | false;
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

/** Settle the ticket from the response; only the backend failing to do it is forgiven. */
async function settleFrom(w: FetchWrapper, ticket: Ticket, response: ResponseLike, url: URL): Promise<void> {
  const returned = w.settle!(response, url);
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

/**
 * One call of a wrapped fetch: `input` and `given` (its `init`) as the caller passed them.
 * @internal
 */
export async function fetchThrough(
  w: FetchWrapper,
  input: unknown,
  given?: Record<string, unknown> | null,
): Promise<ResponseLike> {
  const { call, sendInit, signal, method, canReplay } = readInit(input, given);
  const send = (): Promise<ResponseLike> => {
    const f = (w.fetchImpl ?? globalThis.fetch) as FetchLike;
    return sendInit === undefined ? f(input) : f(input, sendInit);
  };
  if (call === false) return send();
  const url = urlOf(input);
  const host = call.host ?? (url.host || undefined);
  const key = call.key ?? (w.keyed ? (w.keyOf?.(url, sendInit) ?? host) : undefined);

  const attempt = async (ticket: Ticket): Promise<Sent> => {
    const response = await send();
    // What the server said decides the outcome, whatever happens after.
    ticket.record(statusOutcome(response.status));
    const wall = w.now ? w.now() : Date.now();
    const retryAfterMs = parseRetryAfter(response.headers, wall);
    if (w.pause.maxPauseMs > 0 && host) await pauseHost(w.pause, host, response.headers, retryAfterMs, wall);
    if (w.settle) {
      try {
        await settleFrom(w, ticket, response, url);
      } catch (error) {
        discard(response);
        throw error;
      }
    }
    return { response, retryAfterMs };
  };
  const runOnce = () =>
    w.gate.run(attempt, {
      key,
      host,
      cost: call.cost,
      costs: call.costs,
      class: call.class,
      timeoutMs: call.timeoutMs ?? w.timeoutMs,
      signal,
      classify: (settled) => classify(settled, signal),
    });

  const policy = retryPolicy(w.retry, call.retry);
  if (!policy?.methods.has(method) || !canReplay) {
    return (await runOnce()).response;
  }
  return retrying(w, policy, runOnce, signal, `${method} ${url.origin}${url.pathname}`);
}

/** Run attempts until one succeeds, one fails in a way not retried, or retries run out. */
async function retrying(
  w: FetchWrapper,
  policy: RetryPolicy,
  runOnce: () => Promise<Sent>,
  signal: AbortSignal | undefined,
  what: string,
): Promise<ResponseLike> {
  const maxPauseMs = w.pause.maxPauseMs;
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
    await sleep(w.clock, delayMs, signal);
  }
}
