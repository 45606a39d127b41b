/**
 * The Gate. Over 350 lines because its admission path (the synchronous run through memory stages
 * with room, the wait in one stage's line, the resumption after it, the give-up on failure) is
 * one piece read together; its ticket is in gate-ticket.ts and the order rule in stage-order.ts.
 */
import { admitOptions, type Entry, fnError, fusedStageOptions, pauseError, tooCostly } from "./admit.js";
import { type FusedAdmission, type FusedCall, sharedHost } from "./fuse.js";
import { GateTicket, settleAll } from "./gate-ticket.js";
import { stageOrderWarning, warnOrder } from "./stage-order.js";

export { stageOrderWarning } from "./stage-order.js";

import { endTurn, Flow, startTurn, turnTime } from "./base/flow.js";
import { callWith, RESOLVED } from "./base/run.js";
import { type BaseStage, type BaseTicket, RunWaiter } from "./base/stage.js";
import { type Clock, systemClock } from "./clock.js";
import { Drain, Drains, nothingDrained } from "./drain.js";
import { AdmitTimeoutError, ClosedError, DrainingError, InvalidOptionsError } from "./errors.js";
import { stageLogger } from "./logger.js";
import type {
  AdmitOptions,
  DrainOptions,
  DrainResult,
  GateSnapshot,
  IntervalGateStage,
  Logger,
  Outcome,
  RunOptions,
  Snapshot,
  Stage,
  StageKind,
  Ticket,
  TryAdmitOptions,
} from "./types.js";
import { gateSchema, got, isArray, messageOf, parseOptions } from "./validate.js";

/** Options for `new Gate(stages, options)`. */
export interface GateOptions {
  /** Name in logs and snapshots. @default "gate" */
  name?: string;
  /** Clock used to share one `timeoutMs` across the stages. @default the system clock */
  clock?: Clock;
  /** pino-shaped logger. @default silent */
  logger?: Logger;
  /**
   * Decide the stages together when they can be (two or more memory stages on one clock, or
   * Redis stages of one backend, not a Cluster; none with classes): at one instant, all or
   * nothing, holding nothing while a call waits; on Redis in one script call per admission and
   * per release (see `gate.fused`). `false` takes them one after another. @default true
   */
  fuse?: boolean;
}

export { defaultClassify } from "./base/run.js";
export type { RunOptions, Settled } from "./types.js";

/** A job accepted by `gate.enqueue`. */
export interface Job<T> {
  /** Settles with the call's result once it has run. */
  readonly done: Promise<T>;
}

/**
 * Every stage name in `stages` and in gates among them, whether any is keyed by `key`, and the
 * traffic classes any of them knows.
 */
function namesOf(stages: readonly Stage[]): { all: Set<string>; keyed: boolean; classes: Set<string> } {
  const all = new Set<string>();
  const classes = new Set<string>();
  let keyed = false;
  for (const s of stages) {
    all.add(s.name);
    if (s.keyedBy === "key") keyed = true;
    for (const c of s.classes ?? []) classes.add(c);
    if (s instanceof Gate) for (const n of namesOf(s.stages).all) all.add(n);
  }
  return { all, keyed, classes };
}

/**
 * An empty list for the tickets of one call. `new Array()` starts with room for four, where the
 * first push to `[]` makes room for seventeen: 80 bytes a call instead of 184.
 */
function newHeld(): Ticket[] {
  // biome-ignore lint/style/useArrayLiterals: see above; `[]` allocates more on first push.
  return new Array<Ticket>();
}

/** The call's key for `stage`: only a stage keyed by key is handed one. */
function keyAt(stage: Stage, o: AdmitOptions): string | undefined {
  return stage.keyedBy === "key" ? o.key : undefined;
}

/** The call's class for `stage`: only a stage with classes is handed one. */
function classAt(stage: Stage, o: AdmitOptions): string | undefined {
  return o.class !== undefined && stage.classes !== undefined ? o.class : undefined;
}

/** The cost of a call at `stage`: its entry in `costs`, else `cost`. */
function costAt(stage: Stage, o: AdmitOptions): number | undefined {
  return o.costs?.[stage.name] ?? o.cost;
}

/** The `name` option when it can be read as a string, for messages about the other options. */
function nameOf(options: unknown): string | undefined {
  try {
    const name = (options as GateOptions | null | undefined)?.name;
    return typeof name === "string" && name.length > 0 ? name : undefined;
  } catch {
    return undefined;
  }
}

/** The stages, copied, each checked to be a stage; throws `InvalidOptionsError` naming the bad one. */
function checkStages(stages: unknown): Stage[] {
  if (!isArray(stages)) {
    throw new InvalidOptionsError(
      undefined,
      "stages",
      `gate: stages must be an array of stages, ${got(stages)}`,
    );
  }
  let list: Stage[];
  try {
    list = Array.from(stages as Stage[]);
  } catch (error) {
    throw new InvalidOptionsError(
      undefined,
      "stages",
      `gate: stages could not be read (${messageOf(error)})`,
    );
  }
  list.forEach((s, i) => {
    let ok = false;
    try {
      ok =
        typeof s === "object" &&
        s !== null &&
        typeof s.admit === "function" &&
        typeof s.snapshot === "function";
    } catch {
      ok = false;
    }
    if (!ok) {
      throw new InvalidOptionsError(undefined, `stages.${i}`, `gate: stages.${i} must be a stage, ${got(s)}`);
    }
  });
  return list;
}

