import { once } from "node:events";
import { createConnection, createServer, type Server, type Socket } from "node:net";

/** What the proxy does with traffic now. */
export type ProxyState = "open" | "refusing" | "black-holed";

/** One client connection and its upstream connection (none yet for one accepted while black-holed). */
interface Pair {
  client: Socket;
  upstream: Socket | undefined;
  /** Bytes held back while black-holed, per direction, in order. */
  toUpstream: Buffer[];
  toClient: Buffer[];
  /** Holding what its client sends from a chunk that named the command `holdFrom` waits for. */
  holding: boolean;
}

const LOOPBACK = "127.0.0.1";

/**
 * A TCP proxy on 127.0.0.1 in front of one upstream port (a redis-server), for injecting network
 * faults into a live client:
 *
 * - `refuse("reset")`: new connections are accepted and reset at once (RST: ECONNRESET);
 *   `refuse("closed")`: the listener is closed, so nothing listens on the port (ECONNREFUSED).
 *   Connections already made are left alone; `cut()` them to take Redis away entirely.
 * - `blackHole()`: every connection, old and new, stays open but nothing is forwarded in either
 *   direction (a partition: the client sees no error, only silence). What was sent is held.
 * - `cut()`: every current connection is reset.
 * - `heal()`: back to forwarding. Bytes held by a black hole are delivered then, in order, as TCP
 *   would once a partition ends: commands sent into the silence still reach Redis, late.
 * - `healForOneReply()`: `heal()` until one reply has reached a client, then black-holed again.
 * - `holdFrom(command)`: on each connection, what its client sends is held from the first chunk
 *   that names `command` until `release()`, which delivers it in order: a command that reaches
 *   Redis late while the connection is otherwise well (replies still flow back).
 */
export class RedisProxy {
  #server: Server | undefined;
  readonly #pairs = new Set<Pair>();
  #state: ProxyState = "open";
  #port = 0;
  /** Black-holed again once one reply has reached a client (`healForOneReply`). */
  #oneReply = false;
  /** The command (lower case) whose first chunk on a connection starts holding it back, if any. */
  #holdFrom: string | undefined;
  /** Connections accepted and forwarded (or held), since start. */
  accepted = 0;
  /** Connections reset or refused while refusing, since start (resets only: a closed port counts none). */
  refused = 0;

  constructor(readonly upstreamPort: number) {}

  get port(): number {
    return this.#port;
  }

  get url(): string {
    return `redis://${LOOPBACK}:${this.#port}`;
  }

  get state(): ProxyState {
    return this.#state;
  }

  /** Client connections open now. */
  get connections(): number {
    return this.#pairs.size;
  }

  /** Bytes held back by a black hole now, both directions. */
  get heldBytes(): number {
    let n = 0;
    for (const pair of this.#pairs) {
      for (const chunk of pair.toUpstream) n += chunk.length;
      for (const chunk of pair.toClient) n += chunk.length;
    }
    return n;
  }

  /** Listen on a free loopback port (or `port`, when given). */
  async start(port = 0): Promise<void> {
    await this.#listen(port);
  }

  async #listen(port: number): Promise<void> {
    // The port was just given up (refuse("closed")); another process may hold it for a moment.
    for (let attempt = 0; ; attempt++) {
      const server = createServer((socket) => this.#accept(socket));
      try {
        server.listen(port, LOOPBACK);
        await once(server, "listening");
      } catch (error) {
        server.close();
        if (attempt >= 20 || (error as { code?: string }).code !== "EADDRINUSE") throw error;
        await new Promise((resolve) => setTimeout(resolve, 50));
        continue;
      }
      const address = server.address();
      this.#port = typeof address === "object" && address ? address.port : port;
      this.#server = server;
      return;
    }
  }

