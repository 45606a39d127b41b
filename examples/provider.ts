/**
 * A simulated provider: an HTTP server on loopback that tolerates `cap` requests in flight,
 * takes `serviceMs` to answer each, and answers 429 to any request beyond the cap. The demo, the
 * examples and tests call it to show that a gate keeps a fleet of callers under the cap.
 *
 * Optional limits make it behave like the servers in the examples: an origin that blocks itself
 * for a while once its cap is broken (`blockMs`), a request allowance per window with
 * `x-ratelimit-*` headers (`requestLimit`), an LLM-like tokens-per-window allowance with usage in
 * the response (`tokenLimit`), a minimum spacing between arrivals (`minIntervalMs`), and a
 * throttle that answers every Nth request 429 with a Retry-After (`throttleEvery`). Every 429 is
 * counted by reason, and the provider notes any arrival during a Retry-After it announced.
 */
import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

/** A limit of `limit` units per `windowMs`. */
export interface WindowLimit {
  /** Units per window, and the most the provider grants at once. An integer >= 1. */
  limit: number;
  /** Length of the window in milliseconds. A finite number > 0. */
  windowMs: number;
  /**
   * `rolling` (default): a token bucket holding `limit` that refills `limit` per `windowMs`,
   * continuously. `fixed`: `limit` units per window, all restored when the window ends.
   */
  kind?: "rolling" | "fixed";
}

/** Options for `startProvider(options)`. */
export interface ProviderOptions {
  /** Requests the provider serves at once; one more in flight is answered 429. An integer >= 1. */
  cap: number;
  /** Milliseconds each accepted request is held before its 200 answer. A finite number >= 0. */
  serviceMs: number;
  /** Port to listen on; `0` picks a free one. @default 0 */
  port?: number;
  /** Address to listen on; loopback only. @default "127.0.0.1" */
  host?: string;
  /** Seconds sent as `Retry-After` with each 429 above the cap. An integer >= 0. @default no header */
  retryAfterS?: number;
  /**
   * Milliseconds sent as `retry-after-ms` (and rounded up to seconds as `retry-after`) with each
   * 429 above the cap and each throttled 429. A finite number >= 0. @default no header
   */
  retryAfterMs?: number;
  /** Up to this many milliseconds added at random to each service time. @default 0 */
  serviceJitterMs?: number;
  /**
   * Once a request arrives above the cap, the origin blocks itself for this long: every request
   * until then is answered 429. @default no block
   */
  blockMs?: number;
  /**
   * Requests allowed per window. Every response carries `x-ratelimit-limit-requests`,
   * `x-ratelimit-remaining-requests` and `x-ratelimit-reset-requests` (milliseconds until the
   * allowance is whole again, e.g. `"250ms"`). A request beyond it is answered 429 with
   * `retry-after-ms`. Refused requests spend the allowance too, as real providers count them.
   */
  requestLimit?: WindowLimit;
  /**
   * LLM-like tokens allowed per window (rolling). A request is a JSON body
   * `{ "prompt": string, "max_tokens": number }`; its prompt costs `ceil(prompt.length / 4)`
   * tokens and its completion a random share (10% to 100%) of `max_tokens`, both charged when it
   * arrives. A request the allowance cannot cover is answered 429 with `retry-after-ms`. The 200
   * answer carries `usage: { prompt_tokens, completion_tokens, total_tokens }`, and every
   * response the `x-ratelimit-*-tokens` headers.
   */
  tokenLimit?: WindowLimit;
  /**
   * Least milliseconds between two arrivals; a closer one is answered 429 ("too fast") with
   * `retry-after-ms`. @default no spacing
   */
  minIntervalMs?: number;
  /** Every Nth request is answered 429 with the Retry-After of `retryAfterMs` (else 1 s). @default never */
  throttleEvery?: number;
  /** Counts requests in flight across several providers (several "hosts"). @default none */
  group?: ProviderGroup;
}

/** Why a request was answered 429. */
export interface Rejections {
  /** More than `cap` in flight. */
  cap: number;
  /** The origin was blocking itself after its cap was broken (`blockMs`). */
  blocked: number;
  /** The request allowance was spent (`requestLimit`). */
  requests: number;
  /** The token allowance could not cover the request (`tokenLimit`). */
  tokens: number;
  /** It arrived closer than `minIntervalMs` after the one before. */
  spacing: number;
  /** The throttle answered it (`throttleEvery`). */
  throttle: number;
}

