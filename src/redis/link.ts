/**
 * The Redis link: scripts by SHA with the NOSCRIPT fallback, command timeouts, corked batches,
 * the first connection, the server's clock and the pub/sub subscriber. Over 350 lines because
 * every call goes through its one queue of pending replies, which these parts share.
 */

import { endTurn, startTurn } from "../base/flow.js";
import { backendErrorChannel } from "../channels.js";
import type { Clock, ClockTimer } from "../clock.js";
import { BackendUnavailableError } from "../errors.js";
import type { Logger } from "../types.js";
import { ScriptBatch } from "./batch.js";
import { type Corkable, isConnectionError, type RedisConnection } from "./clients/index.js";
import { GATE_STEPS, type GateStep, SCRIPTS, type ScriptName } from "./scripts.js";

export { isConnectionError } from "./clients/index.js";

/** Waiter ids are delivered to every handler registered for the channel. */
type WakeHandler = (id: string) => void;

/** One pub/sub connection and the handlers of every backend that uses it. */
class Subscriber {
  readonly handlers = new Map<string, Set<WakeHandler>>();
  readonly subscribing = new Map<string, Promise<unknown>>();
  constructor(
    readonly connection: RedisConnection,
    log: Logger,
  ) {
    connection.onMessage((channel: string, id: string) => {
      const set = this.handlers.get(channel);
      if (set) for (const handler of set) handler(id);
    });
    connection.on("error", (error: unknown) => log.warn({ err: error }, "pub/sub connection error"));
    if (connection.resubscribes) return;
    // A connection that does not subscribe again by itself after a reconnect: every channel
    // listened to, again, on each `ready` after the first (the first subscribes as it is asked).
    let before = connection.status() === "ready";
    connection.on("ready", () => {
      if (!before) {
        before = true;
        return;
      }
      for (const [channel, set] of this.handlers) {
        if (set.size === 0) continue;
        connection.subscribe(channel).catch((error: unknown) => {
          log.warn({ err: error, channel }, "pub/sub: could not subscribe again; waiters poll until it does");
        });
      }
    });
  }
}

/** The pub/sub connection of each subscriber client, shared by the backends given it. */
const subscribers = new WeakMap<object, Subscriber>();

/**
 * The scripts whose calls may be held back to the end of the turn and sent with others: the
 * token bucket's and the interval gate's, which many callers run at once for one key or host.
 */
const CORKED: ReadonlySet<ScriptName> = new Set(
  (Object.keys(SCRIPTS) as ScriptName[]).filter((name) => /^(token-bucket|interval-gate)-/.test(name)),
);

const STEPS: ReadonlySet<ScriptName> = new Set(GATE_STEPS);

/** A script call gathered by `gather`, sent as one step of a `gate` call. */
interface Step {
  script: GateStep;
  keys: readonly string[];
  args: readonly (string | number)[];
  resolve: (reply: unknown) => void;
  reject: (error: unknown) => void;
  /** Told, with the step's keys, arguments and reply, when its call ran after it was failed (see `step`). */
  late?: Late | undefined;
}

/**
 * What a script call gives back when it ran after it was failed for not answering in time (see
 * `RedisLink.run`): told the call's keys and arguments and its reply (a step's own, in a `gate`
 * call; undefined when that call's reply holds none for the step), so one function serves every
 * call of a stage. Told too, with no reply, when the client fails such a call by itself later: it
 * may have run, and gives back what can be given back without knowing what it took.
 */
export type Late = (keys: readonly string[], args: readonly (string | number)[], reply: unknown) => void;

