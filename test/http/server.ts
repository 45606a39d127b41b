import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { Gate, type MemoryAimd, type MemoryIntervalGate, memory } from "floodgate";
import type { FakeClock } from "floodgate/testing";

export type Respond = (req: IncomingMessage, res: ServerResponse, body: string) => void;

/**
 * A loopback HTTP server on a free port whose answer each test sets. It reads each request's
 * body before answering and keeps the requests and bodies it received, in order.
 */
export class TestServer {
  respond: Respond = (_req, res) => res.end("ok");
  readonly received: IncomingMessage[] = [];
  readonly bodies: string[] = [];
  #waiters: Array<{ n: number; resolve: () => void }> = [];
  readonly #server: Server;
  url = "";
  host = "";

  constructor() {
    this.#server = createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on("data", (chunk: Buffer) => chunks.push(chunk));
      req.on("end", () => {
        const body = Buffer.concat(chunks).toString();
        this.received.push(req);
        this.bodies.push(body);
        this.#waiters = this.#waiters.filter((w) => {
          if (w.n > this.received.length) return true;
          w.resolve();
          return false;
        });
        this.respond(req, res, body);
      });
    });
  }

  async start(): Promise<this> {
    await new Promise<void>((resolve) => this.#server.listen(0, "127.0.0.1", resolve));
    const { port } = this.#server.address() as AddressInfo;
    this.host = `127.0.0.1:${port}`;
    this.url = `http://${this.host}`;
    return this;
  }

  /** Resolves once `n` requests have arrived. */
  receivedCount(n: number): Promise<void> {
    if (this.received.length >= n) return Promise.resolve();
    return new Promise((resolve) => this.#waiters.push({ n, resolve }));
  }

  close(): Promise<void> {
    this.#server.closeAllConnections();
    return new Promise((resolve) => this.#server.close(() => resolve()));
  }
}

/** Answer every request with `status` and `headers`, the status as the body. */
export const reply =
  (status: number, headers: Record<string, string> = {}): Respond =>
  (_req, res) =>
    res.writeHead(status, headers).end(String(status));

/** Answer with each reply in turn, then repeat the last. */
export const sequence =
  (...replies: Array<number | Respond>): Respond =>
  (req, res, body) => {
    const next = replies.length > 1 ? replies.shift()! : replies[0]!;
    if (typeof next === "number") res.writeHead(next).end(String(next));
    else next(req, res, body);
  };

/** A port nothing listens on: opened, then closed again. */
export async function closedPort(): Promise<number> {
  const s = createServer();
  await new Promise<void>((resolve) => s.listen(0, "127.0.0.1", resolve));
  const { port } = s.address() as AddressInfo;
  await new Promise<void>((resolve) => s.close(() => resolve()));
  return port;
}

/** A gate of one interval gate with no spacing, on `clock`, whose pauses a test reads back. */
export function hostsGate(clock: FakeClock): { gate: Gate; hosts: MemoryIntervalGate } {
  const hosts = memory({ clock }).intervalGate("hosts", { minIntervalMs: 0 }) as MemoryIntervalGate;
  return { gate: new Gate([hosts], { clock }), hosts };
}

/**
 * A gate of an interval gate (`minIntervalMs` apart, none by default) and an AIMD limiter that
 * halves on a drop, on `clock`.
 */
export function adaptiveGateOn(
  clock: FakeClock,
  aimd: { initial: number; max: number } = { initial: 4, max: 4 },
  minIntervalMs = 0,
): { gate: Gate; hosts: MemoryIntervalGate; adaptive: MemoryAimd } {
  const backend = memory({ clock });
  const hosts = backend.intervalGate("hosts", { minIntervalMs }) as MemoryIntervalGate;
  const adaptive = backend.aimd("adaptive", { ...aimd, min: 1, backoffRatio: 0.5 }) as MemoryAimd;
  return { gate: new Gate([hosts, adaptive], { clock }), hosts, adaptive };
}
