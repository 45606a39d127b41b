import fc from "fast-check";
import {
  type AdmitOptions,
  AdmitTimeoutError,
  memory,
  type Outcome,
  type Snapshot,
  type Stage,
  type Ticket,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { type AimdConfig, type AimdState, aimdStep } from "../../src/algorithms/aimd.js";

/* ------------------------------------------------------------------------------------------------
 * A signal that counts its listeners (cockatiel's listener-leak test): a Proxy over a real
 * AbortSignal that sees every addEventListener / removeEventListener the stage makes.
 * ---------------------------------------------------------------------------------------------- */

interface CountingSignal {
  readonly signal: AbortSignal;
  readonly reason: { readonly aborted: number };
  /** Listeners added and not yet removed (explicitly, or by the platform for `once` on abort). */
  live(): number;
  added: number;
  removed: number;
  abort(): void;
}

let reasons = 0;

type Listener = Parameters<EventTarget["addEventListener"]>[1];
type AddOptions = Parameters<EventTarget["addEventListener"]>[2];
type RemoveOptions = Parameters<EventTarget["removeEventListener"]>[2];

function countingSignal(): CountingSignal {
  const controller = new AbortController();
  const target = controller.signal;
  const listeners = new Map<unknown, { once: boolean }>();
  // Registered first, so it runs first: the platform drops `once` listeners as abort dispatches.
  target.addEventListener("abort", () => {
    for (const [listener, entry] of listeners) if (entry.once) listeners.delete(listener);
  });
  const reason = { aborted: ++reasons };
  const counter: CountingSignal = {
    signal: undefined as unknown as AbortSignal,
    reason,
    added: 0,
    removed: 0,
    live: () => listeners.size,
    abort: () => controller.abort(reason),
  };
  function addEventListener(type: string, listener: Listener, options?: AddOptions): void {
    counter.added++;
    if (type === "abort" && listener && !listeners.has(listener)) {
      const once = typeof options === "object" && options?.once === true;
      if (!(once && target.aborted)) listeners.set(listener, { once });
    }
    target.addEventListener(type, listener, options);
  }
  function removeEventListener(type: string, listener: Listener, options?: RemoveOptions): void {
    counter.removed++;
    if (type === "abort") listeners.delete(listener);
    target.removeEventListener(type, listener, options);
  }
  (counter as { signal: AbortSignal }).signal = new Proxy(target, {
    get(t, prop) {
      if (prop === "addEventListener") return addEventListener;
      if (prop === "removeEventListener") return removeEventListener;
      const value = Reflect.get(t, prop, t);
      return typeof value === "function" ? value.bind(t) : value;
    },
  });
  return counter;
}

/* ------------------------------------------------------------------------------------------------
 * Calls: every admission a run makes, with when and how it settled.
 * ---------------------------------------------------------------------------------------------- */

interface Call {
  readonly id: number;
  readonly cost: number;
  /** Bucket key or host. */
  readonly key: string;
  readonly startedAt: number;
  readonly timeoutMs: number | undefined;
  readonly signal: CountingSignal | undefined;
  status: "waiting" | "granted" | "rejected";
  ticket: Ticket | undefined;
  settledAt: number;
  /** Op index at which the grant was seen. */
  grantedOp: number;
  error: unknown;
  /** Set when the call's signal aborted while it was waiting: it must reject with that reason. */
  abortedWhileWaiting: { readonly aborted: number } | undefined;
  /** The signal was aborted before the call: it may be granted (nothing to wait for) or rejected with the reason. */
  preAborted: boolean;
  /** Listeners left on the call's own signal when it settled. */
  liveAtSettle: number;
  /** Released or refunded. */
  done: boolean;
  refunded: boolean;
}

interface AdmitArgs {
  cost: number;
  key: string;
  timeoutMs: number | undefined;
  signal: CountingSignal | undefined;
}

/**
 * Drives one stage from a list of ops on a `FakeClock` and records every call. `onGrant` runs
 * when a grant is observed (after the promise resolves, at the same fake time) and may record a
 * violation; violations are asserted at the end, because a throw inside `then` would be lost.
 */
class Run {
  readonly calls: Call[] = [];
  readonly violations: string[] = [];
  op = 0;
  /** Runs just before a ticket is released or refunded, while the call still counts as held. */
  beforeFinish: (call: Call, how: Outcome | "refund") => void = () => {};
  #ids = 0;

  constructor(
    readonly clock: FakeClock,
    readonly stage: Stage,
    readonly onGrant: (call: Call, run: Run) => void = () => {},
  ) {}

  admit(args: AdmitArgs): Call {
    const call: Call = {
      id: ++this.#ids,
      cost: args.cost,
      key: args.key,
      startedAt: this.clock.now(),
      timeoutMs: args.timeoutMs,
      signal: args.signal,
      status: "waiting",
      ticket: undefined,
      settledAt: Number.NaN,
      grantedOp: -1,
      error: undefined,
      abortedWhileWaiting: undefined,
      preAborted: false,
      liveAtSettle: 0,
      done: false,
      refunded: false,
    };
    this.calls.push(call);
    const options: AdmitOptions = { cost: args.cost, key: args.key, host: args.key };
    if (args.timeoutMs !== undefined) options.timeoutMs = args.timeoutMs;
    if (args.signal) options.signal = args.signal.signal;
    if (args.signal?.signal.aborted) call.preAborted = true;
    this.stage.admit(options).then(
      (ticket) => {
        call.status = "granted";
        call.ticket = ticket;
        call.settledAt = this.clock.now();
        call.grantedOp = this.op;
        call.liveAtSettle = args.signal?.live() ?? 0;
        this.onGrant(call, this);
      },
      (error: unknown) => {
        call.status = "rejected";
        call.error = error;
        call.settledAt = this.clock.now();
        call.liveAtSettle = args.signal?.live() ?? 0;
      },
    );
    return call;
  }

  /** `tryAdmit`, recorded as a call that is granted or not at once. */
  async tryAdmit(cost: number, key: string): Promise<Call | undefined> {
    const startedAt = this.clock.now();
    const ticket = await this.stage.tryAdmit({ cost, key, host: key });
    if (!ticket) return undefined;
    const call: Call = {
      id: ++this.#ids,
      cost,
      key,
      startedAt,
      timeoutMs: undefined,
      signal: undefined,
      status: "granted",
      ticket,
      settledAt: this.clock.now(),
      grantedOp: this.op,
      error: undefined,
      abortedWhileWaiting: undefined,
      preAborted: false,
      liveAtSettle: 0,
      done: false,
      refunded: false,
    };
    this.calls.push(call);
    this.onGrant(call, this);
    return call;
  }

  waiting(): Call[] {
    return this.calls.filter((c) => c.status === "waiting");
  }

  held(): Call[] {
    return this.calls.filter((c) => c.status === "granted" && !c.done);
  }

  heldCost(): number {
    return this.held().reduce((n, c) => n + c.cost, 0);
  }

  /**
   * Release (or refund) a held ticket, if any: `pick` >= 0 counts from the newest (0 is the
   * newest), `pick` < 0 from the oldest (-1 is the oldest).
   */
  async finish(pick: number, how: Outcome | "refund"): Promise<Call | undefined> {
    const held = this.held();
    if (held.length === 0) return undefined;
    const i = pick >= 0 ? held.length - 1 - (pick % held.length) : (-pick - 1) % held.length;
    const call = held[i]!;
    this.beforeFinish(call, how);
    call.done = true;
    if (how === "refund") {
      call.refunded = true;
      await call.ticket!.refund();
    } else {
      await call.ticket!.release(how);
    }
    return call;
  }

  /** Abort the signal of the `pick`-th waiting call that has one, if any. */
  abort(pick: number): void {
    const candidates = this.waiting().filter((c) => c.signal && !c.signal.signal.aborted);
    if (candidates.length === 0) return;
    const signal = candidates[pick % candidates.length]!.signal!;
    for (const c of this.waiting()) if (c.signal === signal) c.abortedWhileWaiting = signal.reason;
    signal.abort();
  }

  /**
   * Wind down: abort every waiting call that has a signal, then release every ticket and let time
   * run until nothing waits any more.
   */
  async drain(stepMs: number, rounds = 200): Promise<void> {
    // One at a time: an abort can let the next waiter in, and its grant must be seen first.
    while (this.waiting().some((c) => c.signal && !c.signal.signal.aborted)) {
      this.abort(0);
      await this.clock.flush();
    }
    for (let i = 0; i < rounds; i++) {
      while (this.held().length > 0) await this.finish(0, "success");
      await this.clock.flush();
      if (this.waiting().length === 0 && this.held().length === 0) return;
      await this.clock.advance(stepMs);
    }
    throw new Error(
      `calls still waiting after ${rounds} rounds: ${this.waiting()
        .map((c) => c.id)
        .join(", ")}`,
    );
  }

  /** Checks every run shares: settled calls, abort reasons, timeouts, listeners, counters. */
  expectClean(snapshot: Snapshot): void {
    expect(this.violations).toEqual([]);
    for (const c of this.calls) {
      const where = `call ${c.id} (${JSON.stringify({ cost: c.cost, key: c.key, at: c.startedAt, timeoutMs: c.timeoutMs })})`;
      expect(c.status, where).not.toBe("waiting");
      // Every listener the wait added is gone once it is over; a call's own signal is its alone.
      expect(c.liveAtSettle, where).toBe(0);
      if (c.signal) expect(c.signal.live(), where).toBe(0);
      if (c.abortedWhileWaiting) {
        expect(c.status, where).toBe("rejected");
        expect(c.error, where).toBe(c.abortedWhileWaiting);
      } else if (c.preAborted && c.status === "rejected") {
        expect(c.error, where).toBe(c.signal!.reason);
      } else if (c.status === "rejected") {
        expect(c.error, where).toBeInstanceOf(AdmitTimeoutError);
      }
      if (c.timeoutMs !== undefined)
        expect(c.settledAt - c.startedAt, where).toBeLessThanOrEqual(c.timeoutMs);
    }
    expect(snapshot.waiting).toBe(0);
    expect(snapshot.inFlight).toBe(0);
  }
}

/* ------------------------------------------------------------------------------------------------
 * Ops.
 * ---------------------------------------------------------------------------------------------- */

type Op =
  | {
      kind: "admit";
      cost: number;
      key: number;
      signal: "none" | "own" | "aborted";
      timeoutMs: number | undefined;
    }
  | { kind: "tryAdmit"; cost: number; key: number }
  | { kind: "release"; pick: number; outcome: Outcome }
  | { kind: "refund"; pick: number }
  | { kind: "abort"; pick: number }
  | { kind: "advance"; ms: number }
  | { kind: "pause"; key: number; ms: number };

/** What a run's ops may do. Costs are drawn in [0, 20] and mapped into each stage's range. */
interface OpShape {
  maxTimeoutMs: number;
  maxAdvanceMs: number;
  maxPauseMs?: number;
  keys?: number;
  tryAdmit?: boolean;
  refund?: boolean;
  /** Relative weights of the kinds of op. */
  weights?: Partial<Record<Op["kind"], number>>;
}

function opsArb(shape: OpShape): fc.Arbitrary<Op[]> {
  const keys = (shape.keys ?? 1) - 1;
  const w = {
    admit: 4,
    release: 2,
    abort: 1,
    advance: 3,
    tryAdmit: 1,
    refund: 2,
    pause: 2,
    ...shape.weights,
  };
  // The newest or the oldest held ticket often, any other sometimes (see `Run.finish`).
  const heldPick = fc.oneof(fc.constant(0), fc.constant(-1), fc.integer({ min: -20, max: 20 }));
  const ops: fc.WeightedArbitrary<Op>[] = [
    {
      weight: w.admit,
      arbitrary: fc.record({
        kind: fc.constant("admit" as const),
        cost: fc.nat(20),
        key: fc.nat(keys),
        signal: fc.constantFrom("none" as const, "own" as const, "own" as const, "aborted" as const),
        timeoutMs: fc.option(fc.nat(shape.maxTimeoutMs), { nil: undefined, freq: 2 }),
      }),
    },
    {
      weight: w.release,
      arbitrary: fc.record({
        kind: fc.constant("release" as const),
        pick: heldPick,
        outcome: fc.constantFrom<Outcome>("success", "dropped", "ignored"),
      }),
    },
    {
      weight: w.abort,
      arbitrary: fc.record({
        kind: fc.constant("abort" as const),
        pick: fc.oneof(fc.constant(0), fc.nat(20)),
      }),
    },
    {
      weight: w.advance,
      // Short steps and long ones alike (fc.nat alone favours small values).
      arbitrary: fc.record({
        kind: fc.constant("advance" as const),
        ms: fc.oneof(
          fc.nat(shape.maxAdvanceMs),
          fc.integer({ min: shape.maxAdvanceMs >> 1, max: shape.maxAdvanceMs }),
        ),
      }),
    },
  ];
  if (shape.tryAdmit) {
    ops.push({
      weight: w.tryAdmit,
      arbitrary: fc.record({ kind: fc.constant("tryAdmit" as const), cost: fc.nat(20), key: fc.nat(keys) }),
    });
  }
  if (shape.refund)
    ops.push({
      weight: w.refund,
      arbitrary: fc.record({
        kind: fc.constant("refund" as const),
        pick: heldPick,
      }),
    });
  if (shape.maxPauseMs !== undefined) {
    // Short pauses (which may fall inside the current spacing) as often as long ones.
    const ms = fc.oneof(
      fc.nat(shape.maxPauseMs),
      fc.integer({ min: 1, max: Math.ceil(shape.maxPauseMs / 10) }),
    );
    ops.push({
      weight: w.pause,
      arbitrary: fc.record({ kind: fc.constant("pause" as const), key: fc.nat(keys), ms }),
    });
  }
  return fc.array(fc.oneof(...ops), { maxLength: 50, size: "max" });
}

const KEYS = ["a", "b", "c"] as const;

/** Apply one op; `cost` maps the drawn cost into the stage's range. */
async function apply(
  run: Run,
  op: Op,
  cost: (drawn: number) => number,
  pause?: (host: string, ms: number) => Promise<void>,
) {
  switch (op.kind) {
    case "admit": {
      let signal: CountingSignal | undefined;
      if (op.signal !== "none") signal = countingSignal();
      if (op.signal === "aborted") signal!.abort();
      run.admit({ cost: cost(op.cost), key: KEYS[op.key]!, timeoutMs: op.timeoutMs, signal });
      await run.clock.flush();
      return;
    }
    case "tryAdmit":
      await run.tryAdmit(cost(op.cost), KEYS[op.key]!);
      return;
    case "release":
      await run.finish(op.pick, op.outcome);
      await run.clock.flush();
      return;
    case "refund":
      await run.finish(op.pick, "refund");
      await run.clock.flush();
      return;
    case "abort":
      run.abort(op.pick);
      await run.clock.flush();
      return;
    case "advance":
      await run.clock.advance(op.ms);
      return;
    case "pause":
      await pause?.(KEYS[op.key]!, op.ms);
      await run.clock.flush();
      return;
  }
}

const RUNS = { numRuns: 100 };

/* ------------------------------------------------------------------------------------------------
 * The properties.
 * ---------------------------------------------------------------------------------------------- */

describe("in-memory stages under random ops", () => {
  it("semaphore: never has more than limit permits out, serves waiters in order, and ends empty", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.integer({ min: 1, max: 6 }),
        opsArb({ maxTimeoutMs: 50, maxAdvanceMs: 40, tryAdmit: true, refund: true }),
        async (limit, ops) => {
          const clock = new FakeClock();
          const sem = memory({ clock }).semaphore("sem", { limit });
          const run = new Run(clock, sem, (call, r) => {
            const out = r.heldCost();
            if (out > limit) r.violations.push(`${out} permits out after call ${call.id} (limit ${limit})`);
            // First in, first out: nobody admitted earlier may still be waiting.
            const skipped = r.waiting().filter((w) => w.id < call.id);
            if (skipped.length > 0)
              r.violations.push(`call ${call.id} went ahead of ${skipped.map((w) => w.id)}`);
          });
          for (const op of ops) {
            await apply(run, op, (n) => 1 + (n % limit));
            run.op++;
            const s = sem.snapshot();
            expect(s.waiting).toBe(run.waiting().length);
            expect(s.inFlight).toBe(run.held().length);
            expect(sem.held).toBe(run.heldCost());
            // Work-conserving: the head waits only while it does not fit.
            const head = run.waiting()[0];
            if (head) expect(run.heldCost() + head.cost).toBeGreaterThan(limit);
          }
          await run.drain(25);
          run.expectClean(sem.snapshot());
          for (const c of run.calls) {
            // A semaphore times out exactly at the deadline (or at once for timeoutMs 0).
            if (c.error instanceof AdmitTimeoutError) expect(c.settledAt).toBe(c.startedAt + c.timeoutMs!);
          }
          expect(sem.held).toBe(0);
          expect(clock.pendingTimers).toBe(0);
          const fresh = run.admit({ cost: limit, key: "a", timeoutMs: undefined, signal: undefined });
          await clock.flush();
          expect(fresh.status).toBe("granted");
        },
      ),
      RUNS,
    );
  });

  it("token bucket: grants at most capacity + refillPerSecond × w/1000 tokens in any window of w ms", async () => {
    const config = fc.record({
      capacity: fc.integer({ min: 1, max: 5 }),
      refillPerSecond: fc.constantFrom(0.3, 0.5, 1, 2, 7.5, 20),
      penalty: fc.option(
        fc.record({
          factor: fc.constantFrom(0.25, 0.5, 0.9),
          recoveryMs: fc.integer({ min: 1, max: 5000 }),
          minFactor: fc.constantFrom(0.1, 0.5, 1),
        }),
        { nil: undefined },
      ),
    });
    await fc.assert(
      fc.asyncProperty(
        config,
        opsArb({
          maxTimeoutMs: 3000,
          maxAdvanceMs: 1500,
          keys: 2,
          tryAdmit: true,
          refund: true,
          weights: { admit: 6, tryAdmit: 4, refund: 3, release: 1 },
        }),
        async ({ capacity, refillPerSecond, penalty }, ops) => {
          const clock = new FakeClock();
          const bucket = memory({ clock }).tokenBucket("tb", {
            keyed: true,
            capacity,
            refillPerSecond,
            ...(penalty ? { penalty } : {}),
          });
          const run = new Run(clock, bucket, (call, r) => {
            // First in, first out per key.
            const skipped = r.waiting().filter((w) => w.id < call.id && w.key === call.key);
            if (skipped.length > 0)
              r.violations.push(`call ${call.id} went ahead of ${skipped.map((w) => w.id)}`);
          });
          for (const op of ops) {
            await apply(run, op, (n) => 1 + (n % capacity));
            run.op++;
            for (const key of ["a", "b"]) {
              const tokens = bucket.tokens(key);
              expect(tokens).toBeGreaterThanOrEqual(0);
              expect(tokens).toBeLessThanOrEqual(capacity);
            }
            expect(bucket.snapshot().waiting).toBe(run.waiting().length);
          }
          await run.drain(10_000);
          run.expectClean(bucket.snapshot());
          for (const key of ["a", "b"]) {
            const grants = run.calls
              .filter((c) => c.key === key && c.status === "granted" && !c.refunded)
              .sort((x, y) => x.settledAt - y.settledAt);
            for (let i = 0; i < grants.length; i++) {
              let sum = 0;
              for (let j = i; j < grants.length; j++) {
                sum += grants[j]!.cost;
                const w = grants[j]!.settledAt - grants[i]!.settledAt;
                const most = capacity + (refillPerSecond * w) / 1000;
                if (sum > most + 1e-6) {
                  expect.fail(
                    `key ${key}: ${sum} tokens granted in [${grants[i]!.settledAt}, ${grants[j]!.settledAt}] > ${most}`,
                  );
                }
              }
            }
          }
        },
      ),
      RUNS,
    );
  });

  it("interval gate: spaces grants to one host by at least minIntervalMs (plus their jitter) and never starts one inside a pause", async () => {
    const config = fc.record({
      minIntervalMs: fc.integer({ min: 10, max: 100 }),
      jitterMs: fc.integer({ min: 0, max: 60 }),
      randoms: fc.array(fc.double({ min: 0, max: 1, maxExcluded: true, noNaN: true }), {
        minLength: 1,
        maxLength: 8,
      }),
    });
    await fc.assert(
      fc.asyncProperty(
        config,
        opsArb({
          maxTimeoutMs: 300,
          maxAdvanceMs: 80,
          maxPauseMs: 300,
          keys: 2,
          tryAdmit: true,
          refund: true,
          weights: { admit: 6, tryAdmit: 3, refund: 4, pause: 4, release: 1, advance: 2, abort: 1 },
        }),
        async ({ minIntervalMs, jitterMs, randoms }, ops) => {
          const clock = new FakeClock();
          // Each grant claims a slot with one draw; remember the draws in order.
          const drawn: number[] = [];
          const random = () => {
            const r = randoms[drawn.length % randoms.length]!;
            drawn.push(r);
            return r;
          };
          const gate = memory({ clock, random }).intervalGate("ig", { minIntervalMs, jitterMs });
          const grants: Call[] = [];
          const run = new Run(clock, gate, (call) => grants.push(call));
          const pauses: Array<{ host: string; op: number; until: number }> = [];
          const pause = (host: string, ms: number) => {
            pauses.push({ host, op: run.op, until: clock.now() + ms });
            return gate.pause(host, ms);
          };
          for (const op of ops) {
            await apply(run, op, () => 1, pause);
            run.op++;
            expect(gate.snapshot().waiting).toBe(run.waiting().length);
          }
          await run.drain(500);
          run.expectClean(gate.snapshot());
          expect(drawn.length).toBe(grants.length);
          for (const host of ["a", "b"]) {
            const started = grants
              .map((call, i) => ({ call, spacing: minIntervalMs + jitterMs * drawn[i]! }))
              .filter(({ call }) => call.key === host && !call.refunded);
            for (let i = 1; i < started.length; i++) {
              const prev = started[i - 1]!;
              const next = started[i]!;
              // Times are sums of fractional spacings: allow for float rounding, nothing more.
              const gap = next.call.settledAt - prev.call.settledAt;
              const where = `host ${host}: calls ${prev.call.id} → ${next.call.id}`;
              expect(gap, where).toBeGreaterThanOrEqual(minIntervalMs - 1e-9);
              expect(gap, where).toBeGreaterThanOrEqual(prev.spacing - 1e-9);
            }
            // A pause only adds delay: no call to the host starts before it ends.
            for (const p of pauses.filter((x) => x.host === host)) {
              for (const { call } of started) {
                if (call.grantedOp > p.op) {
                  expect(
                    call.settledAt,
                    `host ${host}: call ${call.id} started inside a pause made at op ${p.op} until ${p.until}`,
                  ).toBeGreaterThanOrEqual(p.until);
                }
              }
            }
          }
        },
      ),
      RUNS,
    );
  });

  it("AIMD: keeps the limit in [min, max], moves it as aimdStep says, and never grants past it", async () => {
    const config = fc
      .record({
        min: fc.integer({ min: 1, max: 3 }),
        span: fc.integer({ min: 0, max: 8 }),
        start: fc.nat(8),
        backoffRatio: fc.constantFrom(0.5, 0.7, 0.9, 0.99),
        slowCallMs: fc.option(fc.integer({ min: 1, max: 200 }), { nil: undefined }),
      })
      .map(({ min, span, start, backoffRatio, slowCallMs }) => ({
        min,
        max: min + span,
        initial: min + (start % (span + 1)),
        backoffRatio,
        slowCallMs,
      }));
    await fc.assert(
      fc.asyncProperty(
        config,
        opsArb({ maxTimeoutMs: 200, maxAdvanceMs: 120, tryAdmit: true, refund: true }),
        async ({ min, max, initial, backoffRatio, slowCallMs }, ops) => {
          const clock = new FakeClock();
          const aimd = memory({ clock }).aimd("aimd", {
            min,
            max,
            initial,
            backoffRatio,
            ...(slowCallMs !== undefined ? { slowCallMs } : {}),
          });
          // A model of the limit, fed the same samples.
          const cfg: AimdConfig = { min, max, backoffRatio };
          let model: AimdState = { limit: initial, epoch: 0 };
          const epochs = new Map<number, number>();
          const run = new Run(clock, aimd, (call, r) => {
            epochs.set(call.id, model.epoch);
            const limit = aimd.snapshot().limit;
            if (r.heldCost() > limit)
              r.violations.push(`${r.heldCost()} in flight after call ${call.id} (limit ${limit})`);
          });
          // Feed the model before the stage sees the release, so calls it then grants record the
          // epoch they are granted in.
          run.beforeFinish = (call, how) => {
            if (how === "refund" || how === "ignored") return;
            const slow = slowCallMs !== undefined && clock.now() - call.settledAt > slowCallMs;
            model = aimdStep(model, cfg, {
              dropped: how === "dropped" || slow,
              inFlight: run.heldCost(),
              epoch: epochs.get(call.id)!,
            });
          };
          for (const op of ops) {
            await apply(run, op, (n) => 1 + (n % min));
            run.op++;
            const limit = aimd.snapshot().limit;
            expect(limit).toBeGreaterThanOrEqual(min);
            expect(limit).toBeLessThanOrEqual(max);
            expect(limit).toBe(model.limit);
            const head = run.waiting()[0];
            if (head) expect(run.heldCost() + head.cost).toBeGreaterThan(limit);
          }
          await run.drain(100);
          run.expectClean(aimd.snapshot());
        },
      ),
      RUNS,
    );
  });

  describe("aborts and timeouts leave nothing behind", () => {
    type Kind = "semaphore" | "tokenBucket" | "intervalGate" | "aimd" | "queue";
    const build = (kind: Kind, clock: FakeClock) => {
      const backend = memory({ clock, random: () => 0.5 });
      switch (kind) {
        case "semaphore":
          return { stage: backend.semaphore("s", { limit: 2 }), most: 2 };
        case "tokenBucket":
          return {
            stage: backend.tokenBucket("t", { keyed: true, capacity: 3, refillPerSecond: 5, penalty: {} }),
            most: 3,
          };
        case "intervalGate":
          return { stage: backend.intervalGate("i", { minIntervalMs: 40, jitterMs: 20 }), most: 1 };
        case "aimd":
          return { stage: backend.aimd("a", { min: 2, initial: 3, max: 6 }), most: 2 };
        case "queue":
          return { stage: backend.queue("q", { maxSize: 2 }), most: 2 };
      }
    };

    it("removes every abort listener, timer and waiter once each wait is over", async () => {
      await fc.assert(
        fc.asyncProperty(
          fc.constantFrom<Kind>("semaphore", "tokenBucket", "intervalGate", "aimd", "queue"),
          opsArb({ maxTimeoutMs: 200, maxAdvanceMs: 100, keys: 2, refund: true }),
          async (kind, ops) => {
            const clock = new FakeClock();
            const { stage, most } = build(kind, clock);
            const run = new Run(clock, stage);
            const signals: CountingSignal[] = [];
            for (const op of ops) {
              await apply(run, op, (n) => 1 + (n % most));
              run.op++;
              for (const c of run.calls) if (c.signal && !signals.includes(c.signal)) signals.push(c.signal);
              // A settled call has no listener left; a waiting one has exactly one.
              for (const c of run.calls) {
                if (!c.signal) continue;
                expect(c.signal.live(), `call ${c.id} (${c.status})`).toBe(c.status === "waiting" ? 1 : 0);
              }
              expect(stage.snapshot().waiting).toBe(run.waiting().length);
              expect(stage.snapshot().inFlight).toBe(run.held().length);
            }
            await run.drain(1000);
            run.expectClean(stage.snapshot());
            for (const s of signals) {
              expect(s.live()).toBe(0);
              expect(s.removed).toBeGreaterThanOrEqual(s.signal.aborted ? 0 : s.added);
            }
            // Waiter timers are gone; only the keyed stages' idle sweep may remain.
            const sweeps = kind === "tokenBucket" || kind === "intervalGate" ? 1 : 0;
            expect(clock.pendingTimers).toBeLessThanOrEqual(sweeps);
            // Nothing is held: a call of the largest cost goes straight through (time lets a
            // bucket refill and an interval pass first).
            await clock.advance(10_000);
            const fresh = await stage.tryAdmit({ cost: most, key: "a", host: "a" });
            expect(fresh).toBeDefined();
            await fresh!.release();
          },
        ),
        RUNS,
      );
    });

    it("adds no listener to a signal that is already aborted, and rejects with its reason", async () => {
      const clock = new FakeClock();
      const sem = memory({ clock }).semaphore("s", { limit: 1 });
      const held = await sem.admit();
      const signal = countingSignal();
      signal.abort();
      const error = await sem.admit({ signal: signal.signal }).catch((e: unknown) => e);
      expect(error).toBe(signal.reason);
      expect(signal.added).toBe(0);
      expect(sem.snapshot()).toMatchObject({ waiting: 0, aborted: 0 });
      await held.release();
    });

    it("removes the listener when the wait times out, and the signal no longer reaches the stage", async () => {
      const clock = new FakeClock();
      const sem = memory({ clock }).semaphore("s", { limit: 1 });
      const held = await sem.admit();
      const signal = countingSignal();
      const waiting = sem.admit({ signal: signal.signal, timeoutMs: 50 }).catch((e: unknown) => e);
      await clock.flush();
      expect(signal.live()).toBe(1);
      await clock.advance(50);
      expect(await waiting).toBeInstanceOf(AdmitTimeoutError);
      expect(signal.live()).toBe(0);
      expect(signal.removed).toBe(signal.added);
      signal.abort();
      expect(sem.snapshot()).toMatchObject({ waiting: 0, aborted: 0, timedOut: 1 });
      await held.release();
      expect(clock.pendingTimers).toBe(0);
    });

    it("removes the listeners of many waiters sharing one signal, granted or aborted", async () => {
      const clock = new FakeClock();
      const sem = memory({ clock }).semaphore("s", { limit: 1 });
      const held = await sem.admit();
      const signal = countingSignal();
      const first = sem.admit({ signal: signal.signal });
      const rest = [1, 2, 3].map(() => sem.admit({ signal: signal.signal }).catch((e: unknown) => e));
      await clock.flush();
      // (One listener for the stage's waits on the signal, however many: see SignalWaits.)
      expect(signal.live()).toBe(1);
      await held.release();
      const ticket = await first;
      expect(signal.live()).toBe(1);
      signal.abort();
      for (const r of rest) expect(await r).toBe(signal.reason);
      expect(signal.live()).toBe(0);
      expect(sem.snapshot()).toMatchObject({ waiting: 0, inFlight: 1, aborted: 3 });
      await ticket.release();
      expect(sem.snapshot().inFlight).toBe(0);
    });
  });

  describe("a refund never lets a burst past capacity", () => {
    it("refuses a second token at the instant a late refund arrives, as if the refunded call had never taken one", async () => {
      // Had A never been admitted, the bucket would have been full (1 token, capped) at 1000 ms;
      // B takes that token and C is refused. A refund must not do better than that.
      const clock = new FakeClock();
      const bucket = memory({ clock }).tokenBucket("tb", { capacity: 1, refillPerSecond: 1 });
      const a = await bucket.admit();
      await clock.advance(1000);
      const b = await bucket.tryAdmit();
      expect(b).toBeDefined();
      await a.refund();
      const c = await bucket.tryAdmit();
      expect(c).toBeUndefined();
    });

    it("gives back all of a refunded ticket's tokens when nothing else was granted since", async () => {
      const clock = new FakeClock();
      const bucket = memory({ clock }).tokenBucket("tb", { capacity: 3, refillPerSecond: 1 });
      const a = await bucket.admit({ cost: 3 });
      await clock.advance(500);
      await a.refund();
      expect(bucket.tokens()).toBe(3);
      const b = await bucket.tryAdmit({ cost: 3 });
      expect(b).toBeDefined();
    });
  });

  describe("a refund never undoes a pause", () => {
    it("does not start a call inside a pause after the call before it is refunded", async () => {
      // A is granted at 0 and claims the slot at 100; a 50 ms pause at 0 leaves that slot as it
      // is (it ends sooner). Refunding A hands its slot back, and with it the pause.
      const clock = new FakeClock();
      const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 100 });
      const a = await gate.admit({ host: "h" });
      await gate.pause("h", 50);
      await a.refund();
      let startedAt = Number.NaN;
      void gate.admit({ host: "h" }).then(() => {
        startedAt = clock.now();
      });
      await clock.advance(200);
      expect(startedAt).toBeGreaterThanOrEqual(50);
    });

    it("holds every pause, whichever granted call is refunded and whenever", async () => {
      const scenario = fc.record({
        minIntervalMs: fc.integer({ min: 1, max: 100 }),
        jitterMs: fc.integer({ min: 0, max: 50 }),
        random: fc.double({ min: 0, max: 1, maxExcluded: true, noNaN: true }),
        calls: fc.integer({ min: 1, max: 4 }),
        pauseAfterMs: fc.nat(200),
        pauseMs: fc.integer({ min: 1, max: 300 }),
        refundAfterMs: fc.nat(300),
        refund: fc.nat(3),
      });
      await fc.assert(
        fc.asyncProperty(scenario, async (c) => {
          const clock = new FakeClock();
          const gate = memory({ clock, random: () => c.random }).intervalGate("ig", {
            minIntervalMs: c.minIntervalMs,
            jitterMs: c.jitterMs,
          });
          const started: Array<{ ticket: Ticket; at: number }> = [];
          const admit = () =>
            void gate.admit({ host: "h" }).then((ticket) => started.push({ ticket, at: clock.now() }));
          for (let i = 0; i < c.calls; i++) admit();
          await clock.advance(c.pauseAfterMs);
          const before = started.length;
          const until = clock.now() + c.pauseMs;
          await gate.pause("h", c.pauseMs);
          await clock.advance(Math.min(c.refundAfterMs, c.pauseMs - 1));
          const granted = started.length;
          const refunded = started[c.refund % Math.max(1, granted)];
          await refunded?.ticket.refund();
          admit();
          await clock.advance(1000);
          // Every call that started after the pause (the last one at least) started after it ended.
          expect(started.length).toBe(c.calls + 1);
          for (const s of started.slice(before)) expect(s.at).toBeGreaterThanOrEqual(until);
        }),
        RUNS,
      );
    });
  });
});
