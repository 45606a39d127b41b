import type { RedisClient } from "floodgate/redis";
import { Cluster, type ClusterNode, Redis } from "ioredis";
import { Redis as Valkey, Cluster as ValkeyCluster } from "iovalkey";
import { createClient, createCluster } from "redis";
import { createClient as createClient5, createCluster as createCluster5 } from "redis5";

/**
 * One Redis client library the backend supports, with fail-fast test clients: no retries per
 * request, no offline queue, connected before they are returned. `reconnect` makes a client
 * that reconnects every 50 ms after a lost connection (for the fault tests); otherwise it does
 * not reconnect at all.
 */
export interface Library {
  name: string;
  /** A client not connected yet, with an `error` listener: the backend connects it on its first call. */
  make(url: string, options?: { reconnect?: boolean }): RedisClient;
  connect(url: string, options?: { reconnect?: boolean }): Promise<RedisClient>;
  /**
   * Absent for a library whose Cluster client floodgate does not support. `name` names every
   * connection it makes (CLIENT SETNAME); `reconnect` as for `connect`.
   */
  connectCluster?(
    nodes: readonly ClusterNode[],
    options?: { name?: string; reconnect?: boolean },
  ): Promise<RedisClient>;
  /** A Cluster client not connected yet, with an `error` listener, as `connectCluster` makes it. */
  makeCluster?(nodes: readonly ClusterNode[], options?: { name?: string; reconnect?: boolean }): RedisClient;
  /** Quit when connected, else drop the connection; never throws. */
  close(client: RedisClient): Promise<void>;
}

type AnyClient = {
  status?: string;
  isOpen?: boolean;
  quit?(): Promise<unknown>;
  close?(): Promise<unknown>;
  disconnect?(): unknown;
  destroy?(): void;
};

/** Close any client of any library: politely when it is up, else at once; never throws. */
export async function closeAny(client: RedisClient | undefined): Promise<void> {
  const c = client as AnyClient | undefined;
  if (!c) return;
  try {
    if (typeof c.status === "string") {
      if (c.status === "ready") await c.quit!();
      else c.disconnect!();
    } else if (c.isOpen) {
      await (c.close ? c.close() : c.quit!()).catch(() => c.destroy?.());
    }
  } catch {
    if (typeof c.status === "string") c.disconnect?.();
    else c.destroy?.();
  }
}

const url = (node: ClusterNode) =>
  `redis://${(node as { host: string }).host}:${(node as { port: number }).port}`;

function ioredisFamily(name: string, Client: typeof Redis, ClusterClient: typeof Cluster): Library {
  const library: Library = {
    name,
    make(address, { reconnect = false } = {}) {
      const client = new Client(address, {
        maxRetriesPerRequest: 0,
        enableOfflineQueue: false,
        lazyConnect: true,
        retryStrategy: reconnect ? () => 50 : () => null,
      });
      client.on("error", () => {});
      return client;
    },
    async connect(address, options) {
      const client = library.make(address, options) as Redis;
      await client.connect();
      return client;
    },
    async connectCluster(nodes, options) {
      const client = library.makeCluster!(nodes, options) as Cluster;
      await client.connect();
      return client;
    },
    makeCluster(nodes, { name, reconnect = false } = {}) {
      const client = new ClusterClient([...nodes], {
        redisOptions: {
          maxRetriesPerRequest: 0,
          ...(name ? { connectionName: name } : {}),
          ...(reconnect ? { retryStrategy: () => 50 } : {}),
        },
        enableOfflineQueue: false,
        lazyConnect: true,
        clusterRetryStrategy: reconnect ? () => 50 : () => null,
      });
      client.on("error", () => {});
      return client;
    },
    close: closeAny,
  };
  return library;
}

function nodeRedis(name: string, create: typeof createClient, cluster: typeof createCluster): Library {
  const library: Library = {
    name,
    make(address, { reconnect = false } = {}) {
      const client = create({
        url: address,
        disableOfflineQueue: true,
        socket: { reconnectStrategy: reconnect ? () => 50 : false },
      });
      client.on("error", () => {});
      return client as unknown as RedisClient;
    },
    async connect(address, options) {
      const client = library.make(address, options) as unknown as ReturnType<typeof createClient>;
      await client.connect();
      return client as unknown as RedisClient;
    },
    async connectCluster(nodes, options) {
      const client = library.makeCluster!(nodes, options) as unknown as ReturnType<typeof createCluster>;
      await client.connect();
      return client as unknown as RedisClient;
    },
    makeCluster(nodes, { name, reconnect = false } = {}) {
      const client = cluster({
        rootNodes: nodes.map((node) => ({ url: url(node) })),
        defaults: {
          disableOfflineQueue: true,
          ...(name ? { name } : {}),
          socket: { reconnectStrategy: reconnect ? () => 50 : false },
        },
      });
      client.on("error", () => {});
      return client as unknown as RedisClient;
    },
    close: closeAny,
  };
  return library;
}

/** Every library, by name: ioredis 5, node-redis 6 and 5, iovalkey. */
export const LIBRARIES: readonly Library[] = [
  ioredisFamily("ioredis", Redis, Cluster),
  nodeRedis("node-redis", createClient, createCluster),
  nodeRedis(
    "node-redis5",
    createClient5 as unknown as typeof createClient,
    createCluster5 as unknown as typeof createCluster,
  ),
  ioredisFamily("iovalkey", Valkey as unknown as typeof Redis, ValkeyCluster as unknown as typeof Cluster),
];

/** The libraries other than ioredis, which the existing Redis suites already run on. */
export const OTHER_LIBRARIES: readonly Library[] = LIBRARIES.filter((library) => library.name !== "ioredis");

/** Close any client at once, dropping its connection; never throws. */
export function dropAny(client: RedisClient | undefined): void {
  const c = client as AnyClient | undefined;
  try {
    if (typeof c?.status === "string") c.disconnect?.();
    else if (c?.isOpen) c.destroy?.();
  } catch {
    // Already closed.
  }
}

/** Whether `client`, of any library, is connected and ready for commands. */
export function isReady(client: RedisClient): boolean {
  const c = client as AnyClient & { isReady?: boolean };
  return typeof c.status === "string" ? c.status === "ready" : c.isOpen === true && c.isReady !== false;
}

/** Whether `client` is an ioredis or iovalkey client, whose queues the fault tests can read. */
export function isIoredisFamily(client: RedisClient): client is Redis {
  return typeof (client as AnyClient).status === "string";
}

/** Run one Redis command on `client`, of any library (on a Cluster, routed by its second word, a key). */
export function command(client: RedisClient, args: readonly string[]): Promise<unknown> {
  if (isIoredisFamily(client)) return client.call(args[0]!, ...args.slice(1));
  const c = client as unknown as {
    getSlotMaster?: unknown;
    sendCommand(...a: unknown[]): Promise<unknown>;
  };
  return typeof c.getSlotMaster === "function"
    ? c.sendCommand(args[1], false, [...args])
    : c.sendCommand([...args]);
}
