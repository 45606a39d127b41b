/**
 * A Gate of memory stages decided all or nothing, at one instant: each stage says whether it
 * would admit the call now (`fuseProbe`), and only when every one would are they all taken
 * (`admitNow`), with no promise in between. A call refused waits holding nothing, in the gate's
 * lines, as a fused Redis gate's callers wait in Redis: one line for its permits, and one per
 * lane (the call's key and host) for its rates, each in arrival order. Over 350 lines because
 * those lines, their serving whenever a stage changes, and each caller's wait share the gate's
 * state; what each stage would admit is the stage's own (`fuseProbe`, `admitNow`).
 */
import { endTurn, startTurn } from "../base/flow.js";
import { SignalWaits } from "../base/signal-waits.js";
import type { BaseStage, StageWatcher } from "../base/stage.js";
import type { Clock, ClockTimer } from "../clock.js";
import { type AdmitTimeoutError, ClosedError } from "../errors.js";
import { badSignal, type FusedAdmission, type FusedCall, type FusionHost, gateTimeout } from "../fuse.js";
import type { AdmitOptions, Stage, Ticket } from "../types.js";

/** A memory stage a gate can fuse: it can say whether it would admit, and admit, at once. */
type Fusable = BaseStage & Required<Pick<BaseStage, "fuseProbe" | "admitNow">>;

/** Stages that hold a permit while a call runs: a call they refuse waits in the permit line. */
const PERMIT_KINDS: ReadonlySet<string> = new Set(["semaphore", "aimd"]);

const hosts = new WeakMap<Clock, MemoryFusion>();

/** The host of fused gates for memory stages on `clock`: stages on one clock fuse together. */
export function memoryFusion(clock: Clock): MemoryFusion {
  let host = hosts.get(clock);
  if (host === undefined) {
    host = new MemoryFusion(clock);
    hosts.set(clock, host);
  }
  return host;
}

/** Fuses memory stages that share one clock. */
export class MemoryFusion implements FusionHost {
  constructor(readonly clock: Clock) {}

  fuse(gate: string, stages: readonly Stage[]): FusedAdmission {
    return new MemoryFusedGate(gate, stages as readonly Fusable[], this.clock);
  }
}

/** A call waiting in one of the gate's lines. */
class Waiter {
  prev: Waiter | null = null;
  next: Waiter | null = null;
  /** The line it stands in; undefined once it has left. */
  line: Line | undefined = undefined;
  /** Its deadline's timer, when it has one. */
  timer: ClockTimer | undefined = undefined;
  onAbort: (() => void) | undefined = undefined;
  /** The stage its wait is counted at since `since` (see `#charge`), or -1. */
  blame = -1;
  constructor(
    readonly seq: number,
    readonly call: FusedCall,
    readonly lane: string,
    public since: number,
    readonly resolve: (tickets: Ticket[]) => void,
    readonly reject: (error: unknown) => void,
  ) {}
}

/** Waiters in arrival order (`seq`); a lane also keeps the timer for its first. */
class Line {
  head: Waiter | null = null;
  tail: Waiter | null = null;
  size = 0;
  timer: ClockTimer | undefined = undefined;
  constructor(readonly key: string) {}

  /** Put `w` in its place by arrival: mostly last, so the search starts there. */
  insert(w: Waiter): void {
    let after = this.tail;
    while (after !== null && after.seq > w.seq) after = after.prev;
    w.prev = after;
    w.next = after === null ? this.head : after.next;
    if (w.next === null) this.tail = w;
    else w.next.prev = w;
    if (after === null) this.head = w;
    else after.next = w;
    w.line = this;
    this.size++;
  }

  remove(w: Waiter): void {
    if (w.prev === null) this.head = w.next;
    else w.prev.next = w.next;
    if (w.next === null) this.tail = w.prev;
    else w.next.prev = w.prev;
    w.prev = null;
    w.next = null;
    w.line = undefined;
    this.size--;
  }
}

/** The cost of a call at `stage`: its entry in `costs`, else `cost`, else 1. */
function costAt(stage: Stage, o: AdmitOptions): number {
  return o.costs?.[stage.name] ?? o.cost ?? 1;
}

