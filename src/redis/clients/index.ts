/**
 * The one interface the Redis backend sees, whatever client it was given, and the detection
 * that picks the adapter for a client. Nothing outside this folder knows which client it has.
 */

import type { ScriptName } from "../scripts.js";
import { IoredisConnection, type IoredisFamilyClient, isIoredisFamily } from "./ioredis.js";
import { isNodeRedis, type NodeRedisClient, NodeRedisConnection, nodeRedisDown } from "./node-redis.js";

export type { IoredisFamilyClient } from "./ioredis.js";
export type { NodeRedisClient } from "./node-redis.js";

/** The part of a socket that can hold writes back and send them together. */
export interface Corkable {
  cork(): void;
  uncork(): void;
}

/** The events the backend listens to: first ready (and ready again), failed, closed for good. */
export type ConnectionEvent = "ready" | "error" | "end";

/**
 * One client connection as the backend uses it, with the same meaning on every client: scripts
 * by SHA (the body sent once, and again after `NOSCRIPT`), a duplicate for pub/sub, readiness in
 * ioredis's words, and nothing sent while the client is not ready (the link checks `status()`
 * first, so no command ever waits in a client's offline queue).
 */
export interface RedisConnection {
  /** The client itself: what the backend was given (or made with `duplicate()`). */
  readonly client: object;
  /** Which client library, for messages. */
  readonly library: "ioredis" | "node-redis";
  /** A Redis Cluster client: pub/sub counts are per node, and a stage's keys must share a slot. */
  readonly cluster: boolean;
  /**
   * `ready`; `wait` (not told to connect yet: the first call connects it); `connecting`,
   * `connect` or `reconnecting` (on its way); anything else (`end`, `close`) when closed.
   */
  status(): string;
  on(event: ConnectionEvent, listener: (...args: any[]) => void): void;
  off(event: ConnectionEvent, listener: (...args: any[]) => void): void;
  /** Start connecting a client that waits to be told to (`wait`). */
  connect(): Promise<unknown>;
  /**
   * Run a script by its SHA; on `NOSCRIPT` (a flushed cache, a failover) send its body, which
   * loads it again, unless `wanted` says the caller no longer waits for it (it timed out: a
   * body sent then could take what nobody would give back). `keys` may be empty only for a
   * script that takes none.
   */
  script(
    name: ScriptName,
    keys: readonly string[],
    args: readonly (string | number)[],
    wanted: () => boolean,
  ): Promise<unknown>;
  /**
   * A new connection to the same server(s) with the same options, for pub/sub; one that does not
   * subscribe again by itself after a reconnect where the client would do it with a command whose
   * failure nobody hears (ioredis's `autoResubscribe`: that SUBSCRIBE, on a connection cut before
   * its reply with `maxRetriesPerRequest` 0, rejects unhandled and ends the process). The backend
   * subscribes again itself on each `ready` after the first (subscriber.ts).
   */
  duplicate(): RedisConnection;
  /** Call `listener` with every pub/sub message this connection receives. Set once. */
  onMessage(listener: (channel: string, message: string) => void): void;
  /** Subscribe to `channel`; its messages go to the `onMessage` listener. */
  subscribe(channel: string): Promise<unknown>;
  /** The socket, when its writes can be held back to the end of the turn; else undefined. */
  socket(): Corkable | undefined;
  /** Close politely (after replies pending). */
  quit(): Promise<unknown>;
  /** Close at once. */
  disconnect(): void;
}

/**
 * A client `redis(client)` accepts: an ioredis or iovalkey `Redis` or `Cluster`, or a node-redis
 * client made by `createClient()` or `createCluster()` (node-redis 5 or 6).
 */
export type SupportedClient = IoredisFamilyClient | NodeRedisClient;

/**
 * The adapter for `client`, or undefined when it is no client floodgate knows. `scripts`: it
 * will run scripts (not only pub/sub).
 */
export function connectionOf(client: unknown, scripts = true): RedisConnection | undefined {
  if (typeof client !== "object" || client === null) return undefined;
  if (isIoredisFamily(client)) return new IoredisConnection(client, scripts);
  if (isNodeRedis(client)) return new NodeRedisConnection(client);
  return undefined;
}

function message(error: Error): string {
  return error.message;
}

/** Errors that mean "Redis could not be reached", as opposed to a script's own error, on any client. */
export function isConnectionError(error: unknown): boolean {
  if (!(error instanceof Error)) return false;
  const code = (error as { code?: unknown }).code;
  if (
    typeof code === "string" &&
    /^(ECONNREFUSED|ECONNRESET|EPIPE|ETIMEDOUT|ENOTFOUND|EHOSTUNREACH|ENETUNREACH)$/.test(code)
  ) {
    return true;
  }
  return (
    error.name === "MaxRetriesPerRequestError" ||
    nodeRedisDown(error) ||
    /Connection is closed|Stream isn't writeable|enableOfflineQueue|CLUSTERDOWN|TRYAGAIN|LOADING|Command timed out|connect|Cluster is not ready|None of startup nodes/i.test(
      message(error),
    )
  );
}