/** A stage that can say at once, without a promise, whether it admits (see `Stage.admitNow`). */
type SyncStage = Stage & Required<Pick<Stage, "admitNow">>;

/** A stage a gate's call can wait at as a `RunWaiter` (the memory permit stages). */
type LineStage = BaseStage & Required<Pick<BaseStage, "waitInGate">>;

/** What a gate's call waiting at one of its stages needs to go on. */
interface GateWait<T> {
  readonly held: Ticket[];
  /** Index of the stage it waits at. */
  readonly index: number;
  readonly o: RunOptions<T>;
  readonly deadline: number;
  /** The call to make once every stage has admitted; none for `admit`, which hands out the ticket. */
  readonly fn: ((ticket: Ticket) => T | PromiseLike<T>) | undefined;
}

/**
 * An ordered list of stages that admits a call only when every stage has, and releases them in
 * reverse with the call's outcome. A failure, timeout or abort part-way refunds what was already
 * taken. A gate is a stage itself, so gates nest.
 *
 * A gate of memory stages, or of Redis stages of one backend, is **fused** (`gate.fused`): every
 * stage is decided at one instant, all or nothing, and a call that must wait holds nothing
 * meanwhile, so its stages go in any order. Other gates acquire their stages in order, and for
 * them: **stages that hold a call first (queue, semaphore, AIMD), then token buckets, then
 * interval gates last.** A stage after a metering stage can still make the call wait, so a token
 * bucket's rate and an interval gate's spacing hold for the starts of calls only when nothing
 * after them waits; the price is that a call holds its permits while it waits for its token or
 * its host's slot. Such a gate listed in another order logs one warning when it is built.
 */
export class Gate implements Stage {
  readonly kind: StageKind = "gate";
  readonly holds = "call" as const;
  readonly name: string;
  readonly stages: readonly Stage[];
  readonly #clock: Clock;
  /** Little's law over the last window, for the gate's own tickets. */
  readonly #flow: Flow;
  readonly #log: Logger;
  /** Stages that come first and only hold a call while it waits (bounded queues). */
  readonly #leading: number;
  readonly #holdsWait: boolean;
  #closed = false;
  #closeController: AbortController | undefined;

  inFlight = 0;
  #waiting = 0;
  #admitted = 0;
  #timedOut = 0;
  #aborted = 0;

  constructor(stages: readonly Stage[], options: GateOptions = {}) {
    const o = parseOptions(gateSchema, "gate", nameOf(options), options);
    this.name = o.name ?? "gate";
    this.stages = checkStages(stages);
    this.#clock = o.clock ?? systemClock;
    this.#flow = new Flow(this.#clock.now());
    this.#log = stageLogger(o.logger, this.name, "gate", "gate");
    let leading = 0;
    while (leading < this.stages.length && this.stages[leading]!.holds === "wait") leading++;
    this.#leading = leading;
    this.#holdsWait = this.stages.some((s) => s.holds === "wait");
    this.#callStages = this.stages.filter((s) => s.holds !== "wait").length;
    let sync = 0;
    while (sync < this.stages.length && typeof (this.stages[sync] as SyncStage).admitNow === "function")
      sync++;
    this.#syncPrefix = sync;
    this.#names = namesOf(this.stages);
    this.#classes = this.#names.classes.size > 0 ? [...this.#names.classes] : undefined;
    this.#bounded = this.stages.filter((s) => typeof s.maxCost === "number");
    this.#leastMaxCost = Math.min(...this.#bounded.map((s) => s.maxCost!));
    this.#fused = o.fuse === false ? undefined : this.#fuse();
    this.#admitsAtOnce = sync > 0 || this.#fused?.admitNow !== undefined;
    // A fused gate holds nothing while a call waits: any order keeps what each stage promises.
    const misplaced = this.#fused ? undefined : stageOrderWarning(this.stages);
    if (misplaced) warnOrder(o.logger === undefined ? undefined : this.#log, this.name, misplaced);
  }

  /**
   * The stages after the leading bounded queues, decided together when there are two or more
   * and they all carry one fusion host (memory stages on one clock; one Redis backend, not a
   * Cluster); else undefined.
   */
  #fuse(): FusedAdmission | undefined {
    const rest = this.stages.slice(this.#leading);
    if (rest.length < 2 || !rest.every((s) => s.holds === "call" && s.kind !== "gate")) return undefined;
    // A stage listed twice is taken twice: in turn, as the list says.
    if (new Set(rest).size !== rest.length) return undefined;
    return sharedHost(rest)?.fuse(this.name, rest);
  }

  /** The stages after the leading queues, decided in one backend call each way; or undefined. */
  readonly #fused: FusedAdmission | undefined;

  /**
   * Whether a stage may admit a call at once, with no promise in between (memory stages): a gate
   * of Redis stages admits nothing before its first wait, and opens no turn for it (`#atOnce`).
   */
  readonly #admitsAtOnce: boolean;

  /**
   * Whether the gate's stages (after its leading bounded queues) are decided together: at one
   * instant, all or nothing, holding nothing while a call waits; on Redis in one script call per
   * admission and per release. True for two or more memory stages on one clock, or Redis stages
   * of one backend (not a Cluster), none of them with classes.
   */
  get fused(): boolean {
    return this.#fused !== undefined;
  }

  /**
   * Run `fn`, which releases, refunds or settles tickets of this gate's stages: as one backend
   * call when the gate is fused.
   * @internal
   */
  together(fn: () => Promise<void>): Promise<void> {
    return this.#fused ? this.#fused.together(fn) : fn();
  }

  /**
   * Release (with `outcome`) or refund `tickets` of this gate's stages, last to first: as one
   * backend call when the gate is fused.
   * @internal
   */
  settleTogether(tickets: readonly Ticket[], outcome: Outcome | undefined): Promise<void> {
    const fused = this.#fused;
    if (fused === undefined) return settleAll(tickets, outcome);
    if (fused.settle) return fused.settle(tickets, outcome);
    return fused.together(() => settleAll(tickets, outcome));
  }

  /** What the fused admission of one call needs. */
  #fusedCall(o: AdmitOptions, deadline: number): FusedCall {
    return {
      // (Made as checked: the gate's options are, and only floodgate's own stages are fused.)
      optionsFor: (stage) => fusedStageOptions(keyAt(stage, o), o.host, costAt(stage, o), classAt(stage, o)),
      signal: o.signal,
      deadline,
      timeoutMs: o.timeoutMs,
      clock: this.#clock,
      o,
    };
  }