/** What the provider has seen since it started (or since `reset()`). */
export interface ProviderStats {
  /** Requests received, accepted or not. */
  requests: number;
  /** Requests answered 200. */
  completed: number;
  /** Requests answered 429, for any reason (see `rejectedBy`). */
  rejected429: number;
  /** Requests in flight now. */
  inFlight: number;
  /** Most requests in flight at once, the rejected one included: above `cap` means a 429 was due. */
  peak: number;
  /** 429s by reason. */
  rejectedBy: Rejections;
  /** Requests that arrived while a Retry-After this provider had sent was still running. */
  early: number;
  /** Least time between two arrivals, in milliseconds (`Infinity` before the second). */
  minGapMs: number;
  /** Mean time between two arrivals, in milliseconds (`NaN` before the second). */
  meanGapMs: number;
  /** Tokens charged (`tokenLimit`). */
  tokens: number;
}

/** A running provider. */
export interface Provider {
  /** Base URL, e.g. `http://127.0.0.1:40123`. */
  readonly url: string;
  readonly port: number;
  stats(): ProviderStats;
  /** Zero the counters (`peak` restarts from the requests in flight now). */
  reset(): void;
  /** Stop listening, answer nothing more and drop every connection. */
  close(): Promise<void>;
}

/**
 * In-flight requests across several providers: `peak` is the most at once over all of them.
 * `arrived` and `left`, when given, are told each request's `x-call-id` header (or undefined)
 * as it is counted in and out, so a watcher can tell which calls were in flight at each arrival.
 */
export interface ProviderGroup {
  inFlight: number;
  peak: number;
  arrived?(id: string | undefined): void;
  left?(id: string | undefined): void;
}

/** A request's `x-call-id` header, when it has one. */
function callId(req: IncomingMessage): string | undefined {
  const id = req.headers["x-call-id"];
  return typeof id === "string" ? id : undefined;
}

/** A counter to hand to several providers as `group`. */
export function providerGroup(): ProviderGroup {
  return { inFlight: 0, peak: 0 };
}

const LOOPBACK = new Set(["127.0.0.1", "::1", "localhost"]);

/** An allowance of units per window, rolling (a token bucket) or fixed. */
class Allowance {
  #units: number;
  #at: number;
  #windowStart: number;
  readonly limit: number;
  readonly windowMs: number;
  readonly fixed: boolean;

  constructor(l: WindowLimit, now: number) {
    this.limit = l.limit;
    this.windowMs = l.windowMs;
    this.fixed = l.kind === "fixed";
    this.#units = l.limit;
    this.#at = now;
    this.#windowStart = now;
  }

