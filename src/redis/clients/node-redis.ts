/**
 * The adapter for node-redis (the `redis` package, 5 and 6): a client from `createClient()` or a
 * cluster from `createCluster()`. Scripts go through `sendCommand` as `EVALSHA`, then `EVAL` on
 * `NOSCRIPT`; readiness is `isOpen` and `isReady`; pub/sub listens per channel.
 */

import { type ScriptName, scriptSha, scriptSource } from "../scripts.js";
import type { ConnectionEvent, Corkable, RedisConnection } from "./index.js";

/**
 * The part of a node-redis client or cluster (`createClient()`, `createCluster()`) floodgate
 * uses, as node-redis 5 and 6 declare it.
 */
export interface NodeRedisClient {
  /** Whether it was told to connect and was not closed since. */
  readonly isOpen: boolean;
  sendCommand(...args: any[]): Promise<unknown>;
  duplicate(...args: any[]): unknown;
  connect(): Promise<unknown>;
}

/** The runtime shape used beyond what the types above promise. */
interface Client extends NodeRedisClient {
  /** Connected and ready for commands (a cluster of node-redis 5 has none: `isOpen` stands in). */
  readonly isReady?: boolean;
  getSlotMaster?: unknown;
  on(event: string, listener: (...args: any[]) => void): unknown;
  off(event: string, listener: (...args: any[]) => void): unknown;
  subscribe(channel: string, listener: (message: string, channel: string) => void): Promise<unknown>;
  close?(): Promise<unknown>;
  quit?(): Promise<unknown>;
  destroy?(): void;
  disconnect?(): Promise<unknown>;
}

/** Cluster replies that say a command was not run and may be sent again. */
const RETRIED = /^(?:CLUSTERDOWN|TRYAGAIN)\b/;
/** How long to wait before asking a cluster again after one of those, ms (as ioredis does). */
const RETRY_DELAY_MS = 100;

/** A pause of `ms` that does not keep the process alive. */
function pause(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms).unref());
}

/** Whether `client` is a node-redis client or cluster. */
export function isNodeRedis(client: object): client is NodeRedisClient {
  const c = client as Partial<Client>;
  return (
    typeof c.sendCommand === "function" &&
    typeof c.isOpen === "boolean" &&
    typeof c.duplicate === "function" &&
    typeof c.subscribe === "function"
  );
}

/** The messages of node-redis's errors for a connection that is closed, offline or lost. */
const DOWN =
  /^(The client is closed|The client is offline|Socket closed unexpectedly|Disconnects client|All the root nodes are unavailable|Socket timeout)/;

/** Whether `error` is node-redis saying the connection is not there. */
export function nodeRedisDown(error: Error): boolean {
  return DOWN.test(error.message);
}

/** Each script's SHA, computed once. */
const shas = new Map<ScriptName, string>();

function sha(name: ScriptName): string {
  let value = shas.get(name);
  if (value === undefined) {
    value = scriptSha(name);
    shas.set(name, value);
  }
  return value;
}

/**
 * Whether a node-redis 5 cluster said `connect` since it last said `disconnect`, watched once per
 * client however many backends are built on it (a listener pair each would pile up).
 */
const clusterStates = new WeakMap<object, { up: boolean }>();

function clusterState(client: Client): { up: boolean } {
  let state = clusterStates.get(client);
  if (state === undefined) {
    const s = { up: client.isOpen };
    client.on("connect", () => {
      s.up = true;
    });
    client.on("disconnect", () => {
      s.up = false;
    });
    clusterStates.set(client, s);
    state = s;
  }
  return state;
}

/**
 * A node-redis client or cluster as the backend's one client interface. Its `status()` speaks
 * ioredis's words: `wait` before `connect()`, `connecting`, `ready`, `reconnecting`, `end`.
 */
export class NodeRedisConnection implements RedisConnection {
  readonly library = "node-redis";
  readonly cluster: boolean;
  readonly #client: Client;
  /** Whether it has been ready: once it has, a closed client is closed, not waiting to connect. */
  #wasReady: boolean;
  #listener: ((channel: string, message: string) => void) | undefined = undefined;
  /** The listener of every subscription, one for all: it hands each message to `#listener`. */
  readonly #onMessage = (message: string, from: string) => this.#listener?.(from, message);
  /**
   * On a node-redis 5 cluster, which has no `isReady` (it is open while it still learns its
   * slots): whether it said `connect` (it knows them) since it last said `disconnect`. Taken as
   * true for a cluster open when given.
   */
  #clusterUp: { up: boolean } | undefined = undefined;

