/**
 * The adapter for ioredis (5 and 6) and iovalkey (a fork of ioredis 5 with the same API, so the
 * same adapter serves it): scripts as commands defined with `defineCommand`, `status` as is.
 */

import { commandName, defineScripts, SCRIPTS, type ScriptName, scriptSource } from "../scripts.js";
import type { ConnectionEvent, Corkable, RedisConnection } from "./index.js";

/**
 * The part of an ioredis or iovalkey client (`Redis` or `Cluster`) floodgate uses, as its types
 * declare it in both packages.
 */
export interface IoredisFamilyClient {
  /** `wait`, `connecting`, `connect`, `ready`, `reconnecting`, `close`, `end`. */
  readonly status: string;
  defineCommand(name: string, definition: { numberOfKeys?: number; lua: string }): void;
  duplicate(...args: never[]): unknown;
}

/** What `duplicate` of a (non-Cluster) client takes: options over its own. */
type DuplicateWith = (override: { autoResubscribe: boolean }) => unknown;

/** The runtime shape used beyond what the types above promise. */
interface Client extends IoredisFamilyClient {
  isCluster?: boolean;
  stream?: Partial<Corkable>;
  subscribe(...channels: string[]): Promise<unknown>;
  on(event: string, listener: (...args: any[]) => void): unknown;
  off?(event: string, listener: (...args: any[]) => void): unknown;
  quit(): Promise<unknown>;
  disconnect(): void;
  connect?(): Promise<unknown>;
  eval(...args: unknown[]): Promise<unknown>;
}

type ScriptCommand = (this: Client, ...args: unknown[]) => Promise<unknown>;

/** The command each script is defined under, looked up once. */
const COMMANDS = Object.fromEntries(
  Object.keys(SCRIPTS).map((name) => [name, commandName(name as ScriptName)]),
) as Record<ScriptName, string>;

/** Whether `client` is an ioredis or iovalkey client: it defines commands and has a `status`. */
export function isIoredisFamily(client: object): client is IoredisFamilyClient {
  const c = client as Partial<Client>;
  return typeof c.defineCommand === "function" && typeof c.status === "string" && typeof c.on === "function";
}

/** An ioredis or iovalkey client (`Redis` or `Cluster`) as the backend's one client interface. */
export class IoredisConnection implements RedisConnection {
  readonly library = "ioredis";
  readonly cluster: boolean;
  readonly #client: Client;

  /**
   * `scripts`: define floodgate's scripts on it (not on a connection kept for pub/sub).
   */
  constructor(client: IoredisFamilyClient, scripts: boolean) {
    this.#client = client as Client;
    this.cluster = this.#client.isCluster === true;
    if (scripts) defineScripts(client);
  }

  get client(): object {
    return this.#client;
  }

  status(): string {
    return this.#client.status;
  }

  on(event: ConnectionEvent, listener: (...args: any[]) => void): void {
    this.#client.on(event, listener);
  }

  off(event: ConnectionEvent, listener: (...args: any[]) => void): void {
    this.#client.off?.(event, listener);
  }

  connect(): Promise<unknown> {
    return this.#client.connect?.() ?? Promise.resolve();
  }

  script(
    name: ScriptName,
    keys: readonly string[],
    args: readonly (string | number)[],
    wanted: () => boolean,
  ): Promise<unknown> {
    const client = this.#client;
    // The client sends the body once per connection, then the SHA, and resends after NOSCRIPT.
    const command = (client as unknown as Record<string, ScriptCommand>)[COMMANDS[name]]!;
    const sent =
      SCRIPTS[name] < 0
        ? command.call(client, keys.length, ...keys, ...args)
        : keys.length === 1
          ? command.call(client, keys[0], ...args)
          : command.call(client, ...keys, ...args);
    return sent.catch((error: unknown) => {
      // The cache was flushed again before the client's own resend (which it tries once): send
      // the body itself, which cannot miss.
      if (wanted() && error instanceof Error && error.message.startsWith("NOSCRIPT")) {
        return client.eval(scriptSource(name), keys.length, ...keys, ...args);
      }
      throw error;
    });
  }

  duplicate(): RedisConnection {
    // (A Cluster resubscribes through its own subscriber connections; its duplicate takes other
    // arguments.)
    if (this.cluster) return new IoredisConnection(this.#client.duplicate() as IoredisFamilyClient, false);
    const copy = (this.#client.duplicate as unknown as DuplicateWith).call(this.#client, {
      autoResubscribe: false,
    });
    return new IoredisConnection(copy as IoredisFamilyClient, false);
  }

  onMessage(listener: (channel: string, message: string) => void): void {
    this.#client.on("message", listener);
  }

  subscribe(channel: string): Promise<unknown> {
    return this.#client.subscribe(channel);
  }

  socket(): Corkable | undefined {
    const stream = this.#client.stream;
    return typeof stream?.cork === "function" && typeof stream.uncork === "function"
      ? (stream as Corkable)
      : undefined;
  }

  quit(): Promise<unknown> {
    return this.#client.quit();
  }

  disconnect(): void {
    this.#client.disconnect();
  }
}