  #refill(now: number): void {
    if (this.fixed) {
      if (now - this.#windowStart >= this.windowMs) {
        this.#windowStart += Math.floor((now - this.#windowStart) / this.windowMs) * this.windowMs;
        this.#units = this.limit;
      }
      return;
    }
    if (now > this.#at) {
      this.#units = Math.min(this.limit, this.#units + ((now - this.#at) * this.limit) / this.windowMs);
      this.#at = now;
    }
  }

  /** Take `n` units if they are there; else the milliseconds until they would be. */
  take(n: number, now: number): { ok: true } | { ok: false; waitMs: number } {
    this.#refill(now);
    if (this.#units >= n) {
      this.#units -= n;
      return { ok: true };
    }
    if (this.fixed) return { ok: false, waitMs: this.#windowStart + this.windowMs - now };
    return { ok: false, waitMs: ((n - this.#units) * this.windowMs) / this.limit };
  }

  remaining(now: number): number {
    this.#refill(now);
    return Math.floor(this.#units);
  }

  /** Milliseconds until the allowance is whole again. */
  resetMs(now: number): number {
    this.#refill(now);
    if (this.fixed) return this.#units >= this.limit ? 0 : this.#windowStart + this.windowMs - now;
    return ((this.limit - this.#units) * this.windowMs) / this.limit;
  }

  headers(kind: "requests" | "tokens", now: number): Record<string, string> {
    return {
      [`x-ratelimit-limit-${kind}`]: String(this.limit),
      [`x-ratelimit-remaining-${kind}`]: String(this.remaining(now)),
      [`x-ratelimit-reset-${kind}`]: `${Math.ceil(this.resetMs(now))}ms`,
    };
  }
}

function check(ok: boolean, message: string): void {
  if (!ok) throw new RangeError(`startProvider: ${message}`);
}

function checkWindow(name: string, l: WindowLimit | undefined): void {
  if (l === undefined) return;
  check(Number.isInteger(l.limit) && l.limit >= 1, `${name}.limit must be an integer >= 1 (got ${l.limit})`);
  check(
    l.windowMs > 0 && Number.isFinite(l.windowMs),
    `${name}.windowMs must be a finite number > 0 (got ${l.windowMs})`,
  );
  check(
    l.kind === undefined || l.kind === "rolling" || l.kind === "fixed",
    `${name}.kind must be "rolling" or "fixed" (got ${l.kind})`,
  );
}

function nonNegative(name: string, value: number | undefined): void {
  if (value === undefined) return;
  check(value >= 0 && Number.isFinite(value), `${name} must be a finite number >= 0 (got ${value})`);
}

/**
 * Start a simulated provider on a loopback address.
 *
 * ```ts
 * const provider = await startProvider({ cap: 8, serviceMs: 50 });
 * await fetch(`${provider.url}/work`);
 * console.log(provider.stats()); // { requests: 1, completed: 1, rejected429: 0, inFlight: 0, peak: 1, ... }
 * await provider.close();
 * ```
 *
 * @throws RangeError when an option is out of range or `host` is not a loopback address.
 */
export async function startProvider(options: ProviderOptions): Promise<Provider> {
  const { cap, serviceMs, port = 0, host = "127.0.0.1", retryAfterS, retryAfterMs } = options;
  const { serviceJitterMs = 0, blockMs, requestLimit, tokenLimit, minIntervalMs, throttleEvery } = options;
  const group = options.group;
  check(Number.isInteger(cap) && cap >= 1, `cap must be an integer >= 1 (got ${cap})`);
  check(
    serviceMs >= 0 && Number.isFinite(serviceMs),
    `serviceMs must be a finite number >= 0 (got ${serviceMs})`,
  );
  check(
    retryAfterS === undefined || (Number.isInteger(retryAfterS) && retryAfterS >= 0),
    `retryAfterS must be an integer >= 0 (got ${retryAfterS})`,
  );
  nonNegative("retryAfterMs", retryAfterMs);
  nonNegative("serviceJitterMs", serviceJitterMs);
  nonNegative("blockMs", blockMs);
  nonNegative("minIntervalMs", minIntervalMs);
  check(
    throttleEvery === undefined || (Number.isInteger(throttleEvery) && throttleEvery >= 1),
    `throttleEvery must be an integer >= 1 (got ${throttleEvery})`,
  );
  checkWindow("requestLimit", requestLimit);
  checkWindow("tokenLimit", tokenLimit);
  check(LOOPBACK.has(host), `host must be a loopback address (got ${host})`);

  const now = () => performance.now();
  let requests = 0;
  let completed = 0;
  let rejected429 = 0;
  let inFlight = 0;
  let peak = 0;
  let early = 0;
  let tokens = 0;
  let minGapMs = Number.POSITIVE_INFINITY;
  let gapSum = 0;
  let gaps = 0;
  let lastArrival: number | undefined;
  let blockedUntil = 0;
  let quietUntil = 0;
  const rejectedBy: Rejections = { cap: 0, blocked: 0, requests: 0, tokens: 0, spacing: 0, throttle: 0 };
  const timers = new Set<NodeJS.Timeout>();
  const reqAllowance = requestLimit ? new Allowance(requestLimit, now()) : undefined;
  const tokAllowance = tokenLimit ? new Allowance(tokenLimit, now()) : undefined;

  const limitHeaders = (t: number): Record<string, string> => ({
    "content-type": "application/json",
    ...reqAllowance?.headers("requests", t),
    ...tokAllowance?.headers("tokens", t),
  });

  function leave(req: IncomingMessage): void {
    inFlight--;
    if (group) {
      group.left?.(callId(req));
      group.inFlight--;
    }
  }

  /** Answer 429 now; `waitMs` becomes `retry-after-ms` and `retry-after` (whole seconds, rounded up). */
  function reject(
    req: IncomingMessage,
    res: ServerResponse,
    reason: keyof Rejections,
    waitMs: number | undefined,
    t: number,
  ): void {
    leave(req);
    rejected429++;
    rejectedBy[reason]++;
    const headers = limitHeaders(t);
    if (waitMs !== undefined) {
      const ms = Math.max(1, Math.ceil(waitMs));
      headers["retry-after-ms"] = String(ms);
      headers["retry-after"] = String(Math.ceil(ms / 1000));
      quietUntil = Math.max(quietUntil, t + ms);
    } else if (reason === "cap" && retryAfterS !== undefined) {
      headers["retry-after"] = String(retryAfterS);
      quietUntil = Math.max(quietUntil, t + retryAfterS * 1000);
    }
    res.writeHead(429, headers).end(JSON.stringify({ error: "too many requests", reason, cap }));
  }

  function handle(req: IncomingMessage, res: ServerResponse, body: string): void {
    const t = now();
    requests++;
    inFlight++;
    if (inFlight > peak) peak = inFlight;
    if (group) {
      group.arrived?.(callId(req));
      group.inFlight++;
      if (group.inFlight > group.peak) group.peak = group.inFlight;
    }
    if (t < quietUntil) early++;
    if (lastArrival !== undefined) {
      const gap = t - lastArrival;
      minGapMs = Math.min(minGapMs, gap);
      gapSum += gap;
      gaps++;
    }
    const previous = lastArrival;
    lastArrival = t;

    if (t < blockedUntil) {
      reject(req, res, "blocked", blockedUntil - t, t);
      return;
    }
    // The allowance is spent before anything else is checked: a refused request still counts.
    if (reqAllowance) {
      const got = reqAllowance.take(1, t);
      if (!got.ok) {
        reject(req, res, "requests", got.waitMs, t);
        return;
      }
    }
    if (inFlight > cap) {
      if (blockMs !== undefined && blockMs > 0) blockedUntil = t + blockMs;
      reject(req, res, "cap", retryAfterMs ?? (blockMs || undefined), t);
      return;
    }
    if (minIntervalMs !== undefined && previous !== undefined && t - previous < minIntervalMs) {
      reject(req, res, "spacing", minIntervalMs - (t - previous), t);
      return;
    }
    if (throttleEvery !== undefined && requests % throttleEvery === 0) {
      reject(req, res, "throttle", retryAfterMs ?? 1000, t);
      return;
    }
    let usage: { prompt_tokens: number; completion_tokens: number; total_tokens: number } | undefined;
    if (tokAllowance) {
      let prompt = "";
      let maxTokens = 0;
      try {
        const parsed = JSON.parse(body) as { prompt?: unknown; max_tokens?: unknown };
        if (typeof parsed.prompt === "string") prompt = parsed.prompt;
        if (typeof parsed.max_tokens === "number" && parsed.max_tokens >= 0) maxTokens = parsed.max_tokens;
      } catch {
        // An unreadable body is an empty prompt.
      }
      const promptTokens = Math.ceil(prompt.length / 4);
      const completionTokens = Math.ceil(maxTokens * (0.1 + 0.9 * Math.random()));
      const total = promptTokens + completionTokens;
      const got = tokAllowance.take(total, t);
      if (!got.ok) {
        reject(req, res, "tokens", got.waitMs, t);
        return;
      }
      tokens += total;
      usage = { prompt_tokens: promptTokens, completion_tokens: completionTokens, total_tokens: total };
    }
    const timer = setTimeout(
      () => {
        timers.delete(timer);
        // Leave the count before answering, so a caller that sends its next request as soon as this
        // answer arrives never finds this one still counted.
        leave(req);
        completed++;
        res
          .writeHead(200, limitHeaders(now()))
          .end(JSON.stringify(usage ? { ok: true, path: req.url, usage } : { ok: true }));
      },
      serviceMs + serviceJitterMs * Math.random(),
    );
    timers.add(timer);
  }

  const server = createServer((req, res) => {
    if (!tokAllowance) {
      req.resume();
      handle(req, res, "");
      return;
    }
    const chunks: Buffer[] = [];
    req.on("data", (chunk: Buffer) => chunks.push(chunk));
    req.on("end", () => handle(req, res, Buffer.concat(chunks).toString("utf8")));
  });
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, host, () => {
      server.off("error", reject);
      resolve();
    });
  });
  const address = server.address() as AddressInfo;
  const urlHost = address.family === "IPv6" ? `[${address.address}]` : address.address;

  return {
    url: `http://${urlHost}:${address.port}`,
    port: address.port,
    stats: () => ({
      requests,
      completed,
      rejected429,
      inFlight,
      peak,
      rejectedBy: { ...rejectedBy },
      early,
      minGapMs,
      meanGapMs: gaps > 0 ? gapSum / gaps : Number.NaN,
      tokens,
    }),
    reset() {
      requests = 0;
      completed = 0;
      rejected429 = 0;
      peak = inFlight;
      early = 0;
      tokens = 0;
      minGapMs = Number.POSITIVE_INFINITY;
      gapSum = 0;
      gaps = 0;
      for (const k of Object.keys(rejectedBy) as (keyof Rejections)[]) rejectedBy[k] = 0;
    },
    close() {
      for (const t of timers) clearTimeout(t);
      if (group) group.inFlight -= inFlight;
      timers.clear();
      inFlight = 0;
      return new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      });
    },
  };
}
