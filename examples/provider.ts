/**
 * A simulated provider: an HTTP server on loopback that tolerates `cap` requests in flight,
 * takes `serviceMs` to answer each, and answers 429 to any request beyond the cap. The demo, the
 * examples and tests call it to show that a gate keeps a fleet of callers under the cap.
 */
import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

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
  /** Seconds sent as `Retry-After` with each 429. An integer >= 0. @default no header */
  retryAfterS?: number;
}

/** What the provider has seen since it started (or since `reset()`). */
export interface ProviderStats {
  /** Requests received, accepted or not. */
  requests: number;
  /** Requests answered 200. */
  completed: number;
  /** Requests answered 429 because more than `cap` were in flight. */
  rejected429: number;
  /** Requests in flight now. */
  inFlight: number;
  /** Most requests in flight at once, the rejected one included: above `cap` means a 429 was due. */
  peak: number;
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

const LOOPBACK = new Set(["127.0.0.1", "::1", "localhost"]);

/**
 * Start a simulated provider on a loopback address.
 *
 * ```ts
 * const provider = await startProvider({ cap: 8, serviceMs: 50 });
 * await fetch(`${provider.url}/work`);
 * console.log(provider.stats()); // { requests: 1, completed: 1, rejected429: 0, inFlight: 0, peak: 1 }
 * await provider.close();
 * ```
 *
 * @throws RangeError when an option is out of range or `host` is not a loopback address.
 */
export async function startProvider(options: ProviderOptions): Promise<Provider> {
  const { cap, serviceMs, port = 0, host = "127.0.0.1", retryAfterS } = options;
  if (!(Number.isInteger(cap) && cap >= 1))
    throw new RangeError(`startProvider: cap must be an integer >= 1 (got ${cap})`);
  if (!(serviceMs >= 0 && Number.isFinite(serviceMs))) {
    throw new RangeError(`startProvider: serviceMs must be a finite number >= 0 (got ${serviceMs})`);
  }
  if (retryAfterS !== undefined && !(Number.isInteger(retryAfterS) && retryAfterS >= 0)) {
    throw new RangeError(`startProvider: retryAfterS must be an integer >= 0 (got ${retryAfterS})`);
  }
  if (!LOOPBACK.has(host))
    throw new RangeError(`startProvider: host must be a loopback address (got ${host})`);

  let requests = 0;
  let completed = 0;
  let rejected429 = 0;
  let inFlight = 0;
  let peak = 0;
  const timers = new Set<NodeJS.Timeout>();

  function handle(req: IncomingMessage, res: ServerResponse): void {
    req.resume();
    requests++;
    inFlight++;
    if (inFlight > peak) peak = inFlight;
    if (inFlight > cap) {
      inFlight--;
      rejected429++;
      const headers: Record<string, string> = { "content-type": "application/json" };
      if (retryAfterS !== undefined) headers["retry-after"] = String(retryAfterS);
      res.writeHead(429, headers).end(JSON.stringify({ error: "too many requests in flight", cap }));
      return;
    }
    const timer = setTimeout(() => {
      timers.delete(timer);
      // Leave the count before answering, so a caller that sends its next request as soon as this
      // answer arrives never finds this one still counted.
      inFlight--;
      completed++;
      res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify({ ok: true }));
    }, serviceMs);
    timers.add(timer);
  }

  const server = createServer(handle);
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
    stats: () => ({ requests, completed, rejected429, inFlight, peak }),
    reset() {
      requests = 0;
      completed = 0;
      rejected429 = 0;
      peak = inFlight;
    },
    close() {
      for (const t of timers) clearTimeout(t);
      timers.clear();
      inFlight = 0;
      return new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      });
    },
  };
}