  /**
   * For a fused gate: admit into `held` what admits at once with no promise in between (leading
   * memory queues with room, then every fused memory stage together); returns the index of the
   * first stage left to `#acquire`, all of them when every one admitted. As `#admitFirst`, a
   * throw gives back what is held and becomes the call's rejection.
   */
  #fusedFirst(held: Ticket[], o: AdmitOptions): number | Promise<never> {
    const fused = this.#fused!;
    try {
      const leading = Math.min(this.#leading, this.#syncPrefix);
      const from = leading === 0 ? 0 : this.#admitSync(held, o, 0, leading);
      if (from < this.#leading || fused.admitNow === undefined) return from;
      const tickets = fused.admitNow(o);
      if (tickets === undefined) return from;
      for (let i = 0; i < tickets.length; i++) held.push(tickets[i]!);
      return this.stages.length;
    } catch (error) {
      try {
        return Promise.resolve(this.#giveUp(held, o, error));
      } catch (thrown) {
        return Promise.reject(thrown);
      }
    }
  }

  /** Stages with a largest cost: a call costing more at one of them is refused before any is taken. */
  readonly #bounded: readonly Stage[];
  /** The smallest of their largest costs (Infinity when none has one). */
  readonly #leastMaxCost: number;

  /** Every stage name in the gate (and in gates in it), and whether any is keyed by `key`. */
  readonly #names: { all: Set<string>; keyed: boolean; classes: Set<string> };

  /** `#names.classes` as the list `classes` hands out, made once. */
  readonly #classes: readonly string[] | undefined;

  /** Stages whose ticket a call holds while it runs (all but bounded queues). */
  readonly #callStages: number;

  /** Leading stages that can admit synchronously (memory stages). */
  readonly #syncPrefix: number;

  /** The clock the gate measures `timeoutMs` with; helpers (retries) wait on it too. */
  get clock(): Clock {
    return this.#clock;
  }

  /** Aborts when the gate closes. */
  get closedSignal(): AbortSignal {
    if (!this.#closeController) {
      this.#closeController = new AbortController();
      if (this.#closed) this.#closeController.abort(new ClosedError(this.name));
    }
    return this.#closeController.signal;
  }

  /** Every traffic class some stage of the gate (or of a gate in it) knows, when any has classes. */
  get classes(): readonly string[] | undefined {
    return this.#classes;
  }

  /** Some stage of the gate (or of a gate in it) is keyed by the call's `key`. */
  get keyedBy(): "key" | undefined {
    return this.#names.keyed ? "key" : undefined;
  }

  /**
   * The error for a record (`costs`, or a gate ticket's `settle`) that names something other
   * than a stage of the gate, naming the field (`<field>.<name>`); undefined when every name is a
   * stage's.
   */
  #unknownStage(
    field: "costs" | "actual",
    record: Readonly<Record<string, number>>,
  ): InvalidOptionsError | undefined {
    for (const name in record) {
      if (!this.#names.all.has(name)) {
        return new InvalidOptionsError(
          this.name,
          `${field}.${name}`,
          `gate "${this.name}": ${field} names "${name}", which is no stage of the gate (its stages: ${[...this.#names.all].join(", ")})`,
        );
      }
    }
    return undefined;
  }

  /** A gate ticket's `settle` record checked (see `TicketGate.settleNamesError`). @internal */
  settleNamesError(value: Readonly<Record<string, number>>): InvalidOptionsError | undefined {
    return this.#unknownStage("actual", value);
  }

  #options(options: AdmitOptions | undefined, entry: Entry): AdmitOptions {
    const o = admitOptions("gate", this.name, options, entry);
    if (o.costs !== undefined) {
      const unknown = this.#unknownStage("costs", o.costs);
      if (unknown) throw unknown;
    }
    // A cost no larger than every stage's largest fits them all: only costs above it are looked at.
    if (o.costs !== undefined || (o.cost !== undefined && o.cost > this.#leastMaxCost)) this.#fits(o);
    if (o.key !== undefined && !this.#names.keyed) {
      throw new InvalidOptionsError(
        this.name,
        "key",
        `gate "${this.name}": key given, ${got(o.key)}, but no stage of the gate is keyed by it; build the token bucket with keyed: true`,
      );
    }
    if (o.class !== undefined) this.#checkClass(o.class);
    if (this.#closed) throw new ClosedError(this.name);
    if (this.#drains.current !== undefined) {
      throw new DrainingError(this.name, `gate "${this.name}" is draining: it admits no new call`);
    }
    return o;
  }

  /** Refuse a class no stage knows, or one a stage with classes does not know. */
  #checkClass(name: string): void {
    if (this.#names.classes.size === 0) {
      throw new InvalidOptionsError(
        this.name,
        "class",
        `gate "${this.name}": class given, ${got(name)}, but no stage of the gate has classes; build its semaphore, AIMD limiter or (in memory) token bucket with classes`,
      );
    }
    for (const stage of this.stages) {
      const known = stage.classes;
      if (known !== undefined && !known.includes(name)) {
        throw new InvalidOptionsError(
          this.name,
          "class",
          `gate "${this.name}": class "${name}" is not one of ${stage.kind} "${stage.name}"'s classes (${known.join(", ")})`,
        );
      }
    }
  }

  /** Refuse a cost that one of the stages could never admit, before any stage is taken. */
  #fits(o: AdmitOptions): void {
    for (let i = 0; i < this.#bounded.length; i++) {
      const stage = this.#bounded[i]!;
      const named = o.costs?.[stage.name];
      const cost = named ?? o.cost ?? 1;
      if (cost > stage.maxCost!) {
        // (The field the caller set: `costs.<stage>` when the cost was named for the stage.)
        const field = named === undefined ? "cost" : `costs.${stage.name}`;
        throw tooCostly(stage.kind, stage.name, cost, stage.maxCost!, undefined, field);
      }
    }
  }

  #stageOptions(stage: Stage, o: AdmitOptions, deadline: number): AdmitOptions {
    const cost = costAt(stage, o);
    const timeoutMs =
      deadline === Number.POSITIVE_INFINITY ? undefined : Math.max(0, deadline - this.#clock.now());
    // A gate in the gate resolves its own stages' costs.
    const costs = stage.kind === "gate" ? o.costs : undefined;
    const given: AdmitOptions = {
      key: keyAt(stage, o),
      host: o.host,
      cost,
      signal: o.signal,
      timeoutMs,
      costs,
    };
    // Only a stage with classes is handed the call's class (no field otherwise).
    const cls = classAt(stage, o);
    if (cls !== undefined) given.class = cls;
    return given;
  }

  /**
   * Admit the leading stages that admit at once (`admitNow`) into `held`, with no promise in
   * between; returns how many did. The first that would wait (or refuse) is left to `#acquire`;
   * one whose `admitNow` throws throws here, and the caller gives back what is held.
   */
  #admitSync(held: Ticket[], o: AdmitOptions, from: number, to = this.#syncPrefix): number {
    const stages = this.stages;
    const n = to;
    let i = from;
    for (; i < n; i++) {
      const stage = stages[i] as SyncStage;
      const ticket = stage.admitNow(o, costAt(stage, o) ?? 1);
      if (ticket == null) break;
      held.push(ticket);
    }
    return i;
  }

  /**
   * Admit stages `from` to `to - 1` into `held`; on failure refund everything held and rethrow.
   * With `start`, the call then starts: the result is its ticket.
   */
  #acquire(
    held: Ticket[],
    from: number,
    to: number,
    o: AdmitOptions,
    deadline: number,
    start: boolean,
  ): Promise<GateTicket | undefined> {
    this.#waiting++;
    if (this.#fusedFrom(from, to)) return this.#admitFused(held, o, deadline, start);
    return this.#acquireEach(held, from, to, o, deadline, start);
  }

  /** Whether stages `from` to `to - 1` are the fused gate's alone (the rest of the call). */
  #fusedFrom(from: number, to: number): boolean {
    return this.#fused !== undefined && from === this.#leading && to === this.stages.length;
  }

