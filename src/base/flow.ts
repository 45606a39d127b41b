/**
 * Little's law over a sliding window: how many calls a stage completed a second, how long each
 * held its ticket, and how many it held on average. Ten slots of a tenth of the window each, so
 * the window slides a slot at a time and costs a few numbers per admission and release.
 */
import type { FlowSnapshot } from "../types.js";

/**
 * A time read once for every stage of a fused gate while it takes or releases them all in one
 * go (a memory gate's stages, which share one clock; a Redis gate's turn, as it builds its script
 * call or reads the reply), so each stage does not read the clock again: `now`, read from
 * `clock`, for the stages on that clock; `clock` undefined when no turn is on.
 */
export const turn: { now: number; clock: unknown } = { now: 0, clock: undefined };

/**
 * Start a turn on `clock` at its time `now` (read here unless the caller has it), unless one is
 * on already; returns whether it started one, for `endTurn`.
 */
export function startTurn(clock: { now(): number }, now?: number): boolean {
  if (turn.clock !== undefined) return false;
  turn.now = now ?? clock.now();
  turn.clock = clock;
  return true;
}

/** `clock`'s time: the turn's when one is on for `clock`, else read from it. */
export function turnTime(clock: { now(): number }): number {
  return turn.clock === clock ? turn.now : clock.now();
}

/** End the turn `startTurn` started, if it did. */
export function endTurn(started: boolean): void {
  if (started) turn.clock = undefined;
}

/** The window every stage measures its flow over, in ms. */
export const FLOW_WINDOW_MS = 10_000;

const SLOTS = 10;
/** Service times kept for the p95 (the most recent ones). */
const SAMPLES = 256;

export class Flow {
  readonly #slotMs: number;
  /** Which slot of time (`floor(t / slotMs)`) each entry holds now. */
  readonly #id = new Float64Array(SLOTS).fill(Number.NEGATIVE_INFINITY);
  readonly #released = new Float64Array(SLOTS);
  readonly #heldMs = new Float64Array(SLOTS);
  /** ∫ in flight dt over the slot, in call·ms. */
  readonly #area = new Float64Array(SLOTS);
  /** ms callers waited for the stage, by the slot their wait ended in. */
  readonly #waitedMs = new Float64Array(SLOTS);
  /** The latest service times and when they ended, made at the first release (4 KiB). */
  #sampleMs: Float64Array | undefined = undefined;
  #sampleAt: Float64Array | undefined = undefined;
  #samples = 0;
  /** The time the area has been counted up to. */
  #since: number;
  readonly #born: number;

  /** The entry of the slot `#since` falls in, and when that slot ends. */
  #cur = 0;
  #curEnd = Number.NEGATIVE_INFINITY;

  constructor(now: number, windowMs = FLOW_WINDOW_MS) {
    this.#slotMs = windowMs / SLOTS;
    this.#since = now;
    this.#born = now;
    this.#enter(now);
  }

  /**
   * Count the time since the last change at `level` calls in flight, up to `now`. Call it before
   * the number in flight changes.
   */
  advance(now: number, level: number): void {
    const t = this.#since;
    if (!(now > t)) return;
    this.#since = now;
    if (now < this.#curEnd) {
      // Still in the slot of the last change: the common case, one addition.
      if (level > 0) this.#area[this.#cur] = this.#area[this.#cur]! + level * (now - t);
      return;
    }
    if (level > 0) {
      const slotMs = this.#slotMs;
      // Only the last SLOTS slots are kept: skip what lies before them.
      const first = (Math.floor(now / slotMs) - SLOTS + 1) * slotMs;
      let from = Math.max(t, first);
      while (from < now) {
        const id = Math.floor(from / slotMs);
        const end = Math.min(now, (id + 1) * slotMs);
        const i = this.#slot(id);
        this.#area[i] = this.#area[i]! + level * (end - from);
        from = end;
      }
    }
    this.#enter(now);
  }

  /** Make the slot `now` falls in the current one. */
  #enter(now: number): void {
    const id = Math.floor(now / this.#slotMs);
    this.#cur = this.#slot(id);
    this.#curEnd = (id + 1) * this.#slotMs;
  }

