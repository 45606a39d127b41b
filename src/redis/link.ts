import type { Clock } from "../clock.js";
import { BackendUnavailableError } from "../errors.js";
import type { Logger } from "../types.js";
import { commandName, defineScripts, type ScriptName } from "./scripts.js";

/** The part of an ioredis client (`Redis` or `Cluster`) floodgate uses. */
export interface RedisClientLike {
  status: string;
  defineCommand(name: string, definition: { numberOfKeys?: number; lua: string }): void;
  duplicate(...args: never[]): RedisClientLike;
  subscribe(...channels: string[]): Promise<unknown>;
  unsubscribe(...channels: string[]): Promise<unknown>;
  on(event: string, listener: (...args: any[]) => void): unknown;
  off?(event: string, listener: (...args: any[]) => void): unknown;
  quit(): Promise<unknown>;
  disconnect(): void;
  connect?(): Promise<unknown>;
}

/** Waiter ids are delivered to every handler registered for the channel. */
type WakeHandler = (id: string) => void;

/** One pub/sub connection and the handlers of every backend that uses it. */
class Subscriber {
  readonly handlers = new Map<string, Set<WakeHandler>>();
  readonly subscribing = new Map<string, Promise<unknown>>();
  constructor(
    readonly connection: RedisClientLike,
    log: Logger,
  ) {
    connection.on("message", (channel: string, id: string) => {
      const set = this.handlers.get(channel);
      if (set) for (const handler of set) handler(id);
    });
    connection.on("error", (error: unknown) => log.warn({ err: error }, "pub/sub connection error"));
  }
}

const subscribers = new WeakMap<RedisClientLike, Subscriber>();

export class RedisLink {
  #subscriber: Subscriber | undefined;
  readonly #mine = new Map<string, WakeHandler>();
  #closed = false;

  constructor(
    readonly client: RedisClientLike,
    readonly clock: Clock,
    readonly commandTimeoutMs: number,
    readonly log: Logger,
    /** Decide with the injected clock's time instead of the server's (tests). */
    readonly useClockTime: boolean,
    /** A connection for pub/sub the caller owns; else one `duplicate()` made on first need. */
    readonly subscriberConnection: RedisClientLike | undefined,
  ) {
    defineScripts(client);
  }

  /** ARGV[1] of every script: the time to decide with, or "" for the server's clock. */
  now(): string {
    return this.useClockTime ? String(this.clock.now()) : "";
  }

  /** Run a script. Rejects with `BackendUnavailableError` when Redis cannot answer in time. */
  run(
    stage: string,
    script: ScriptName,
    keys: readonly string[],
    args: readonly (string | number)[],
  ): Promise<any> {
    const promise = this.#run(stage, script, keys, args);
    this.clock.track?.(promise);
    return promise;
  }

  #run(
    stage: string,
    script: ScriptName,
    keys: readonly string[],
    args: readonly (string | number)[],
  ): Promise<any> {
    const client = this.client as unknown as Record<string, (...a: unknown[]) => Promise<unknown>>;
    if (this.client.status !== "ready") {
      const error = new BackendUnavailableError(
        stage,
        `Redis is not connected (status "${this.client.status}")`,
      );
      unsent.add(error);
      return Promise.reject(error);
    }
    return new Promise((resolve, reject) => {
      let done = false;
      const timer = this.clock.setTimeout(() => {
        if (done) return;
        done = true;
        reject(
          new BackendUnavailableError(
            stage,
            `Redis did not answer ${script} within ${this.commandTimeoutMs} ms`,
          ),
        );
      }, this.commandTimeoutMs);
      client[commandName(script)]!.call(this.client, ...keys, ...args).then(
        (value) => {
          if (done) return;
          done = true;
          this.clock.clearTimeout(timer);
          resolve(value);
        },
        (error: unknown) => {
          if (done) return;
          done = true;
          this.clock.clearTimeout(timer);
          reject(
            isConnectionError(error)
              ? new BackendUnavailableError(stage, `Redis failed: ${message(error)}`, { cause: error })
              : error,
          );
        },
      );
    });
  }

  /** Call `handler` with every message on `channel`; resolves once subscribed. */
  async listen(channel: string, handler: WakeHandler): Promise<void> {
    if (!this.#subscriber) {
      const connection = this.subscriberConnection ?? this.client.duplicate();
      let sub = subscribers.get(connection);
      if (!sub) {
        sub = new Subscriber(connection, this.log);
        subscribers.set(connection, sub);
      }
      this.#subscriber = sub;
    }
    const sub = this.#subscriber;
    this.#mine.set(channel, handler);
    let set = sub.handlers.get(channel);
    if (!set) {
      set = new Set();
      sub.handlers.set(channel, set);
    }
    set.add(handler);
    let pending = sub.subscribing.get(channel);
    if (!pending) {
      pending = this.#subscribe(sub, channel);
      sub.subscribing.set(channel, pending);
      pending.catch(() => sub.subscribing.delete(channel));
    }
    this.clock.track?.(pending);
    await pending;
  }

  /**
   * Subscribe once the connection is ready (a fresh `duplicate()` is still connecting, and with
   * no offline queue a command sent now would fail). Gives up after the command timeout; the
   * waiters' slow poll covers the gap and the next waiter tries again.
   */
  #subscribe(sub: Subscriber, channel: string): Promise<unknown> {
    const connection = sub.connection;
    return new Promise((resolve, reject) => {
      let done = false;
      const finish = (error?: unknown) => {
        if (done) return;
        done = true;
        this.clock.clearTimeout(timer);
        connection.off?.("ready", onReady);
        if (error) reject(error);
        else resolve(undefined);
      };
      const timer = this.clock.setTimeout(
        () =>
          finish(
            new BackendUnavailableError(undefined, `pub/sub not ready within ${this.commandTimeoutMs} ms`),
          ),
        this.commandTimeoutMs,
      );
      const onReady = () => connection.subscribe(channel).then(() => finish(), finish);
      if (connection.status === "ready") onReady();
      else {
        connection.on("ready", onReady);
        // A duplicate of a `lazyConnect` client waits to be told to connect.
        if (connection.status === "wait") connection.connect?.().catch(() => {});
      }
    });
  }

  /** Stop listening; quit the pub/sub connection when this link made it. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    const sub = this.#subscriber;
    this.#subscriber = undefined;
    if (!sub) return;
    for (const [channel, handler] of this.#mine) sub.handlers.get(channel)?.delete(handler);
    if (this.subscriberConnection) return;
    try {
      await sub.connection.quit();
    } catch {
      sub.connection.disconnect();
    }
  }
}

/** Errors of calls that never left this process. */
const unsent = new WeakSet<object>();

/** False when the call failed before it was sent, so Redis cannot have acted on it. */
export function maybeSent(error: unknown): boolean {
  return !(typeof error === "object" && error !== null && unsent.has(error));
}

function message(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/** Errors that mean "Redis could not be reached", as opposed to a script's own error. */
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
    /Connection is closed|Stream isn't writeable|enableOfflineQueue|CLUSTERDOWN|TRYAGAIN|LOADING|Command timed out|connect|Cluster is not ready|None of startup nodes/i.test(
      error.message,
    )
  );
}