  /**
   * `#acquire` of the fused stages, the last left (the call counted as waiting already): their
   * admission, with no loop kept across awaits.
   */
  #admitFused(
    held: Ticket[],
    o: AdmitOptions,
    deadline: number,
    start: boolean,
  ): Promise<GateTicket | undefined> {
    let admitted: Promise<Ticket[] | undefined>;
    try {
      admitted = this.#fused!.admit(this.#fusedCall(o, deadline), true);
    } catch (error) {
      return this.#acquireFailed(held, o, error);
    }
    return admitted.then(
      (tickets) => {
        for (const t of tickets!) held.push(t);
        if (o.signal?.aborted) return this.#acquireFailed(held, o, o.signal.reason);
        if (this.#closed) return this.#acquireFailed(held, o, new ClosedError(this.name));
        this.#acquired();
        return start ? this.#started(held, o) : undefined;
      },
      (error: unknown) => this.#acquireFailed(held, o, error),
    );
  }

  /** A call's wait in `#acquire` is over. */
  #acquired(): void {
    this.#waiting--;
    this.#drains.current?.poke();
  }

  /** `#acquire` failed with `error`: everything held is refunded, then the call rejects with it. */
  async #acquireFailed(held: Ticket[], o: AdmitOptions, error: unknown): Promise<never> {
    try {
      this.#count(o, error);
      const taken = held.splice(0);
      await this.settleTogether(taken, undefined).catch((e) => this.#log.warn({ err: e }, "refund failed"));
      throw error;
    } finally {
      this.#acquired();
    }
  }

  /** `#acquire` stage by stage, handing over to `#admitFused` once the fused stages are left. */
  async #acquireEach(
    held: Ticket[],
    from: number,
    to: number,
    o: AdmitOptions,
    deadline: number,
    start: boolean,
  ): Promise<GateTicket | undefined> {
    try {
      for (let i = from; i < to; i++) {
        if (this.#fusedFrom(i, to)) return this.#admitFused(held, o, deadline, start);
        const stage = this.stages[i]!;
        held.push(await stage.admit(this.#stageOptions(stage, o, deadline)));
        // A permit that arrives just after an abort is given back at once.
        if (o.signal?.aborted) throw o.signal.reason;
        if (this.#closed) throw new ClosedError(this.name);
      }
    } catch (error) {
      return this.#acquireFailed(held, o, error);
    }
    this.#acquired();
    return start ? this.#started(held, o) : undefined;
  }

  #deadline(o: AdmitOptions): number {
    return o.timeoutMs === undefined ? Number.POSITIVE_INFINITY : this.#clock.now() + o.timeoutMs;
  }

  /**
   * Admit into `held` what admits at once (`#fusedFirst` for a fused gate, else `#admitFirst`) on
   * one read of the clock for the gate and every stage on its clock (a turn, closed before the
   * caller's function runs): the call's ticket when every stage admitted; else the index of the
   * first stage left to wait for, or the call's rejection.
   */
  #atOnce(held: Ticket[], o: AdmitOptions): GateTicket | number | Promise<never> {
    if (!this.#admitsAtOnce) return 0;
    const started = startTurn(this.#clock);
    try {
      const from = this.#fused ? this.#fusedFirst(held, o) : this.#admitFirst(held, o);
      return from === this.stages.length ? this.#started(held, o) : from;
    } finally {
      endTurn(started);
    }
  }

  /** Bounded queues give their slot back once the call has passed every later stage. */
  #started(held: Ticket[], o: AdmitOptions): GateTicket {
    let call = held;
    if (this.#holdsWait) {
      const stages = this.stages;
      for (let i = held.length - 1; i >= 0; i--) {
        if (stages[i]!.holds === "wait") void held[i]!.release("success");
      }
      // Every stage is held here: the call keeps the ones that hold a call, in an array of that size.
      call = new Array<Ticket>(this.#callStages);
      for (let i = 0, j = 0; i < held.length; i++) if (stages[i]!.holds !== "wait") call[j++] = held[i]!;
    }
    const now = turnTime(this.#clock);
    this.#flow.advance(now, this.inFlight);
    this.inFlight++;
    this.#admitted++;
    return new GateTicket(this, o.cost ?? 1, call, now);
  }

  /**
   * Admit every stage in order. Memory stages that admit at once do so without a promise in
   * between; the first stage that has to wait is awaited, and the rest after it.
   */
  admit(options?: AdmitOptions): Promise<Ticket> {
    let o: AdmitOptions;
    try {
      o = this.#options(options, "admit");
    } catch (error) {
      return Promise.reject(error);
    }
    if (o.signal?.aborted) return Promise.reject(o.signal.reason);
    const held = newHeld();
    const from = this.#atOnce(held, o);
    if (from instanceof GateTicket) return Promise.resolve(from);
    if (typeof from !== "number") return from;
    if (this.#fused) {
      return this.#acquire(held, from, this.stages.length, o, this.#deadline(o), true) as Promise<Ticket>;
    }
    return this.#waitFrom<Ticket>(held, from, o, this.#deadline(o), undefined);
  }

  /**
   * Admit stages `from` on, the first of which has to wait, then make the call (or, with no
   * `fn`, hand out the ticket). A memory permit stage takes the call in its line as an entry
   * that goes on by itself; any other stage is awaited.
   */
  #waitFrom<T>(
    held: Ticket[],
    from: number,
    o: RunOptions<T>,
    deadline: number,
    fn: ((ticket: Ticket) => T | PromiseLike<T>) | undefined,
  ): Promise<T> {
    const stage = this.stages[from] as LineStage;
    if (typeof stage.waitInGate === "function") {
      const cost = costAt(stage, o) ?? 1;
      const timeoutMs =
        deadline === Number.POSITIVE_INFINITY ? undefined : Math.max(0, deadline - this.#clock.now());
      const waiting = stage.waitInGate(
        new Gate.#Waiter<T>(stage, cost, this, held, from, o, deadline, fn),
        o,
        timeoutMs,
      );
      if (waiting !== undefined) {
        this.#waiting++;
        return waiting;
      }
    }
    const acquired = this.#acquire(held, from, this.stages.length, o, deadline, true);
    if (fn === undefined) return acquired as Promise<T>;
    return acquired.then((ticket) => callWith(ticket!, fn, o.classify, this.#log));
  }

  /** A call's wait at stage `w.index` is over: go on to the next stages, then make the call. */
  #resume<T>(w: GateWait<T>, ticket: Ticket): T | Promise<T> {
    this.#waiting--;
    this.#drains.current?.poke();
    const { held, o } = w;
    held.push(ticket);
    // A permit that arrives just after an abort is given back at once.
    if (o.signal?.aborted) return this.#giveUp(held, o, o.signal.reason);
    if (this.#closed) return this.#giveUp(held, o, new ClosedError(this.name));
    const n = this.stages.length;
    let from: number;
    try {
      from = this.#admitSync(held, o, w.index + 1);
    } catch (error) {
      return this.#giveUp(held, o, error);
    }
    if (from < n) return this.#waitFrom(held, from, o, w.deadline, w.fn);
    const started = this.#started(held, o);
    return w.fn ? callWith(started, w.fn, o.classify, this.#log) : (started as T);
  }

  /**
   * `#admitSync` from the first stage, for the entries that must not throw: when an `admitNow`
   * throws, what is held is given back and the result is the call's rejection.
   */
  #admitFirst(held: Ticket[], o: AdmitOptions): number | Promise<never> {
    try {
      return this.#admitSync(held, o, 0);
    } catch (error) {
      try {
        return Promise.resolve(this.#giveUp(held, o, error));
      } catch (thrown) {
        return Promise.reject(thrown);
      }
    }
  }

  /**
   * Count a call whose wait ended in `error` (aborted, timed out). A fused gate's own timeout is
   * logged here, as a stage logs its own: taken stage by stage, the stage that timed out has.
   */
  #count(o: AdmitOptions, error: unknown): void {
    if (o.signal?.aborted && error === o.signal.reason) this.#aborted++;
    else if ((error as { code?: unknown })?.code === "ADMIT_TIMEOUT") {
      this.#timedOut++;
      if (error instanceof AdmitTimeoutError && error.stage === this.name && this.#fused) {
        this.#log.warn({ timeoutMs: o.timeoutMs, retryAfterMs: error.retryAfterMs }, "admission timed out");
      }
    }
  }

  /** A call's wait ended in `error`: count it, give back what it holds, and rethrow. */
  #giveUp<T>(held: Ticket[], o: RunOptions<T>, error: unknown): never | Promise<never> {
    this.#count(o, error);
    const taken = held.splice(0);
    const refunded = this.settleTogether(taken, undefined);
    if (refunded === RESOLVED) throw error;
    return refunded
      .catch((e) => this.#log.warn({ err: e }, "refund failed"))
      .then(() => {
        throw error;
      });
  }

  /** A gate's call waiting in a memory stage's line. */
  static readonly #Waiter = class GateWaiter<T> extends RunWaiter<T> implements GateWait<T> {
    constructor(
      stage: BaseStage,
      cost: number,
      readonly gate: Gate,
      readonly held: Ticket[],
      readonly index: number,
      readonly o: RunOptions<T>,
      readonly deadline: number,
      readonly fn: ((ticket: Ticket) => T | PromiseLike<T>) | undefined,
    ) {
      super(stage, cost, "", Number.NaN);
    }

    start(ticket: BaseTicket): T | Promise<T> {
      return this.gate.#resume(this, ticket);
    }

    fail(error: unknown): Promise<T> {
      this.gate.#waiting--;
      this.gate.#drains.current?.poke();
      return this.gate.#giveUp(this.held, this.o, error);
    }
  };

  async tryAdmit(options?: TryAdmitOptions): Promise<Ticket | undefined> {
    const o = this.#options(options, "tryAdmit");
    const held = newHeld();
    const refused = () => settleAll(held.splice(0), undefined).then(() => undefined);
    try {
      const upTo = this.#fused ? this.#leading : this.stages.length;
      for (let i = 0; i < upTo; i++) {
        const stage = this.stages[i]!;
        const t = await stage.tryAdmit(this.#tryOptions(stage, o));
        if (!t) return await refused();
        held.push(t);
      }
      if (this.#fused) {
        const tickets = await this.#fused.admit(this.#fusedCall(o, Number.POSITIVE_INFINITY), false);
        if (!tickets) return await refused();
        held.push(...tickets);
      }
    } catch (error) {
      await settleAll(held.splice(0), undefined);
      throw error;
    }
    return this.#started(held, o);
  }

  /** A stage's options for a call's `tryAdmit` (its key, the host, its cost, the class). */
  #tryOptions(stage: Stage, o: AdmitOptions): TryAdmitOptions {
    // A gate in the gate resolves its own stages' costs.
    const costs = stage.kind === "gate" ? o.costs : undefined;
    const given: TryAdmitOptions = { key: keyAt(stage, o), host: o.host, cost: costAt(stage, o), costs };
    const cls = classAt(stage, o);
    if (cls !== undefined) given.class = cls;
    return given;
  }

  /**
   * Admit, run `fn`, release with the outcome. `fn` gets the ticket: hand `ticket.signal` to the
   * call, or `ticket.record("dropped")` when a response says the server is overloaded. Rejects
   * as `admit` does; otherwise settles as `fn` does. When every stage admits at once (memory
   * stages with room), `fn` is called before `run` returns.
   */
  run<T>(fn: (ticket: Ticket) => T | PromiseLike<T>, options?: RunOptions<T>): Promise<T> {
    const notFn = fnError("gate", this.name, fn);
    if (notFn) return Promise.reject(notFn);
    let o: RunOptions<T>;
    try {
      o = this.#options(options, "run") as RunOptions<T>;
    } catch (error) {
      return Promise.reject(error);
    }
    if (o.signal?.aborted) return Promise.reject(o.signal.reason);
    const classify = o.classify;
    const held = newHeld();
    const from = this.#atOnce(held, o);
    if (from instanceof GateTicket) return callWith(from, fn, classify, this.#log);
    if (typeof from !== "number") return from;
    if (this.#fused) {
      return this.#acquire(held, from, this.stages.length, o, this.#deadline(o), true).then((ticket) =>
        callWith(ticket!, fn, classify, this.#log),
      );
    }
    return this.#waitFrom(held, from, o, this.#deadline(o), fn);
  }

  /**
   * Hand a job to the gate and resolve as soon as it is accepted: once the gate's leading bounded
   * queues have given it a slot (at once when the gate starts with none). That await is the
   * producer's backpressure. The job then waits for the other stages and runs; `job.done`
   * settles with its result. A full queue with `whenFull: "shed"` rejects with `ShedError`.
   */
  async enqueue<T>(fn: (ticket: Ticket) => T | PromiseLike<T>, options?: RunOptions<T>): Promise<Job<T>> {
    const notFn = fnError("gate", this.name, fn, "enqueue");
    if (notFn) throw notFn;
    const o = this.#options(options, "run") as RunOptions<T>;
    if (o.signal?.aborted) throw o.signal.reason;
    const deadline = this.#deadline(o);
    const held = newHeld();
    await this.#acquire(held, 0, this.#leading, o, deadline, false);
    const done = (async () => {
      const ticket = await this.#acquire(held, this.#leading, this.stages.length, o, deadline, true);
      return callWith(ticket!, fn, o.classify, this.#log);
    })();
    // A job nobody awaits must not crash the process; its failure is logged instead.
    done.catch((error) => this.#log.warn({ err: error }, "enqueued job failed"));
    return { done };
  }

  /**
   * Pause `host` on every stage of this gate that can pause a host (interval gates, gates nested
   * in it, a stage of your own with a `pause(host, ms)` method). Bad arguments reject with
   * `InvalidOptionsError`, whether or not the gate has such a stage.
   */
  async pause(host: string, ms: number): Promise<void> {
    const invalid = pauseError(this.name, host, ms, "gate");
    if (invalid) throw invalid;
    const pending: Promise<void>[] = [];
    for (const stage of this.stages) {
      const pause = (stage as Partial<IntervalGateStage>).pause;
      if (typeof pause === "function") pending.push(pause.call(stage, host, ms));
    }
    await Promise.all(pending);
  }

  snapshot(): GateSnapshot {
    const stages = this.stages.map((s) => s.snapshot());
    const sum = (field: keyof Snapshot) => stages.reduce((n, s) => n + (s[field] as number), 0);
    const limit = stages.reduce((n, s) => Math.min(n, s.limit), Number.POSITIVE_INFINITY);
    return {
      name: this.name,
      kind: "gate",
      backend: "gate",
      inFlight: this.inFlight,
      waiting: this.#waiting,
      queueDepth: sum("queueDepth"),
      shed: sum("shed"),
      admitted: this.#admitted,
      timedOut: this.#timedOut,
      aborted: this.#aborted,
      tokenWaitMs: sum("tokenWaitMs"),
      permitWaitMs: sum("permitWaitMs"),
      queueWaitMs: sum("queueWaitMs"),
      leasesLost: sum("leasesLost"),
      limit,
      flow: this.#flow.snapshot(this.#clock.now(), this.inFlight, limit),
      stages,
    };
  }

  readonly #drains = new Drains();

  /**
   * A ticket of the gate gives back its stages' tickets (see `TicketGate.giveBack`): the gate's
   * count and flow, then the stages', on one read of the clock for the gate and every stage on
   * its clock (a turn: memory releases are done before this returns). @internal
   */
  giveBack(ticket: GateTicket, outcome: Outcome | undefined): Promise<void> {
    const started = startTurn(this.#clock);
    try {
      if (!this.#ticketDone(ticket, outcome !== undefined)) return RESOLVED;
      return this.settleTogether(ticket.held, outcome);
    } finally {
      endTurn(started);
    }
  }

  /**
   * A ticket of the gate is being released or refunded: count it out of the calls in flight;
   * false when a drain has released its stages' tickets already (nothing more to give back).
   */
  #ticketDone(ticket: GateTicket, counted: boolean): boolean {
    const now = turnTime(this.#clock);
    this.#flow.advance(now, this.inFlight);
    if (!this.#drains.ticketDone(this)) return false;
    if (counted) this.#flow.released(now, now - ticket.admittedAt);
    return true;
  }

  /**
   * Shut the gate down gracefully: refuse new calls at once with `DrainingError`; reject the
   * waiting ones (or, with `waiting: "admit"`, let them be admitted within the grace); drain
   * every stage; wait up to `graceMs` for the calls in flight to release; then abort the rest
   * through their `signal` (`DrainingError`), release them (on Redis, their leases) and close
   * the gate and its stages. Resolves with the gate's own figures; a second call gets the same
   * promise. Rejects with `InvalidOptionsError` for bad options.
   */
  drain(options?: DrainOptions): Promise<DrainResult> {
    return this.#drains.start("gate", this.name, options, (graceMs, waiting) =>
      this.#drainNow(graceMs, waiting),
    );
  }

  async #drainNow(graceMs: number, waiting: "reject" | "admit"): Promise<DrainResult> {
    if (this.#closed) return nothingDrained();
    const clock = this.#clock;
    const start = clock.now();
    const where = `gate "${this.name}"`;
    const d = new Drain(new DrainingError(this.name, `${where} is draining`));
    this.#drains.current = d;
    this.#log.warn({ graceMs, waiting, inFlight: this.inFlight, waitingCalls: this.#waiting }, "draining");
    // Calls already waiting: admitted within the grace, or rejected now. A fused gate's wait in
    // the gate's own lines; a gate taken in turn's in its stages' lines (their drains reject them).
    if (waiting === "admit") await d.until(() => this.#waiting === 0, graceMs, clock);
    const rejected = this.#waiting;
    this.#fused?.close(
      new DrainingError(
        this.name,
        waiting === "admit"
          ? `${where} drained: the grace of ${graceMs} ms ran out before this call was admitted`
          : `${where} is draining: waiting calls are rejected`,
      ),
    );
    const left = Math.max(0, graceMs - (clock.now() - start));
    // The gate's own wait first, so its grace runs out before its stages' (same clock, same end).
    const inTime = d.until(() => this.inFlight === 0, left, clock);
    const stages = this.stages.map((s) =>
      typeof s.drain === "function" ? s.drain({ graceMs: left, waiting: "reject" }) : s.close(),
    );
    await inTime;
    d.forcing = true;
    // Calls still in flight: their signal aborts, and each stage's drain (whose grace runs out
    // at the same time) releases what they hold.
    const aborted = this.inFlight;
    if (aborted > 0) {
      const cut = new DrainingError(
        this.name,
        `${where} drained: the grace of ${graceMs} ms ran out before this call released its ticket`,
      );
      this.#closeController ??= new AbortController();
      this.#closeController.abort(cut);
      this.#drains.releasedAll = true;
      this.inFlight = 0;
    }
    await Promise.allSettled(stages);
    await this.close();
    const result = { completed: d.completed, aborted, rejected, tookMs: clock.now() - start };
    this.#log.warn(result, "drained");
    return result;
  }

  /** Refuse new calls, then close every stage (rejecting their waiters with `ClosedError`). */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    this.#closeController?.abort(new ClosedError(this.name));
    this.#fused?.close(new ClosedError(this.name));
    await Promise.all(this.stages.map((s) => s.close()));
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