/** The reply of a `gate` call to one of its calls (see lua/gate.lua). */
export interface GateReply {
  /** 1: admitted (or ran); 0: refused, nothing held. */
  status: number;
  /** Refused by metering stages only, first in its lane: ms until the slowest could admit; else -1. */
  waitMs: number;
  /** Where the caller waits: in the gate's permit line, in its lane, or in neither. */
  inLine: "permits" | "lane" | undefined;
  /** The waiters told to ask again (in this process or another). */
  woken: readonly string[];
  /** The script's replies to the call's steps, in order (null for a step not run). */
  replies: unknown[];
  /**
   * Status 2: the replies to the steps of the call's earlier try that were kept, which a release
   * admitted (this try's steps did not run).
   */
  collected?: unknown[];
  /**
   * The call waits in the permit line with its steps kept (mode "hold"): they are left unsettled
   * until this settles them, with the replies of a grant, or with none (they did not run).
   */
  hold?: (replies: unknown[] | undefined) => void;
  /**
   * With `hold`: a later try of the call, run after it was failed, collected a grant made to the
   * kept steps (its reply's status 2), though `hold` had settled them as not run (the caller gave
   * up). Each kept step's late handler is told its reply in the grant, and gives back what the
   * grant took for it; nothing is done when `hold` settled the steps with a grant.
   */
  collectedLate?: (replies: unknown[]) => void;
  /**
   * A call waiting in the permit line: how long, in all, the line's firsts have kept their place
   * waiting for a rate (ms, growing; those behind them wait for it too), and the first key (as
   * Redis has it) of the step the latest waited for, a token bucket's or interval gate's.
   */
  lineRateMs?: number;
  lineRateKey?: string;
  /**
   * The permit line took the call with its lane since its previous try (its lane's first was
   * refused permits): how long ago (ms, on the server's clock, at this decision), `lineRateMs` as
   * it was then, and the first key (as Redis has it) of the permit stage that refused.
   */
  moved?: { agoMs: number; lineRateMs: number; key: string };
}

/** What every call of one `gate` script call shares: see lua/gate.lua. */
export interface GateHead {
  /** The gate's keys: its permit line, the line's expiries, its sequence, kept steps, their expiries. */
  keys: readonly string[];
  op: "all" | "each" | "leave" | "grant";
  waiterTtlMs: number;
  channel: string;
}

/** One call of a `gate` script call. */
export interface GateCall {
  /** The caller's place in line ("" for none). */
  member: string;
  mode: "hold" | "wait" | "try";
  /** The try's number (for the grant of its kept steps), or "". */
  try: number | "";
  /** The number of the caller's earlier try whose steps were kept, or "". */
  held: number | "";
  /** The call's lane and the lane's expiries. */
  lane: readonly string[];
  /** Makes the call's stage script calls, gathered as its steps; given the number gathered so far. */
  fn: (steps: () => number) => void;
}

const LINES = [undefined, "permits", "lane"] as const;

/** The `woken` of a reply that woke no one (lua/gate.lua sends 0). */
const NO_ONE: readonly string[] = [];

export const NOT_RUN = new Error("not run: another caller is ahead in the gate's line");

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