  constructor(client: NodeRedisClient) {
    this.#client = client as Client;
    // Only a cluster routes by slot.
    this.cluster = typeof this.#client.getSlotMaster === "function";
    if (this.cluster && !("isReady" in this.#client)) this.#clusterUp = clusterState(this.#client);
    this.#wasReady = this.#ready();
  }

  get client(): object {
    return this.#client;
  }

  #ready(): boolean {
    const c = this.#client;
    return c.isOpen && (this.#clusterUp ? this.#clusterUp.up : c.isReady !== false);
  }

  status(): string {
    if (this.#ready()) {
      this.#wasReady = true;
      return "ready";
    }
    if (this.#client.isOpen) return this.#wasReady ? "reconnecting" : "connecting";
    return this.#wasReady ? "end" : "wait";
  }

  /** A cluster says `connect` once it knows its slots, and `disconnect` when closed. */
  #event(event: ConnectionEvent): string {
    if (!this.cluster) return event;
    return event === "ready" ? "connect" : event === "end" ? "disconnect" : event;
  }

  /** Told when a `connect()` made here fails: a cluster's failed discovery emits no event. */
  readonly #ended = new Set<(...args: any[]) => void>();

  on(event: ConnectionEvent, listener: (...args: any[]) => void): void {
    if (event === "end") this.#ended.add(listener);
    this.#client.on(this.#event(event), listener);
  }

  off(event: ConnectionEvent, listener: (...args: any[]) => void): void {
    if (event === "end") this.#ended.delete(listener);
    this.#client.off(this.#event(event), listener);
  }

  connect(): Promise<unknown> {
    const connecting = this.#client.connect();
    connecting.catch(() => {
      for (const listener of [...this.#ended]) listener();
    });
    return connecting;
  }

  script(
    name: ScriptName,
    keys: readonly string[],
    args: readonly (string | number)[],
    wanted: () => boolean,
  ): Promise<unknown> {
    const argv: string[] = [String(keys.length), ...keys];
    for (const arg of args) argv.push(typeof arg === "string" ? arg : String(arg));
    const client = this.#client;
    const send = this.cluster
      ? (command: string[]) => client.sendCommand(keys[0], false, command)
      : (command: string[]) => client.sendCommand(command);
    const run = () =>
      send(["EVALSHA", sha(name), ...argv]).catch((error: unknown) => {
        // Not in the cache (flushed, or a failover): the body runs it and loads it again.
        if (wanted() && error instanceof Error && error.message.startsWith("NOSCRIPT")) {
          return send(["EVAL", scriptSource(name), ...argv]);
        }
        throw error;
      });
    if (!this.cluster) return run();
    // A cluster that is down for a moment (a master rejoining) or a slot on the move answers
    // without running the script: ask again while the call is wanted (up to its command timeout),
    // as ioredis does by itself.
    const retrying = (): Promise<unknown> =>
      run().catch((error: unknown) => {
        if (!(error instanceof Error && RETRIED.test(error.message) && wanted())) throw error;
        return pause(RETRY_DELAY_MS).then(() => {
          if (!wanted()) throw error;
          return retrying();
        });
      });
    return retrying();
  }

  duplicate(): RedisConnection {
    return new NodeRedisConnection(this.#client.duplicate() as NodeRedisClient);
  }

  onMessage(listener: (channel: string, message: string) => void): void {
    this.#listener = listener;
  }

  subscribe(channel: string): Promise<unknown> {
    // One listener for every channel and every SUBSCRIBE: node-redis keeps a channel's listeners
    // in a set, so subscribing again (after a reconnect: see subscriber.ts) adds none.
    return this.#client.subscribe(channel, this.#onMessage);
  }

  socket(): Corkable | undefined {
    // node-redis writes the commands of one turn together by itself.
    return undefined;
  }

  quit(): Promise<unknown> {
    const c = this.#client;
    return c.close ? c.close() : (c.quit?.() ?? Promise.resolve());
  }

  disconnect(): void {
    const c = this.#client;
    if (c.destroy) c.destroy();
    else void c.disconnect?.().catch(() => {});
  }
}
