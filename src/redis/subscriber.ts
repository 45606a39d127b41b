/**
 * A link's pub/sub: the channels its stages listen on, over one connection per subscriber client,
 * shared by every backend given that client (a `duplicate()` of the link's client, made on first
 * need, when none was given).
 */

import { type Clock, unrefTimer } from "../clock.js";
import { BackendUnavailableError } from "../errors.js";
import type { Logger } from "../types.js";
import type { RedisConnection } from "./clients/index.js";
import { onWire } from "./gate-call.js";

/** Waiter ids are delivered to every handler registered for the channel. */
export type WakeHandler = (id: string) => void;

/**
 * Told that a channel is heard again after its connection was lost: what was published on it
 * meanwhile is lost, so whoever waits for a message there should ask again now.
 */
export type AgainHandler = () => void;

/** The first wait before a channel that could not be subscribed again is asked for again, ms. */
const RESUBSCRIBE_FIRST_MS = 100;
/** The longest wait between those asks, ms (each waits twice the one before). */
const RESUBSCRIBE_MAX_MS = 5_000;

/** One pub/sub connection and the handlers of every backend that uses it. */
class Subscriber {
  readonly handlers = new Map<string, Set<WakeHandler>>();
  readonly again = new Map<string, Set<AgainHandler>>();
  readonly subscribing = new Map<string, Promise<unknown>>();
  /** Counts the connection's `ready`s: a retry left from an earlier one stops (see `#resubscribe`). */
  #readies = 0;
  constructor(
    readonly connection: RedisConnection,
    readonly log: Logger,
    readonly clock: Clock,
  ) {
    connection.onMessage((channel: string, id: string) => {
      const set = this.handlers.get(channel);
      if (set) for (const handler of set) handler(id);
    });
    connection.on("error", (error: unknown) => log.warn({ err: error }, "pub/sub connection error"));
    // On each `ready` after the first (the first subscribes as it is asked), every channel
    // listened to is subscribed again here, and heard again once Redis answers: its `again`
    // handlers are told then. So too on a connection that subscribes again by itself: ioredis
    // sends its own SUBSCRIBE only after telling `ready`, and a message published before Redis
    // reads it is lost, so a waiter that asked on `ready` could still miss its grant. (A second
    // SUBSCRIBE to a channel is answered and changes nothing; node-redis, which tells `ready`
    // once its own are answered, answers it at once.)
    const readyAtStart = connection.status() === "ready";
    connection.on("ready", () => {
      const ready = ++this.#readies;
      if (ready === 1 && !readyAtStart) return;
      for (const [channel, set] of this.handlers) {
        if (set.size > 0) this.#resubscribe(channel, ready, RESUBSCRIBE_FIRST_MS);
      }
    });
  }

  /**
   * Subscribe to `channel` again after the connection's `ready` number `ready`. Refused (an ACL
   * that denies it for now, a connection lost again before it answered), it is asked again after
   * `delayMs`, twice as long each time up to RESUBSCRIBE_MAX_MS, for as long as the connection is
   * that ready's and someone listens on the channel: its waiters poll meanwhile, and a channel
   * left unsubscribed would have them poll until the connection was lost again.
   */
  #resubscribe(channel: string, ready: number, delayMs: number): void {
    this.connection.subscribe(channel).then(
      () => this.#heardAgain(channel),
      (error: unknown) => {
        if (delayMs === RESUBSCRIBE_FIRST_MS) {
          this.log.warn(
            { err: error, channel },
            "pub/sub: could not subscribe again; asking again shortly, waiters poll until it does",
          );
        }
        const timer = this.clock.setTimeout(() => {
          const wanted = (this.handlers.get(channel)?.size ?? 0) > 0;
          if (ready !== this.#readies || !wanted || this.connection.status() !== "ready") return;
          this.#resubscribe(channel, ready, Math.min(delayMs * 2, RESUBSCRIBE_MAX_MS));
        }, delayMs);
        unrefTimer(timer);
      },
    );
  }

  #heardAgain(channel: string): void {
    const set = this.again.get(channel);
    if (set) for (const again of [...set]) again();
  }
}

/** Add `value` to the set of `key` in `sets`, made on first need. */
function addTo<T>(sets: Map<string, Set<T>>, key: string, value: T): void {
  let set = sets.get(key);
  if (!set) {
    set = new Set();
    sets.set(key, set);
  }
  set.add(value);
}

/** The pub/sub connection of each subscriber client, shared by the backends given it. */
const subscribers = new WeakMap<object, Subscriber>();

/** The channels one link listens on, and the subscriber connection it listens through. */
export class Listening {
  #subscriber: Subscriber | undefined;
  readonly #mine = new Map<string, WakeHandler>();
  readonly #mineAgain = new Map<string, AgainHandler>();

  constructor(
    /** The link's client: its `duplicate()` is the subscriber when none is `given`. */
    readonly client: RedisConnection,
    /** A connection for pub/sub the caller owns, if any. */
    readonly given: RedisConnection | undefined,
    readonly log: Logger,
    readonly clock: Clock,
    /** How long a subscription may take to be made, ms (the link's command timeout). */
    readonly timeoutMs: number,
  ) {}

  /**
   * Call `handler` with every message on channel `name`, and `again` (if given) each time the
   * channel is heard again after its connection was lost; resolves once subscribed.
   */
  async listen(name: string, handler: WakeHandler, again?: AgainHandler): Promise<void> {
    // Messages come named as Redis has the channel: a lone surrogate in a stage's name is U+FFFD.
    const channel = onWire(name);
    if (!this.#subscriber) {
      const connection = this.given ?? this.client.duplicate();
      let sub = subscribers.get(connection.client);
      if (!sub) {
        sub = new Subscriber(connection, this.log, this.clock);
        subscribers.set(connection.client, sub);
      }
      this.#subscriber = sub;
    }
    const sub = this.#subscriber;
    this.#mine.set(channel, handler);
    addTo(sub.handlers, channel, handler);
    if (again !== undefined) {
      this.#mineAgain.set(channel, again);
      addTo(sub.again, channel, again);
    }
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
        connection.off("ready", onReady);
        if (error) reject(error);
        else resolve(undefined);
      };
      const timer = this.clock.setTimeout(
        () => finish(new BackendUnavailableError(undefined, `pub/sub not ready within ${this.timeoutMs} ms`)),
        this.timeoutMs,
      );
      const onReady = () => connection.subscribe(channel).then(() => finish(), finish);
      if (connection.status() === "ready") onReady();
      else {
        connection.on("ready", onReady);
        // A duplicate of a `lazyConnect` client (or any node-redis duplicate) waits to be told to connect.
        if (connection.status() === "wait") connection.connect().catch(() => {});
      }
    });
  }

  /** Stop listening; quit the pub/sub connection when it was made here. */
  async close(): Promise<void> {
    const sub = this.#subscriber;
    this.#subscriber = undefined;
    if (!sub) return;
    for (const [channel, handler] of this.#mine) sub.handlers.get(channel)?.delete(handler);
    for (const [channel, again] of this.#mineAgain) sub.again.get(channel)?.delete(again);
    if (this.given) return;
    try {
      await sub.connection.quit();
    } catch {
      sub.connection.disconnect();
    }
  }
}