  #accept(client: Socket): void {
    if (this.#state === "refusing") {
      this.refused++;
      client.on("error", () => {});
      client.resetAndDestroy();
      return;
    }
    this.accepted++;
    const pair: Pair = { client, upstream: undefined, toUpstream: [], toClient: [], holding: false };
    this.#pairs.add(pair);
    client.setNoDelay(true);
    client.on("error", () => {});
    client.on("close", () => this.#drop(pair));
    client.on("data", (chunk: Buffer) => {
      if (this.#holdFrom !== undefined && chunk.toString("latin1").toLowerCase().includes(this.#holdFrom))
        pair.holding = true;
      if (this.#state === "black-holed" || !pair.upstream || pair.holding) pair.toUpstream.push(chunk);
      else pair.upstream.write(chunk);
    });
    if (this.#state !== "black-holed") this.#connect(pair);
  }

  #connect(pair: Pair): void {
    const upstream = createConnection({ host: LOOPBACK, port: this.upstreamPort });
    pair.upstream = upstream;
    upstream.setNoDelay(true);
    upstream.on("error", () => {});
    upstream.on("close", () => this.#drop(pair));
    upstream.on("data", (chunk: Buffer) => {
      if (this.#state === "black-holed") pair.toClient.push(chunk);
      else {
        pair.client.write(chunk);
        if (this.#oneReply) {
          this.#oneReply = false;
          this.#state = "black-holed";
        }
      }
    });
    this.#flush(pair);
  }

  #flush(pair: Pair): void {
    if (!pair.holding) for (const chunk of pair.toUpstream.splice(0)) pair.upstream?.write(chunk);
    for (const chunk of pair.toClient.splice(0)) pair.client.write(chunk);
  }

  /** One side went away: take the other down too, abruptly (as a dead peer would). */
  #drop(pair: Pair): void {
    if (!this.#pairs.delete(pair)) return;
    pair.toUpstream.length = 0;
    pair.toClient.length = 0;
    if (!pair.client.destroyed) pair.client.resetAndDestroy();
    if (pair.upstream && !pair.upstream.destroyed) pair.upstream.resetAndDestroy();
  }

  /**
   * Refuse new connections: `reset` accepts and resets each one; `closed` stops listening on the
   * port. Open connections carry on.
   */
  refuse(how: "reset" | "closed" = "reset"): void {
    this.#state = "refusing";
    if (how === "closed") this.#closeListener();
  }

  /** Forward nothing, in either direction, on any connection (old or new), holding what was sent. */
  blackHole(): void {
    this.#state = "black-holed";
  }

  /**
   * `heal()`, and black-hole again as soon as one reply (a chunk from Redis) has been passed on to
   * a client: the commands a black hole held reach Redis, the first answer comes back, and what
   * the client sends on that answer falls into the silence.
   */
  async healForOneReply(): Promise<void> {
    await this.heal();
    // (Replies come in later turns than the one `heal` delivered the held commands in.)
    this.#oneReply = true;
  }

  /**
   * Hold back what each client sends from its first chunk that names `command` (a command's name
   * as clients send it, in any case: "subscribe"), until `release()`.
   */
  holdFrom(command: string): void {
    this.#holdFrom = command.toLowerCase();
  }

  /** Stop holding (`holdFrom`), and deliver what was held, in order. */
  release(): void {
    this.#holdFrom = undefined;
    for (const pair of this.#pairs) {
      pair.holding = false;
      if (pair.upstream && this.#state === "open") this.#flush(pair);
    }
  }

  /** Reset every open connection. */
  cut(): void {
    for (const pair of [...this.#pairs]) this.#drop(pair);
  }

  /** Forward again; deliver what a black hole held, in order; listen again if the port was closed. */
  async heal(): Promise<void> {
    this.#state = "open";
    this.#oneReply = false;
    if (!this.#server) await this.#listen(this.#port);
    for (const pair of this.#pairs) {
      if (pair.upstream) this.#flush(pair);
      else this.#connect(pair);
    }
  }

  #closeListener(): void {
    const server = this.#server;
    this.#server = undefined;
    if (!server) return;
    // `close` only stops accepting; its callback waits for open connections, so do not wait for it.
    server.close();
  }

  /** Reset everything and stop listening. */
  async stop(): Promise<void> {
    this.#state = "refusing";
    this.cut();
    const server = this.#server;
    this.#server = undefined;
    if (server) {
      const closed = once(server, "close");
      server.close();
      await closed;
    }
  }
}