/** One gate's fused memory stages. */
class MemoryFusedGate implements FusedAdmission {
  readonly #name: string;
  readonly #stages: readonly Fusable[];
  readonly #clock: Clock;
  /** Indexes of the permit stages, then of the metering ones (token buckets, interval gates). */
  readonly #permits: number[] = [];
  readonly #rates: number[] = [];
  /** Whether any stage keeps budgets per key or host: else every call is of one lane. */
  readonly #keyed: boolean;
  readonly #permitLine = new Line("");
  readonly #lanes = new Map<string, Line>();
  #arrivals = 0;
  /** Calls waiting in any line: the gate watches its stages while there are any. */
  #waiting = 0;
  /** Waiting calls' abort listeners: one per caller's signal (see `SignalWaits`). */
  readonly #signalWaits = new SignalWaits();
  #serveQueued = false;
  #closedBy: unknown;
  /** The stage the latest `#probe` found refusing. */
  #refusedBy = -1;

  constructor(name: string, stages: readonly Fusable[], clock: Clock) {
    this.#name = name;
    this.#stages = stages;
    this.#clock = clock;
    stages.forEach((s, i) => {
      (PERMIT_KINDS.has(s.kind) ? this.#permits : this.#rates).push(i);
    });
    this.#keyed = stages.some((s) => s.keyedBy !== undefined);
  }

  /** The call's lane: its key at stages keyed by key, its host at those keyed by host. */
  #laneOf(o: AdmitOptions): string {
    if (!this.#keyed) return "";
    let lane = "";
    for (const stage of this.#stages) {
      const by = stage.keyedBy;
      if (by !== undefined) lane += `${by === "key" ? (o.key ?? "") : (o.host ?? "")}|`;
    }
    return lane;
  }

  /**
   * Whether every stage would admit a call with options `o` at this instant: 0 when they would;
   * -1 when a permit stage would not (the call waits for permits to be freed); else the ms until
   * the first metering stage that would not could. `#refusedBy` names the stage. Throws
   * `ClosedError` when a stage has closed.
   */
  #probe(o: AdmitOptions): number {
    const stages = this.#stages;
    for (const i of this.#permits) {
      const stage = stages[i]!;
      const r = stage.fuseProbe(o, costAt(stage, o));
      if (r !== 0) return this.#refused(i, r);
    }
    for (const i of this.#rates) {
      const stage = stages[i]!;
      const r = stage.fuseProbe(o, costAt(stage, o));
      if (r !== 0) return this.#refused(i, r);
    }
    return 0;
  }

