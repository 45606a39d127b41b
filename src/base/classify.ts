/**
 * The outcome of a call, from its result: one set of rules for `defaultClassify`, `wrapFetch` and
 * the undici interceptor. A 429 or 503 and a timeout are `dropped` (the server is overloaded).
 */
import { isFloodgateError } from "../errors.js";
import type { Outcome, Settled } from "../types.js";

/** Error codes of a call that timed out (Node and undici): the server may be overloaded. */
export const TIMEOUT_CODES: ReadonlySet<string> = new Set([
  "ETIMEDOUT",
  "ESOCKETTIMEDOUT",
  "UND_ERR_CONNECT_TIMEOUT",
  "UND_ERR_HEADERS_TIMEOUT",
  "UND_ERR_BODY_TIMEOUT",
]);

/** Failures that say nothing about the server: the name did not resolve. */
const DNS_CODES: ReadonlySet<string> = new Set(["ENOTFOUND", "EAI_AGAIN", "EAI_NONAME", "EAI_FAIL"]);

/** Codes undici gives a request the caller aborted. */
const ABORT_CODES: ReadonlySet<string> = new Set(["UND_ERR_ABORTED", "ABORT_ERR"]);

/** 429 and 503 are `dropped` (the server is overloaded); any other status is `success`. */
export function statusOutcome(status: number | undefined): Outcome {
  return status === 429 || status === 503 ? "dropped" : "success";
}

/** Whether an error's `name` and `code` say it timed out. */
function isTimeout(name: unknown, code: unknown): boolean {
  return name === "TimeoutError" || (typeof code === "string" && TIMEOUT_CODES.has(code));
}

function statusOf(value: unknown): number | undefined {
  if (typeof value !== "object" || value === null) return undefined;
  const v = value as { status?: unknown; statusCode?: unknown };
  const status = typeof v.status === "number" ? v.status : v.statusCode;
  return typeof status === "number" ? status : undefined;
}

/**
 * The default outcome of a call that returned or threw `value`: a response (or an error) with
 * status 429 or 503 and a timeout error are `dropped`; other results are `success`, other errors
 * `ignored`.
 */
export function resultOutcome(ok: boolean, value: unknown): Outcome {
  const status = statusOf(value);
  if (ok || status === 429 || status === 503) return statusOutcome(status);
  if (typeof value === "object" && value !== null) {
    const { name, code } = value as { name?: unknown; code?: unknown };
    if (isTimeout(name, code)) return "dropped";
  }
  return "ignored";
}

/**
 * The default outcome of a call: a response (or an error) with status 429 or 503 and timeout
 * errors are `dropped`; other results are `success`, other errors `ignored`.
 */
export function defaultClassify(settled: Settled<unknown>): Outcome {
  return settled.ok ? resultOutcome(true, settled.value) : resultOutcome(false, settled.error);
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
export function fetchErrorOutcome(error: unknown, signal: AbortSignal | undefined): Outcome {
  if (typeof error !== "object" || error === null) return "ignored";
  const { name, cause } = error as { name?: unknown; cause?: unknown };
  const code = codeOf(error);
  if (isTimeout(name, code)) return "dropped";
  if (name === "AbortError" || (signal?.aborted && error === signal.reason)) return "ignored";
  // A gate further in (a nested wrapped fetch) refused the call: that says nothing about the server.
  if (isFloodgateError(error)) return "ignored";
  if (code !== undefined) return DNS_CODES.has(code) ? "ignored" : "dropped";
  return cause !== undefined ? "dropped" : "ignored";
}

/**
 * The outcome of an undici request that ended in an error after a response of `status` (0 for
 * none yet). An abort or a floodgate error (a gate further in refused it) is `ignored`; a 429/503
 * already seen stays `dropped`; timeouts and network failures (refused, reset, socket errors) are
 * `dropped`; a name that did not resolve is `ignored`; an error after any other response (a
 * handler further out failing) keeps that response's `success`; anything else is `ignored`.
 */
export function dispatchErrorOutcome(error: unknown, status: number, aborted: boolean): Outcome {
  const { name, code } = (typeof error === "object" && error !== null ? error : {}) as {
    name?: unknown;
    code?: unknown;
  };
  const codeText = typeof code === "string" ? code : "";
  if (aborted || name === "AbortError" || ABORT_CODES.has(codeText)) return "ignored";
  // A gate further in refused the request: that says nothing about the server.
  if (isFloodgateError(error)) return status >= 200 ? statusOutcome(status) : "ignored";
  if (status >= 200 && statusOutcome(status) === "dropped") return "dropped";
  if (isTimeout(name, codeText) || codeText.endsWith("_TIMEOUT")) return "dropped";
  if (DNS_CODES.has(codeText)) return "ignored";
  // A system error (refused, reset, broken pipe) or undici's socket error: the server failed us.
  // undici's other errors (UND_ERR_*) are about the request itself.
  const systemError = codeText !== "" && !codeText.startsWith("UND_ERR_");
  if (systemError || codeText === "UND_ERR_SOCKET") return "dropped";
  return status >= 200 ? "success" : "ignored";
}