export class RedisLink {
  #subscriber: Subscriber | undefined;
  readonly #mine = new Map<string, WakeHandler>();
  #closed = false;
  /**
   * Calls waiting for a reply, oldest first. Every call has the same timeout, so this is also
   * deadline order, and one timer (for the oldest) times them all out instead of one per call.
   */
  #first: Call | undefined = undefined;
  #last: Call | undefined = undefined;
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
    readonly subscriberConnection: RedisConnection | undefined,
  ) {
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
    const keys = [...head.keys];
    const args: (string | number)[] = [this.now(), head.op, head.waiterTtlMs, head.channel, calls.length];
    // Each script's steps sent so far, by their keys (a stage's own list, or a bucket's or host's
    // one key): a step that repeats one is sent as the arguments that differ (lua/gate.lua).
    const earlier = new Map<string, Map<unknown, number>>();
    const all: Step[] = [];
    for (let c = 0; c < calls.length; c++) {
      const call = calls[c]!;
      const steps = stepsOf[c]!;
      // A call's fields go as one argument, a JSON list of strings: a client pays for each
      // argument of a command far more than for its length (bench/RESULTS.md).
      const fields: string[] = [call.member, call.mode, String(call.try), String(call.held)];
      // A call of the lane of the call before it, whose steps repeat that call's but for their
      // own arguments, goes as those alone.
      if (c > 0 && sameLane(call.lane, calls[c - 1]!.lane) && repeats(steps, stepsOf[c - 1]!)) {
        fields.push("*");
        for (const step of steps) for (const i of OWN[step.script]!) fields.push(String(step.args[i]!));
        args.push(callJson(fields));
        continue;
      }
      keys.push(call.lane[0]!, call.lane[1]!);
      fields.push(String(steps.length));
      for (const step of steps) {
        let sameScript = earlier.get(step.script);
        if (sameScript === undefined) {
          sameScript = new Map();
          earlier.set(step.script, sameScript);
        }
        const id = step.keys.length === 1 ? step.keys[0] : step.keys;
        const at = sameScript.get(id);
        const base = at === undefined ? undefined : all[at - 1];
        // A release that differs from the earlier one only in its own arguments goes as those
        // (it is not numbered: a later step repeats the earlier one).
        if (base !== undefined && REPEATING.has(step.script) && ownOnly(step, base)) {
          fields.push("~", String(at));
          for (const i of OWN[step.script]!) fields.push(String(step.args[i]!));
          continue;
        }
        all.push(step);
        sameScript.set(id, all.length);
        if (base !== undefined && base.args.length === step.args.length) {
          const n = fields.length + 2;
          fields.push("=", String(at), "");
          for (let i = 1; i < step.args.length; i++) {
            const x = step.args[i]!;
            const y = base.args[i]!;
            // (Alike when equal, or when they differ as number and string only.)
            if (x !== y && (typeof x === typeof y || String(x) !== String(y)))
              fields.push(String(i + 1), String(x));
          }
          fields[n] = String((fields.length - n - 1) / 2);
          continue;
        }
        fields.push(step.script, String(step.keys.length), String(step.args.length));
        for (const key of step.keys) keys.push(key);
        for (let i = 1; i < step.args.length; i++) fields.push(String(step.args[i]!));
      }
      args.push(callJson(fields));
    }
    // (Only an admission's steps take anything that a call run late must give back.)
    const ranLateAll: Late | undefined =
      head.op === "all"
        ? (_k, _a, replies) => {
            ranLate(stepsOf, replies);
            late?.(calls, replies);
          }
        : undefined;
    return this.run(stage, "gate", keys, args, ranLateAll).then(
      (replies: (GateCallReply | 1 | unknown[])[]) => {
        // Calls admitted in one pass answer 1; their steps' replies follow the last call's reply.
        const flat = replies.length > calls.length ? (replies[calls.length] as unknown[]) : undefined;
        let at = 0;
        if (flat) this.sawServerTime(Number(flat[flat.length - 1]), sentAt);
        // (The stages the replies settle read the clock once for them all.)
        const turnStarted = startTurn(this.clock);
        try {
          return stepsOf.map((steps, c): GateReply => {
            const reply = replies[c]!;
            if (reply === 1) {
              const answers = new Array<unknown>(steps.length);
              at = admittedAtOnce(steps, flat!, at, answers);
              settleSteps(steps, answers);
              return { status: 1, waitMs: -1, inLine: undefined, woken: NO_ONE, replies: answers };
            }
            return this.#gateReply(reply as GateCallReply, steps, sentAt);
          });
        } finally {
          endTurn(turnStarted);
        }
      },
      (error: unknown) => {
        for (const steps of stepsOf) for (const step of steps) step.reject(error);
        throw error;
      },
    );
  }

  /** A call's reply to a `gate` call, for any call but one admitted in one pass (see `gather`). */
  #gateReply(reply: GateCallReply, steps: readonly Step[], sentAt: number): GateReply {
    if (reply[6] !== undefined) this.sawServerTime(Number(reply[6]), sentAt);
    const answers = reply[4];
    const status = Number(reply[0]);
    const out: GateReply = {
      status,
      waitMs: Number(reply[1]),
      inLine: LINES[Number(reply[2])],
      woken: Array.isArray(reply[3]) ? reply[3] : NO_ONE,
      replies: answers,
    };
    if (status === 2) out.collected = grantReplies(String(reply[5]));
    if (reply[7] !== undefined) {
      out.lineRateMs = Number(reply[7]);
      out.lineRateKey = String(reply[8] ?? "");
    }
    if (typeof reply[9] === "string") {
      const [at, rate, ...key] = reply[9].split("|");
      const agoMs = Number(reply[6]) - Number(at);
      if (agoMs >= 0) out.moved = { agoMs, lineRateMs: Number(rate) || 0, key: key.join("|") };
    }
    if (Number(reply[5]) === 1) {
      let settled: "no" | "granted" | "not run" = "no";
      out.hold = (granted) => {
        if (settled !== "no") return;
        settled = granted ? "granted" : "not run";
        settleSteps(steps, granted ?? []);
      };
      out.collectedLate = (granted) => {
        if (settled === "not run") tellLate(steps, granted);
      };
    } else settleSteps(steps, answers);
    return out;
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
              isConnectionError(error)
                ? `Redis failed: ${message(error)}`
                : `Redis refused ${script}: ${message(error)}`,
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
      this.#timer = this.clock.setTimeout(this.#sweep, this.commandTimeoutMs);
    } else {
      this.#last.next = call;
      call.prev = this.#last;
    }
    this.#last = call;
  }

  /** Take a settled call out of the list; the timer goes when nothing is left to time. */
  #remove(call: Call): void {
    call.done = true;
    const { prev, next } = call;
    if (prev) prev.next = next;
    else this.#first = next;
    if (next) next.prev = prev;
    else this.#last = prev;
    call.prev = call.next = undefined;
    if (this.#first === undefined && this.#timer !== undefined) {
      this.clock.clearTimeout(this.#timer);
      this.#timer = undefined;
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

  /** Call `handler` with every message on channel `name`; resolves once subscribed. */
  async listen(name: string, handler: WakeHandler): Promise<void> {
    // Messages come named as Redis has the channel: a lone surrogate in a stage's name is U+FFFD.
    const channel = onWire(name);
    if (!this.#subscriber) {
      const connection = this.subscriberConnection ?? this.client.duplicate();
      let sub = subscribers.get(connection.client);
      if (!sub) {
        sub = new Subscriber(connection, this.log);
        subscribers.set(connection.client, sub);
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
        connection.off("ready", onReady);
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
      if (connection.status() === "ready") onReady();
      else {
        connection.on("ready", onReady);
        // A duplicate of a `lazyConnect` client (or any node-redis duplicate) waits to be told to connect.
        if (connection.status() === "wait") connection.connect().catch(() => {});
      }
    });
  }

  /** Stop listening; quit the pub/sub connection when this link made it. */
  readonly #onReady = () => {
    this.#connected = true;
    this.client.off("ready", this.#onReady);
  };

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    this.client.off("ready", this.#onReady);
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

/**
 * A call's fields as JSON, as Redis would read them as arguments: a lone surrogate (which JSON
 * would send as an escape the script's decoder refuses) as U+FFFD, as its UTF-8 on the wire is.
 */
function callJson(fields: string[]): string {
  const json = JSON.stringify(fields);
  return json.includes("\\ud") ? JSON.stringify(fields.map(onWire)) : json;
}

/** `text` as Redis gets it (UTF-8): each lone surrogate as U+FFFD. */
export function onWire(text: string): string {
  return Buffer.from(text, "utf8").toString("utf8");
}

/**
 * The places (from 0: the script's ARGV[2] is 1) of each step's own arguments, which may differ
 * between steps sent as repeats of one another (lua/gate.lua, OWN): a permit's member, fence and
 * "again" flag; a bucket's cost, grant and longest wait; a host's spacing; a release's member and
 * what it releases (a semaphore's), or its member, outcome, epoch and slow flag (an AIMD
 * limiter's).
 */
const OWN: Partial<Record<GateStep, readonly number[]>> = {
  "semaphore-acquire": [1, 8, 9],
  "token-bucket-take": [4, 6, 7],
  "interval-gate-take": [1],
  "semaphore-release": [1, 4],
  "aimd-release": [1, 3, 4, 8],
};

/** The scripts whose steps may go as repeats of an earlier step ("~"): the releases. */
const REPEATING: ReadonlySet<GateStep> = new Set(["semaphore-release", "aimd-release"]);

/** Whether step `a` differs from `b`, of its script, only in its own arguments (`OWN`). */
function ownOnly(a: Step, b: Step): boolean {
  const own = OWN[a.script];
  if (own === undefined || a.args.length !== b.args.length || own[own.length - 1]! >= a.args.length)
    return false;
  for (let i = 1; i < a.args.length; i++) {
    const x = a.args[i]!;
    const y = b.args[i]!;
    if (x !== y && (typeof x === typeof y || String(x) !== String(y)) && !own.includes(i)) return false;
  }
  return true;
}

/**
 * For each release script that takes a turn's releases of one stage's leases in one run: how
 * many arguments one release has, and which of them must be "" (classes) or "lease" (what a
 * semaphore's release gives back) for it to join a run.
 */
const TOGETHER: Partial<Record<GateStep, { n: number; at: number; is: string }>> = {
  "semaphore-release": { n: 8, at: 4, is: "lease" },
  "aimd-release": { n: 13, at: 12, is: "" },
};

/**
 * `steps` with the releases of one stage's leases that differ only in their own arguments (`OWN`)
 * put together as one step, where the first of them was: its arguments the first's, then each
 * other's own arguments in turn, as the script takes a turn's; it answers the list of
 * their replies, each of which settles its own step. `steps` itself when none go together.
 */
function together(steps: Step[]): Step[] {
  // (Runs by their keys, a stage's own list: the same list for each of its steps.)
  let runs: Map<readonly string[], Step[]> | undefined;
  let runOf: Map<Step, Step[]> | undefined;
  let merged = false;
  for (const step of steps) {
    const rule = TOGETHER[step.script];
    if (rule === undefined || step.args.length !== rule.n || step.args[rule.at] !== rule.is) continue;
    runs ??= new Map();
    runOf ??= new Map();
    const run = runs.get(step.keys);
    if (run === undefined) {
      const first = [step];
      runs.set(step.keys, first);
      runOf.set(step, first);
    } else if (run[0]!.script === step.script && ownOnly(step, run[0]!)) {
      run.push(step);
      runOf.set(step, run);
      merged = true;
    }
  }
  if (!merged) return steps;
  const out: Step[] = [];
  for (const step of steps) {
    const run = runOf!.get(step);
    if (run === undefined || run.length < 2) out.push(step);
    else if (step === run[0]) out.push(oneStep(run));
  }
  return out;
}

/** One step for the releases `parts` (see `together`): it settles each of them with its reply. */
function oneStep(parts: readonly Step[]): Step {
  const first = parts[0]!;
  const args = [...first.args];
  const own = OWN[first.script]!;
  for (let x = 1; x < parts.length; x++) for (const j of own) args.push(parts[x]!.args[j]!);
  return {
    script: first.script,
    keys: first.keys,
    args,
    resolve: (replies) => {
      const list = replies as unknown[];
      if (list[0] === "n") settleTurn(first.script, list, parts);
      else for (let x = 0; x < parts.length; x++) parts[x]!.resolve(list[x]);
    },
    reject: (error) => {
      for (const part of parts) part.reject(error);
    },
    late: undefined,
  };
}

/**
 * A `gate` call of `stepsOf` ran after it was failed, and answered `replies`: each step that says
 * so gives back, told its own reply (read as `gather` reads it; undefined where there is none).
 * @internal Exported for its test.
 */
export function ranLate(stepsOf: readonly (readonly Step[])[], replies: unknown): void {
  const list = Array.isArray(replies) ? replies : [];
  const flat = list.length > stepsOf.length ? list[stepsOf.length] : undefined;
  let at = 0;
  for (let c = 0; c < stepsOf.length; c++) {
    const steps = stepsOf[c]!;
    const reply = list[c];
    let answers: readonly unknown[] | undefined;
    if (reply === 1 && Array.isArray(flat)) {
      const once = new Array<unknown>(steps.length);
      at = admittedAtOnce(steps, flat, at, once);
      answers = once;
    } else if (Array.isArray(reply) && Array.isArray(reply[4])) answers = reply[4];
    tellLate(steps, answers);
  }
}

/** Tell each of `steps` that says so that its call ran late, with its reply in `answers` (if any). */
function tellLate(steps: readonly Step[], answers: readonly unknown[] | undefined): void {
  for (let s = 0; s < steps.length; s++) steps[s]!.late?.(steps[s]!.keys, steps[s]!.args, answers?.[s]);
}

/** The grants of a release reply that made none. */
const NO_GRANTS: readonly string[] = [];

/**
 * Settle `parts`, a turn's releases of one stage's leases sent as one step, with its reply in
 * short (lua/gate.lua, each()): "n", one flag a lease ("1": it was still held, "0": not), then
 * what the stage's count was once they were all given back (a semaphore's used; an AIMD
 * limiter's limit, epoch and used). Each part gets the reply its script gives one release, with
 * those figures. A reply whose flags do not match the parts rejects them all.
 */
function settleTurn(script: GateStep, reply: readonly unknown[], parts: readonly Step[]): void {
  const flags = reply[1];
  if (typeof flags !== "string" || flags.length !== parts.length) {
    const error = new Error(
      `${script}: a turn's reply has ${String(flags).length} flags for ${parts.length} leases`,
    );
    for (const part of parts) part.reject(error);
    return;
  }
  const held =
    script === "semaphore-release"
      ? [1, 0, reply[2], NO_GRANTS]
      : [1, reply[2], reply[3], reply[4], NO_GRANTS];
  const gone = held.slice();
  gone[0] = 0;
  for (let x = 0; x < parts.length; x++) parts[x]!.resolve(flags.charCodeAt(x) === 49 ? held : gone);
}

/** Whether two calls' lanes (see `GateCall`) are one. */
function sameLane(a: readonly string[], b: readonly string[]): boolean {
  return a === b || (a[0] === b[0] && a[1] === b[1]);
}

/**
 * Whether `steps` repeat `before` but for their own arguments (`OWN`): the same scripts, each
 * with one, on the same keys, with the same other arguments.
 */
function repeats(steps: readonly Step[], before: readonly Step[]): boolean {
  if (steps.length === 0 || steps.length !== before.length) return false;
  for (let s = 0; s < steps.length; s++) {
    const a = steps[s]!;
    const b = before[s]!;
    if (a.script !== b.script || !ownOnly(a, b)) return false;
    if (a.keys !== b.keys) {
      if (a.keys.length !== b.keys.length) return false;
      for (let k = 0; k < a.keys.length; k++) if (a.keys[k] !== b.keys[k]) return false;
    }
  }
  return true;
}

/**
 * The reply of a `gate` call to one call: {status, waitMs, inLine, woken, replies, held, now,
 * and, waiting in the permit line, its firsts' rate waits (their ms in all, the latest's key),
 * and, taken into that line with its lane since its previous try, "<when>|<ms then>|<key>"}.
 */
type GateCallReply = [
  number,
  number,
  number,
  string[],
  unknown[],
  unknown,
  number?,
  number?,
  string?,
  string?,
];

/**
 * The replies of `steps`, admitted in one pass, from `flat` at `at` (lua/gate.lua, fast()): each
 * as its script answers an admission at once. Returns where the next call's replies begin.
 */
function admittedAtOnce(
  steps: readonly Step[],
  flat: readonly unknown[],
  at: number,
  answers: unknown[],
): number {
  const now = flat[flat.length - 1];
  for (let i = 0; i < steps.length; i++) {
    const script = steps[i]!.script;
    if (script === "semaphore-acquire") {
      answers[i] = [1, flat[at], flat[at + 1], flat[at + 2], flat[at + 3], 0, 0, now];
      at += 4;
    } else if (script === "interval-gate-take") {
      answers[i] = [1, flat[at], flat[at + 1]];
      at += 2;
    } else answers[i] = [1, 0];
  }
  return at;
}

/** Settle gathered steps with their replies: a step with none (or false, null) did not run. */
function settleSteps(steps: readonly Step[], answers: readonly unknown[]): void {
  for (let i = 0; i < steps.length; i++) {
    const r = answers[i];
    if (r === false || r === null || r === undefined) steps[i]!.reject(NOT_RUN);
    else steps[i]!.resolve(r);
  }
}

/** The steps' replies of a grant (lua/gate.lua sends them as JSON); [] when unreadable. */
export function grantReplies(json: string): unknown[] {
  try {
    const replies: unknown = JSON.parse(json);
    return Array.isArray(replies) ? replies : [];
  } catch {
    return [];
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
 * False when the call failed before it was sent, or was a gate call's step that did not run, so
 * Redis cannot have acted on it (nothing to give back).
 */
export function maybeSent(error: unknown): boolean {
  return !(typeof error === "object" && error !== null && unsent.has(error));
}

function message(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