  #refused(i: number, r: number): number {
    if (Number.isNaN(r)) {
      throw new Error(`gate "${this.#name}": ${this.#stages[i]!.name} cannot admit these options`);
    }
    this.#refusedBy = i;
    return r;
  }

  /** Take every stage, each having just said it would admit. */
  #take(o: AdmitOptions): Ticket[] {
    const stages = this.#stages;
    const tickets = new Array<Ticket>(stages.length);
    const started = startTurn(this.#clock);
    try {
      for (let i = 0; i < stages.length; i++) {
        const stage = stages[i]!;
        const ticket = stage.admitNow(o, costAt(stage, o));
        if (ticket === undefined) {
          // A stage went back on its word: give back what was taken, as it was.
          for (let j = i - 1; j >= 0; j--) void tickets[j]!.refund();
          throw new Error(`gate "${this.#name}": ${stage.name} refused a call it said it would admit`);
        }
        tickets[i] = ticket;
      }
    } finally {
      endTurn(started);
    }
    return tickets;
  }

  admitNow(o: AdmitOptions): Ticket[] | undefined {
    if (this.#closedBy !== undefined || this.#permitLine.size > 0) return undefined;
    if (this.#lanes.size > 0 && this.#lanes.has(this.#laneOf(o))) return undefined;
    const started = startTurn(this.#clock);
    try {
      return this.#probe(o) === 0 ? this.#take(o) : undefined;
    } catch {
      // `admit` says why, with the stage's own error.
      return undefined;
    } finally {
      endTurn(started);
    }
  }

  admit(call: FusedCall, wait: boolean): Promise<Ticket[] | undefined> {
    try {
      return this.#admit(call, wait);
    } catch (error) {
      return Promise.reject(error);
    }
  }

  #admit(call: FusedCall, wait: boolean): Promise<Ticket[] | undefined> {
    if (this.#closedBy !== undefined) throw this.#closedBy;
    for (const stage of this.#stages) stage.checkOptions(call.optionsFor(stage));
    const o = call.o;
    const left = call.deadline - call.clock.now();
    const lane = this.#laneOf(o);
    const ahead = this.#permitLine.size > 0 || this.#lanes.has(lane);
    const r = ahead ? Number.NaN : this.#probe(o);
    if (r === 0) return Promise.resolve(this.#take(o));
    if (!wait) return Promise.resolve(undefined);
    // First in its lane, refused by a rate that cannot admit it before its deadline: refused at
    // once, as a lone token bucket refuses, saying when that rate could.
    if (r > left) return Promise.reject(this.#timeout(call, this.#refusedBy, r));
    // A call with no time left to wait (`timeoutMs: 0`) only tries: it never takes a place in line.
    // (Behind others, nothing was looked at: no stage to name.)
    if (!(left > 0)) return Promise.reject(this.#timeout(call, ahead ? -1 : this.#refusedBy));
    const now = this.#clock.now();
    return new Promise<Ticket[]>((resolve, reject) => {
      const w = new Waiter(++this.#arrivals, call, lane, now, resolve, reject);
      const signal = call.signal;
      if (signal) {
        w.onAbort = () => this.#giveUp(w, signal.reason);
        try {
          this.#signalWaits.add(signal, w.onAbort);
        } catch (error) {
          w.onAbort = undefined;
          reject(badSignal(this.#name, error));
          return;
        }
      }
      if (left !== Number.POSITIVE_INFINITY) {
        w.timer = this.#clock.setTimeout(() => {
          w.timer = undefined;
          this.#giveUp(w, this.#timeout(call, w.blame));
        }, left);
      }
      if (++this.#waiting === 1) for (const s of this.#stages) s.watch(this.#onChange);
      if (Number.isNaN(r)) {
        // Someone waits ahead: behind them, for permits when anyone waits for those.
        if (this.#permitLine.size > 0) this.#toPermits(w);
        else {
          w.blame = this.#rates[0] ?? -1;
          this.#toLane(w, false);
        }
      } else if (r < 0) {
        w.blame = this.#refusedBy;
        this.#permitLine.insert(w);
      } else {
        // First in its lane (nobody was there): the lane asks again when this wait is over.
        w.blame = this.#refusedBy;
        const line = this.#toLane(w, false);
        line.timer = this.#retry(line, r);
      }
    });
  }

  /** `w` into its lane, in its arrival's place; with `serve`, the lane goes on if it comes first. */
  #toLane(w: Waiter, serve: boolean): Line {
    let line = this.#lanes.get(w.lane);
    if (line === undefined) {
      line = new Line(w.lane);
      this.#lanes.set(w.lane, line);
    }
    line.insert(w);
    if (serve && line.head === w) this.#serveLane(line);
    return line;
  }

  /** `w` into the permit line, in its arrival's place, its wait counted at the first permit stage. */
  #toPermits(w: Waiter): void {
    if (w.blame < 0 || !PERMIT_KINDS.has(this.#stages[w.blame]!.kind)) {
      this.#charge(w, this.#clock.now(), this.#permits[0] ?? -1);
    }
    this.#permitLine.insert(w);
  }

  /** Ask `line` again in `ms`. */
  #retry(line: Line, ms: number): ClockTimer {
    return this.#clock.setTimeout(() => {
      line.timer = undefined;
      this.#serveLane(line);
    }, ms);
  }

  /** Count the wait of `w` so far at the stage it waited for, and from now at `blame`. */
  #charge(w: Waiter, now: number, blame: number): void {
    if (w.blame >= 0 && now > w.since) {
      const stage = this.#stages[w.blame]!;
      stage.countWait(PERMIT_KINDS.has(stage.kind) ? "permit" : "token", now - w.since);
    }
    w.since = now;
    w.blame = blame;
  }

  /** A stage may admit more (permits freed), or closed. */
  readonly #onChange: StageWatcher = (stage, closed) => {
    if (closed) this.#rejectAll(new ClosedError(stage.name));
    else this.#queueServe();
  };

  /** Serve the permit line once the code that freed permits is done (a release of several stages). */
  #queueServe(): void {
    if (this.#serveQueued || this.#permitLine.size === 0) return;
    this.#serveQueued = true;
    queueMicrotask(() => {
      this.#serveQueued = false;
      this.#servePermits();
    });
  }

  /**
   * Admit from the head of the permit line while every stage admits. A head that only a rate
   * refuses steps aside into its lane, keeping its arrival, and the line goes on without it.
   */
  #servePermits(): void {
    const line = this.#permitLine;
    for (let w = line.head; w !== null; w = line.head) {
      const now = this.#clock.now();
      const r = this.#ask(w);
      if (r === undefined) return;
      if (r < 0) {
        this.#charge(w, now, this.#refusedBy);
        return;
      }
      if (!this.#admitted(w, line, r, now)) this.#toLane(w, true);
    }
  }

  /** What `#probe` says for `w`; undefined when a stage has closed (every waiter is then rejected). */
  #ask(w: Waiter): number | undefined {
    try {
      return this.#probe(w.call.o);
    } catch (error) {
      this.#rejectAll(error);
      return undefined;
    }
  }

  /**
   * `w` leaves `line`: admitted when every stage admits (`r` 0), and true; else (a refusal it
   * waits on elsewhere) its wait so far is counted, and false.
   */
  #admitted(w: Waiter, line: Line, r: number, now: number): boolean {
    line.remove(w);
    if (r === 0) {
      this.#charge(w, now, -1);
      this.#grant(w);
      return true;
    }
    this.#charge(w, now, this.#refusedBy);
    return false;
  }

  /**
   * Admit from the head of `lane` while every stage admits; behind anyone who came earlier and
   * waits for permits, or refused by a permit stage, a caller goes into the permit line (so the
   * lane follows, in its order); refused by a rate, the lane asks again when that wait is over.
   */
  #serveLane(lane: Line): void {
    if (lane.timer !== undefined) {
      this.#clock.clearTimeout(lane.timer);
      lane.timer = undefined;
    }
    for (let w = lane.head; w !== null; w = lane.head) {
      const now = this.#clock.now();
      const first = this.#permitLine.head;
      if (first !== null && first.seq < w.seq) {
        lane.remove(w);
        this.#toPermits(w);
        continue;
      }
      const r = this.#ask(w);
      if (r === undefined) return;
      if (r > 0) {
        // Its rate cannot admit it before its deadline: refused now, not at the deadline; the
        // next in the lane is asked.
        if (r > w.call.deadline - w.call.clock.now()) {
          this.#leave(w, lane, this.#timeout(w.call, this.#refusedBy, r));
          continue;
        }
        this.#charge(w, now, this.#refusedBy);
        lane.timer = this.#retry(lane, r);
        break;
      }
      if (!this.#admitted(w, lane, r, now)) this.#permitLine.insert(w);
    }
    if (lane.size === 0 && this.#lanes.get(lane.key) === lane) this.#lanes.delete(lane.key);
  }

  /** `w` is admitted: take every stage and hand it the tickets. */
  #grant(w: Waiter): void {
    let tickets: Ticket[];
    try {
      tickets = this.#take(w.call.o);
    } catch (error) {
      this.#done(w);
      w.reject(error);
      return;
    }
    this.#done(w);
    w.resolve(tickets);
  }

  /** `w` leaves its line (timed out, aborted): the one behind it may now go. */
  #giveUp(w: Waiter, error: unknown): void {
    const line = w.line;
    if (line === undefined) return;
    const first = line.head === w;
    this.#leave(w, line, error);
    if (!first) return;
    if (line === this.#permitLine) this.#queueServe();
    else this.#serveLane(line);
  }

  /** `w` leaves `line` refused with `error`, its wait so far counted. */
  #leave(w: Waiter, line: Line, error: unknown): void {
    line.remove(w);
    this.#charge(w, this.#clock.now(), -1);
    this.#done(w);
    w.reject(error);
  }

  /** `w` has left the lines: its timer and listener go, and the watch when nobody waits. */
  #done(w: Waiter): void {
    if (w.timer !== undefined) this.#clock.clearTimeout(w.timer);
    if (w.onAbort && w.call.signal) this.#signalWaits.remove(w.call.signal, w.onAbort);
    if (--this.#waiting === 0) for (const s of this.#stages) s.unwatch(this.#onChange);
  }

  /** Every waiting call rejects with `error`. */
  #rejectAll(error: unknown): void {
    const lines = [this.#permitLine, ...this.#lanes.values()];
    this.#lanes.clear();
    for (const line of lines) {
      if (line.timer !== undefined) this.#clock.clearTimeout(line.timer);
      line.timer = undefined;
      for (let w = line.head; w !== null; w = line.head) this.#leave(w, line, error);
    }
  }

  together(fn: () => Promise<void>): Promise<void> {
    // Memory releases are done before `fn` returns: every stage reads the one time.
    const started = startTurn(this.#clock);
    try {
      return fn();
    } finally {
      endTurn(started);
    }
  }

  close(reason: unknown): void {
    this.#closedBy = reason;
    this.#rejectAll(reason);
  }

  /**
   * What `call` rejects with once it can wait no longer, having waited for stage `blame` (-1: none
   * known); with `retryAfterMs` when that stage, a rate, could admit it only then.
   */
  #timeout(call: FusedCall, blame: number, retryAfterMs?: number): AdmitTimeoutError {
    return gateTimeout(this.#name, call, blame >= 0 ? this.#stages[blame] : undefined, retryAfterMs);
  }
}