  /** A caller's wait of `ms` for the stage ended (in the slot of the last change). */
  waited(ms: number): void {
    this.#waitedMs[this.#cur] = this.#waitedMs[this.#cur]! + ms;
  }

  /** A ticket held `heldMs` was released at `now`, just after `advance(now, …)`. */
  released(now: number, heldMs: number): void {
    const i = this.#cur;
    this.#released[i] = this.#released[i]! + 1;
    if (!(heldMs >= 0)) return;
    this.#heldMs[i] = this.#heldMs[i]! + heldMs;
    if (this.#sampleMs === undefined) {
      this.#sampleMs = new Float64Array(SAMPLES);
      this.#sampleAt = new Float64Array(SAMPLES);
    }
    const s = this.#samples++ % SAMPLES;
    this.#sampleMs[s] = heldMs;
    this.#sampleAt![s] = now;
  }

  /** The entry of slot `id`, emptied first if it held an older slot. */
  #slot(id: number): number {
    const i = ((id % SLOTS) + SLOTS) % SLOTS;
    if (this.#id[i] !== id) {
      this.#id[i] = id;
      this.#released[i] = 0;
      this.#heldMs[i] = 0;
      this.#area[i] = 0;
      this.#waitedMs[i] = 0;
    }
    return i;
  }

  /** The figures at `now`, with `level` in flight since the last change, against `limit`. */
  snapshot(now: number, level: number, limit: number): FlowSnapshot {
    this.advance(now, level);
    const slotMs = this.#slotMs;
    const last = Math.floor(now / slotMs);
    const from = Math.max(this.#born, (last - SLOTS + 1) * slotMs);
    const windowMs = Math.max(0, now - from);
    let released = 0;
    let heldMs = 0;
    let area = 0;
    let waitedMs = 0;
    for (let i = 0; i < SLOTS; i++) {
      const id = this.#id[i]!;
      if (id > last || id <= last - SLOTS) continue;
      released += this.#released[i]!;
      heldMs += this.#heldMs[i]!;
      area += this.#area[i]!;
      waitedMs += this.#waitedMs[i]!;
    }
    const throughput = windowMs > 0 ? (released * 1000) / windowMs : 0;
    const serviceMs = released > 0 ? heldMs / released : 0;
    const meanInFlight = windowMs > 0 ? area / windowMs : 0;
    return {
      windowMs,
      released,
      throughput,
      serviceMs,
      serviceP95Ms: this.#p95(from),
      meanInFlight,
      littleInFlight: (throughput * serviceMs) / 1000,
      utilisation: limit > 0 && limit < Number.POSITIVE_INFINITY ? meanInFlight / limit : 0,
      waitedMs,
    };
  }

  /** The 95th percentile of the kept service times of calls released at or after `from`. */
  #p95(from: number): number {
    const ms = this.#sampleMs;
    const at = this.#sampleAt;
    if (ms === undefined || at === undefined) return 0;
    const n = Math.min(this.#samples, SAMPLES);
    const kept: number[] = [];
    for (let i = 0; i < n; i++) if (at[i]! >= from) kept.push(ms[i]!);
    if (kept.length === 0) return 0;
    kept.sort((a, b) => a - b);
    return kept[Math.min(kept.length - 1, Math.ceil(0.95 * kept.length) - 1)]!;
  }
}

/**
 * Two flows of one stage taken together (a Redis stage and its local fallback): counts and
 * means in flight add up, the service time is the mean over both, the p95 the larger one.
 */
export function addFlows(a: FlowSnapshot, b: FlowSnapshot, limit: number): FlowSnapshot {
  const released = a.released + b.released;
  const windowMs = Math.max(a.windowMs, b.windowMs);
  const throughput = a.throughput + b.throughput;
  const serviceMs = released > 0 ? (a.serviceMs * a.released + b.serviceMs * b.released) / released : 0;
  const meanInFlight = a.meanInFlight + b.meanInFlight;
  return {
    windowMs,
    released,
    throughput,
    serviceMs,
    serviceP95Ms: Math.max(a.serviceP95Ms, b.serviceP95Ms),
    meanInFlight,
    littleInFlight: (throughput * serviceMs) / 1000,
    utilisation: limit > 0 && limit < Number.POSITIVE_INFINITY ? meanInFlight / limit : 0,
    waitedMs: a.waitedMs + b.waitedMs,
  };
}
