/**
 * The Redis link: scripts by SHA with the NOSCRIPT fallback, command timeouts, corked batches,
 * the first connection, the server's clock, a fused gate's stage script calls gathered into one
 * `gate` call (its encoding in gate-call.ts, a turn's releases made one step in
 * turn-releases.ts, its replies read in gate-reply.ts), and pub/sub (subscriber.ts). Over 350
 * lines because every call goes through its one queue of pending replies, which these parts
 * share.
 */

import { endTurn, startTurn } from "../base/flow.js";
import { backendErrorChannel } from "../channels.js";
import { type Clock, type ClockTimer, unrefTimer } from "../clock.js";
import { BackendUnavailableError, isFloodgateError } from "../errors.js";
import type { Logger } from "../types.js";
import { ScriptBatch } from "./batch.js";
import { type Corkable, isConnectionError, type RedisConnection } from "./clients/index.js";
import {
  encodeGateCall,
  type GateCall,
  type GateHead,
  type GateReply,
  type Late,
  NOT_RUN,
  type Step,
} from "./gate-call.js";
import { ranLate, readGateReplies } from "./gate-reply.js";
import { GATE_STEPS, type GateStep, SCRIPTS, type ScriptName } from "./scripts.js";
import { type AgainHandler, Listening, type WakeHandler } from "./subscriber.js";
import { together } from "./turn-releases.js";

export { isConnectionError } from "./clients/index.js";

/**
 * The scripts whose calls may be held back to the end of the turn and sent with others: the
 * token bucket's and the interval gate's, which many callers run at once for one key or host.
 */
const CORKED: ReadonlySet<ScriptName> = new Set(
  (Object.keys(SCRIPTS) as ScriptName[]).filter((name) => /^(token-bucket|interval-gate)-/.test(name)),
);

const STEPS: ReadonlySet<ScriptName> = new Set(GATE_STEPS);

/** A script call waiting for its reply, in a list ordered by deadline. */
class Call {
  prev: Call | undefined = undefined;
  next: Call | undefined = undefined;
  done = false;
  constructor(
    readonly stage: string,
    readonly script: ScriptName,
    readonly deadline: number,
    readonly resolve: (value: unknown) => void,
    readonly reject: (error: unknown) => void,
  ) {}
}

/** `error` (a failed Redis call of a stage), published on `floodgate:backend-error` when anyone listens. */
function published(error: BackendUnavailableError): BackendUnavailableError {
  if (backendErrorChannel.hasSubscribers) {
    backendErrorChannel.publish({ stage: error.stage, backend: "redis", error });
  }
  return error;
}

/** A timer that can stop keeping the process alive, and start again (Node's). */
interface Refable {
  ref(): unknown;
  unref(): unknown;
}

export class RedisLink {
  readonly #listening: Listening;
  #closed = false;
  /**
   * Calls waiting for a reply, oldest first. Every call has the same timeout, so this is also
   * deadline order, and one timer (for the oldest) times them all out instead of one per call.
   */
  #first: Call | undefined = undefined;
  #last: Call | undefined = undefined;
  /** Set while calls wait; with none left, it may be left to run out (see `#remove`). */
  #timer: ClockTimer | undefined = undefined;
  /** The socket held back until the current turn of the event loop ends, if any. */
  #corked: Corkable | undefined = undefined;
  readonly #sweep = () => this.#timeOut();
  readonly #uncorked = () => {
    const stream = this.#corked;
    this.#corked = undefined;
    stream?.uncork();
  };

  constructor(
    /** The client, whichever library it is from, behind the one interface of clients/. */
    readonly client: RedisConnection,
    readonly clock: Clock,
    readonly commandTimeoutMs: number,
    readonly log: Logger,
    /** Decide with the injected clock's time instead of the server's (tests). */
    readonly useClockTime: boolean,
    /** A connection for pub/sub the caller owns; else one `duplicate()` made on first need. */
    subscriberConnection: RedisConnection | undefined,
  ) {
    this.#listening = new Listening(client, subscriberConnection, log, clock, commandTimeoutMs);
    this.#connected = client.status() === "ready";
    if (!this.#connected) client.on("ready", this.#onReady);
    this.listeners = client.cluster ? "" : "1";
  }

  /**
   * How far the time scripts decide with (the server's) is ahead of this process's clock, at
   * most, ms; `undefined` until a script has said. A script that ran at server time `at` was sent
   * at local time `sentAt` or later, so `at - sentAt` can only overstate it: a grant judged by it
   * ends here no later than it ends on the server, even after this process was frozen (the
   * monotonic clock runs on while a process is stopped).
   */
  serverAhead: number | undefined = undefined;

  /** Note a script's time `at` (server ms), for a call sent at local time `sentAt`. */
  sawServerTime(at: number, sentAt: number): void {
    if (Number.isFinite(at)) this.serverAhead = at - sentAt;
  }

  /**
   * Whether scripts may ask Redis who listens on a grant channel ("1"), or not (""): on a
   * cluster, pub/sub counts are per node, so nobody would seem to listen.
   */
  readonly listeners: "1" | "";

  /** ARGV[1] of every script: the time to decide with, or "" for the server's clock. */
  now(): string {
    return this.useClockTime ? String(this.clock.now()) : "";
  }

  /**
   * Run a script. Rejects with `BackendUnavailableError` when Redis cannot answer in time. `late`
   * is told (with the call's keys, arguments and reply) when a call that was failed so ran all the same,
   * later: a client may hold a command back and send it again by itself (a Cluster client after
   * its connection closed, a client that resends what was unanswered when it reconnects), after
   * its caller gave back what it would take.
   */
  run(
    stage: string,
    script: ScriptName,
    keys: readonly string[],
    args: readonly (string | number)[],
    late?: Late,
  ): Promise<any> {
    const gathering = this.#gathering;
    if (gathering !== undefined && STEPS.has(script)) {
      return new Promise((resolve, reject) => {
        gathering.push({ script: script as GateStep, keys, args, resolve, reject, late: undefined });
      });
    }
    const promise = this.#run(stage, script, keys, args, late);
    this.clock.track?.(promise);
    return promise;
  }

  /**
   * Run a script that a fused gate can gather, told to `resolve` with its reply or `reject` rather
   * than by a promise: while a `gate` call is gathered (see `gather`), as one of its steps, with
   * no promise made (rejected with `NOT_RUN` when the script did not run it); else as `run`.
   * `late` is told the step's keys, arguments and reply when its call, alone or the `gate` call,
   * was failed for not answering in time and ran all the same (see `run`), whatever it decided.
   */
  step(
    stage: string,
    script: GateStep,
    keys: readonly string[],
    args: readonly (string | number)[],
    resolve: (reply: any) => void,
    reject: (error: unknown) => void,
    late?: Late,
  ): void {
    const gathering = this.#gathering;
    if (gathering !== undefined) gathering.push({ script, keys, args, resolve, reject, late });
    else this.run(stage, script, keys, args, late).then(resolve, reject);
  }

  /** Script calls made while `gather` runs its function; undefined otherwise. */
  #gathering: Step[] | undefined = undefined;
  /** The head of the `gate` call being gathered, while `gather` runs its function. */
  #gatheringFor: GateHead | undefined = undefined;

  /**
   * The head of the `gate` call that script calls made now go in (see `gather`): a stage tells
   * by it whether a release of its own goes through a fused gate, and which. Undefined otherwise.
   */
  get gatheringFor(): GateHead | undefined {
    return this.#gatheringFor;
  }

  /**
   * Run each call's `fn`, gathering the stage script calls it makes (synchronously) as that
   * call's steps, and send them all as one `gate` call (lua/gate.lua); each stage script call
   * settles with its step's reply. Resolves with one reply per call, or is undefined when no
   * call made a script call (and the op is neither "leave" nor "grant", which need none).
   * `late`, for an admission, is told the calls and the `gate` call's replies should it run after
   * it was failed (see `Late`), after each step's own handler: one function serves every turn.
   */
  gather(
    stage: string,
    head: GateHead,
    calls: readonly GateCall[],
    late?: (calls: readonly GateCall[], replies: unknown) => void,
  ): Promise<GateReply[]> | undefined {
    const stepsOf: Step[][] = [];
    let total = 0;
    ScriptBatch.direct = true;
    this.#gatheringFor = head;
    // (The stages on this link's clock read it once for the whole turn, as it is sent: what is
    // judged by when a call was sent then errs early, never late.)
    const sentAt = this.clock.now();
    const turnStarted = startTurn(this.clock, sentAt);
    try {
      for (const call of calls) {
        const steps: Step[] = [];
        this.#gathering = steps;
        try {
          call.fn(() => steps.length);
        } finally {
          this.#gathering = undefined;
        }
        stepsOf.push(steps);
        total += steps.length;
      }
    } finally {
      ScriptBatch.direct = false;
      this.#gatheringFor = undefined;
      endTurn(turnStarted);
    }
    if (total === 0 && head.op !== "leave" && head.op !== "grant") return undefined;
    if (head.op === "each") for (let c = 0; c < stepsOf.length; c++) stepsOf[c] = together(stepsOf[c]!);
    const { keys, args } = encodeGateCall(head, calls, stepsOf, this.now());
    // (Only an admission's steps take anything that a call run late must give back.)
    const ranLateAll: Late | undefined =
      head.op === "all"
        ? (_k, _a, replies) => {
            ranLate(stepsOf, replies);
            late?.(calls, replies);
          }
        : undefined;
    return this.run(stage, "gate", keys, args, ranLateAll).then(
      (replies: Parameters<typeof readGateReplies>[0]) => readGateReplies(replies, stepsOf, sentAt, this),
      (error: unknown) => {
        for (const steps of stepsOf) for (const step of steps) step.reject(error);
        throw error;
      },
    );
  }

  #run(
    stage: string,
    script: ScriptName,
    keys: readonly string[],
    args: readonly (string | number)[],
    late?: Late,
  ): Promise<any> {
    const client = this.client;
    const status = client.status();
    if (status !== "ready") {
      // A client made just now is still connecting: wait for it, up to the command timeout,
      // rather than fail the first calls of a process. Once it has been ready, a client that is
      // not fails calls at once (the fail-closed promise).
      if (!this.#connected && FIRST_CONNECT.has(status) && !this.#closed) {
        return this.#firstConnection().then((ready) =>
          ready ? this.#run(stage, script, keys, args, late) : this.#notConnected(stage),
        );
      }
      return this.#notConnected(stage);
    }
    return new Promise((resolve, reject) => {
      const call = new Call(stage, script, this.clock.now() + this.commandTimeoutMs, resolve, reject);
      // While replies are awaited, more calls are likely to come in this same turn: hold the
      // socket's writes back until the turn ends and send them with one system call. Only for
      // the token bucket and interval gate, whose callers are known to gain from it.
      if (this.#first !== undefined && this.#corked === undefined && CORKED.has(script)) this.#cork();
      this.#push(call);
      const answered = (value: unknown) => {
        if (call.done) {
          // Failed when it timed out, and run all the same (see `run`).
          late?.(keys, args, value);
          return;
        }
        this.#remove(call);
        resolve(value);
      };
      const failed = (error: unknown) => {
        if (call.done) {
          // Failed when it timed out, and failed by the client later: a client that held it back
          // gives up on it in the end (a Cluster client sends a command again after a closed
          // connection, up to its redirections, then rejects it), and one of its sends may have
          // run, after the give-back its caller sent when it failed closed. Given back again,
          // as for a reply that came late, without the reply (what was taken is given back by
          // name, or while it is the latest: never more than the call took).
          late?.(keys, args, undefined);
          return;
        }
        this.#remove(call);
        // Anything else Redis answers instead of a reply (a replica after a failover, out of
        // memory, a busy or failing script) fails closed too, typed, with Redis's error as cause.
        reject(
          published(
            new BackendUnavailableError(
              stage,
              isConnectionError(error) ? `Redis failed: ${message(error)}` : refused(script, error),
              { cause: error },
            ),
          ),
        );
      };
      // By SHA; the connection sends the body after NOSCRIPT while the call still waits.
      client.script(script, keys, args, () => !call.done).then(answered, failed);
    });
  }

  #notConnected(stage: string): Promise<never> {
    const error = new BackendUnavailableError(
      stage,
      `Redis is not connected (status "${this.client.status()}")`,
    );
    unsent.add(error);
    return Promise.reject(published(error));
  }

  /** Whether the client has been ready since this link was made. */
  #connected = false;
  #waitingForFirst: Promise<boolean> | undefined = undefined;

  /**
   * Resolves true once the client is ready for the first time; false when its connection fails
   * (refused, closed: calls fail closed at once, as on a client that was ready before) or it is
   * not ready within the command timeout.
   */
  #firstConnection(): Promise<boolean> {
    this.#waitingForFirst ??= new Promise<boolean>((resolve) => {
      const client = this.client;
      const done = (ready: boolean) => {
        this.clock.clearTimeout(timer);
        client.off("ready", onReady);
        client.off("error", onFailed);
        client.off("end", onFailed);
        this.#waitingForFirst = undefined;
        resolve(ready);
      };
      const onReady = () => done(true);
      const onFailed = () => done(false);
      const timer = this.clock.setTimeout(() => done(client.status() === "ready"), this.commandTimeoutMs);
      client.on("ready", onReady);
      client.on("error", onFailed);
      client.on("end", onFailed);
      // A `lazyConnect` client connects on its first command: floodgate's first call is that.
      // A connect that fails (a refused cluster discovery says so only here) fails it at once.
      if (client.status() === "wait") client.connect().catch(onFailed);
    });
    return this.#waitingForFirst;
  }

  /** Hold the client's socket writes back until the end of this turn of the event loop. */
  #cork(): void {
    const stream = this.client.socket();
    if (stream === undefined) return;
    stream.cork();
    this.#corked = stream;
    process.nextTick(this.#uncorked);
  }

  #push(call: Call): void {
    if (this.#last === undefined) {
      this.#first = call;
      // A timer left to run out (see `#remove`) is taken up again: it runs out no later than
      // this call's deadline, and then waits for the call's.
      if (this.#timer === undefined) this.#timer = this.clock.setTimeout(this.#sweep, this.commandTimeoutMs);
      else (this.#timer as Refable).ref();
    } else {
      this.#last.next = call;
      call.prev = this.#last;
    }
    this.#last = call;
  }

  /**
   * Take a settled call out of the list. With nothing left to time, the timer is left to run out
   * where the clock's timers can stop keeping the process alive (the system clock's), and taken
   * up by the next call: a caller that waits for each reply before its next call would otherwise
   * set a timer and clear it for every call. Else it goes.
   */
  #remove(call: Call): void {
    call.done = true;
    const { prev, next } = call;
    if (prev) prev.next = next;
    else this.#first = next;
    if (next) next.prev = prev;
    else this.#last = prev;
    call.prev = call.next = undefined;
    if (this.#first === undefined && this.#timer !== undefined) {
      const timer = this.#timer as Partial<Refable>;
      if (typeof timer.unref === "function" && typeof timer.ref === "function" && !this.#closed)
        timer.unref();
      else {
        this.clock.clearTimeout(this.#timer);
        this.#timer = undefined;
      }
    }
  }

  /** Fail every call past its deadline; wait for the next one's. */
  #timeOut(): void {
    this.#timer = undefined;
    const now = this.clock.now();
    for (let call = this.#first; call !== undefined && call.deadline <= now; call = this.#first) {
      this.#remove(call);
      call.reject(
        published(
          new BackendUnavailableError(
            call.stage,
            `Redis did not answer ${call.script} within ${this.commandTimeoutMs} ms`,
          ),
        ),
      );
    }
    if (this.#first !== undefined && this.#timer === undefined) {
      this.#timer = this.clock.setTimeout(this.#sweep, this.#first.deadline - now);
    }
  }

  /**
   * Call `handler` with every message on channel `name`, and `again` (if given) each time the
   * channel is heard again after its pub/sub connection was lost; resolves once subscribed.
   */
  listen(name: string, handler: WakeHandler, again?: AgainHandler): Promise<void> {
    return this.#listening.listen(name, handler, again);
  }

  readonly #onReady = () => {
    this.#connected = true;
    this.client.off("ready", this.#onReady);
  };

  /** Stop listening; quit the pub/sub connection when this link made it. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    // (A timer left to run out: no call is left to time.)
    if (this.#first === undefined && this.#timer !== undefined) {
      this.clock.clearTimeout(this.#timer);
      this.#timer = undefined;
    }
    this.client.off("ready", this.#onReady);
    await this.#listening.close();
  }
}

/**
 * Statuses of a client on its way to its first connection. A `lazyConnect` client not told to
 * connect yet (`wait`) is told to by the first call, which then waits for it like the others.
 */
const FIRST_CONNECT: ReadonlySet<string> = new Set(["wait", "connecting", "connect", "reconnecting"]);

/**
 * Errors of calls that never left this process, and of steps the gate script did not run
 * (`NOT_RUN`: a caller ahead in line, or kept steps no release ran and the next try replaced).
 */
const unsent = new WeakSet<object>([NOT_RUN]);

/**
 * How long to wait before asking Redis again, `waitedMs` into asking while it is away: 25 ms, then
 * longer the longer it has been away (doubling every 100 ms of it), at most `capMs`.
 */
export function awayDelay(waitedMs: number, capMs: number): number {
  return Math.min(capMs, 25 * 2 ** Math.min(6, Math.floor(waitedMs / 100)));
}

/**
 * A give-back in the background that failed with `error` (`waitedMs` after its first send): with
 * Redis away (a dropped connection, a pause), `again` is called shortly, backing off from 25 ms up
 * to `capMs` (`awayDelay`), for as long as what it gives back could still be held (`boundMs`);
 * returns whether it will be. What is not given back so runs out by itself. (A waiter's ask of its
 * process's choosing is asked again so too: see the permit stages' `#attempt`.)
 */
export function askAgainWhileAway(
  clock: Clock,
  error: unknown,
  waitedMs: number,
  capMs: number,
  boundMs: number,
  again: (waitedMs: number) => void,
): boolean {
  const delay = awayDelay(waitedMs, capMs);
  if (!isFloodgateError(error, "BACKEND_UNAVAILABLE") || waitedMs + delay >= boundMs) return false;
  unrefTimer(clock.setTimeout(() => again(waitedMs + delay), delay));
  return true;
}

/**
 * A waiter's ask that failed with `error`: when it was an ask of its process's choosing (`softMs`
 * defined: how long such asks have failed for, see the permit stages' `#attempt`), and Redis is
 * away, `again` is called shortly, for up to `pollMs` in all; returns whether it will be (else the
 * waiter fails closed, as its own ask would have).
 */
export function askSoftlyAgain(
  clock: Clock,
  error: unknown,
  softMs: number | undefined,
  pollMs: number,
  again: (softMs: number) => void,
): boolean {
  return softMs !== undefined && askAgainWhileAway(clock, error, softMs, pollMs, pollMs, again);
}

/**
 * What a waiter's next ask is to be, once the ask it has out is answered, when another is wanted
 * meanwhile (`softMs`: as in `askSoftlyAgain`, undefined for one of its own schedule), given what
 * was wanted before (`wanted`, with `before` its `softMs`): an ask of its own schedule wins, and of
 * two of its process's choosing, the one failed for longer. An ask of its process's choosing stays
 * so when it has to wait for the one out: Redis away then fails nothing either.
 */
export function askWanted(
  wanted: boolean,
  before: number | undefined,
  softMs: number | undefined,
): number | undefined {
  if (!wanted) return softMs;
  return before === undefined || softMs === undefined ? undefined : Math.max(before, softMs);
}

/**
 * False when the call failed before it was sent, or was a gate call's step that did not run, so
 * Redis cannot have acted on it (nothing to give back).
 */
export function maybeSent(error: unknown): boolean {
  return !(typeof error === "object" && error !== null && unsent.has(error));
}

function message(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/**
 * What a call fails with when Redis answers `script` with `error` instead of a reply; with what
 * to do about it when that is known: a server whose Lua has no `cjson` (Debian 11's packaged
 * `redis-server` is built so) cannot run a fused gate's script, ever.
 */
export function refused(script: string, error: unknown): string {
  const text = message(error);
  const hint = /nonexistent global variable 'cjson'/.test(text)
    ? " (this server's Lua has no cjson, which a fused gate's script needs: build the gate with" +
      ' `fuse: false`, or run a Redis built with its own Lua; see docs/redis.md, "Which Redis")'
    : "";
  return `Redis refused ${script}: ${text}${hint}`;
}
