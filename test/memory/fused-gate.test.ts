import fc from "fast-check";
import {
  AdmitTimeoutError,
  ClosedError,
  Gate,
  InvalidOptionsError,
  type MemoryBackend,
  memory,
  type Stage,
  type Ticket,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";

/**
 * A Gate of memory stages decides an admission all or nothing, at one instant, and a call it
 * refuses waits holding nothing, in the gate's lines (src/memory/fused-gate.ts), as a fused
 * Redis gate's callers wait in Redis.
 */
describe("a fused memory gate", () => {
  /** A settled-or-not view of a promise, for asserting without awaiting. */
  function track<T>(promise: Promise<T>): {
    settled: boolean;
    value?: T;
    error?: unknown;
    promise: Promise<T>;
  } {
    const t: { settled: boolean; value?: T; error?: unknown; promise: Promise<T> } = {
      settled: false,
      promise,
    };
    promise.then(
      (value) => {
        t.settled = true;
        t.value = value;
      },
      (error) => {
        t.settled = true;
        t.error = error;
      },
    );
    return t;
  }

  it("is fused for two or more memory stages on one clock without classes, and chained otherwise", () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const sem = m.semaphore("s", { limit: 2 });
    const bucket = m.tokenBucket("t", { capacity: 2, refillPerSecond: 1 });
    expect(new Gate([sem, bucket]).fused).toBe(true);
    expect(new Gate([m.queue("q", { maxSize: 4 }), sem, bucket]).fused).toBe(true);
    expect(
      new Gate([m.aimd("a", { initial: 2, max: 4 }), m.intervalGate("h", { minIntervalMs: 5 }), sem]).fused,
    ).toBe(true);
    expect(new Gate([sem]).fused).toBe(false);
    expect(new Gate([sem, bucket], { fuse: false }).fused).toBe(false);
    // Another clock: its stages wait on other timers.
    expect(new Gate([memory({ clock: new FakeClock() }).semaphore("o", { limit: 1 }), bucket]).fused).toBe(
      false,
    );
    const classes = { interactive: { share: 0.5 }, bulk: { share: 0.5 } };
    expect(new Gate([m.semaphore("c", { limit: 2, classes }), bucket]).fused).toBe(false);
    expect(new Gate([sem, bucket, sem]).fused).toBe(false);
    expect(new Gate([new Gate([sem, bucket]), m.semaphore("s2", { limit: 1 })]).fused).toBe(false);
  });

  it("admits with room before run returns, taking every stage, and gives them all back", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const bucket = m.tokenBucket("rate", { capacity: 3, refillPerSecond: 1 });
    const sem = m.semaphore("sem", { limit: 1 });
    const gate = new Gate([bucket, sem], { clock });
    let during: unknown;
    const call = gate.run(() => {
      during = [bucket.tokens(), sem.snapshot().inFlight];
      return "ran";
    });
    expect(during).toEqual([2, 1]);
    expect(await call).toBe("ran");
    expect(sem.snapshot().inFlight).toBe(0);
  });

  it("holds no token while it waits for a permit, and no permit while it waits for a token", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const bucket = m.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 });
    const sem = m.semaphore("sem", { limit: 2 });
    const gate = new Gate([bucket, sem], { clock });
    const busy = [await sem.admit(), await sem.admit()];
    const forPermit = track(gate.admit());
    await clock.advance(10);
    expect(forPermit.settled).toBe(false);
    expect(bucket.tokens()).toBe(1);
    await busy[0]!.release();
    const first = await forPermit.promise;
    expect(bucket.tokens()).toBe(0);
    // Now the bucket is empty: the next call waits for a token, holding no permit.
    const forToken = track(gate.admit());
    await clock.advance(500);
    expect(forToken.settled).toBe(false);
    expect(sem.snapshot().inFlight).toBe(2);
    await busy[1]!.release();
    expect(sem.snapshot().inFlight).toBe(1);
    await clock.advance(500);
    const second = await forToken.promise;
    expect(sem.snapshot().inFlight).toBe(2);
    await first.release();
    await second.release();
    expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0, admitted: 2 });
  });

  it("serves the permit line first in, first out: a large cost at its head is not passed by small ones", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const sem = m.semaphore("sem", { limit: 3 });
    const gate = new Gate([sem, m.tokenBucket("rate", { capacity: 100, refillPerSecond: 100 })], { clock });
    const held = [await gate.admit(), await gate.admit()];
    const order: string[] = [];
    const inOrder = (name: string) => (t: Ticket) => {
      order.push(name);
      return t;
    };
    const big = gate.admit({ cost: 3 }).then(inOrder("big"));
    const small = gate.admit({ cost: 1 }).then(inOrder("small"));
    await clock.flush();
    // One permit is free, but the big call is first: the small one waits behind it.
    expect(order).toEqual([]);
    expect(sem.snapshot().inFlight).toBe(2);
    for (const t of held) await t.release();
    await clock.flush();
    expect(order).toEqual(["big"]);
    await (await big).release();
    await (await small).release();
    expect(order).toEqual(["big", "small"]);
  });

  it("keeps one lane per host: a paused host holds up its own calls, not the others'", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const hosts = m.intervalGate("hosts", { minIntervalMs: 100 });
    const gate = new Gate([m.semaphore("sem", { limit: 10 }), hosts], { clock });
    await gate.pause("slow.example", 1_000);
    const slow = [track(gate.admit({ host: "slow.example" })), track(gate.admit({ host: "slow.example" }))];
    const fast = track(gate.admit({ host: "fast.example" }));
    await clock.flush();
    expect(fast.settled).toBe(true);
    expect(slow.map((s) => s.settled)).toEqual([false, false]);
    await clock.advance(1_000);
    expect(slow.map((s) => s.settled)).toEqual([true, false]);
    await clock.advance(100);
    expect(slow.map((s) => s.settled)).toEqual([true, true]);
    for (const t of [...slow, fast]) await ((await t.promise) as Ticket).release();
    expect(gate.snapshot()).toMatchObject({ waiting: 0, admitted: 3 });
  });

  it("lets the head of the permit line that only a rate refuses step aside, keeping its arrival", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const sem = m.semaphore("sem", { limit: 1 });
    const hosts = m.intervalGate("hosts", { minIntervalMs: 1_000 });
    const gate = new Gate([sem, hosts], { clock });
    const a = await gate.admit({ host: "a" });
    const a2 = track(gate.admit({ host: "a" }));
    const b = track(gate.admit({ host: "b" }));
    await clock.flush();
    // Both wait for the permit, in arrival order.
    expect([a2.settled, b.settled]).toEqual([false, false]);
    await a.release();
    await clock.flush();
    // The permit is free, but host a's next slot is 1 s away: b goes first.
    expect([a2.settled, b.settled]).toEqual([false, true]);
    await ((await b.promise) as Ticket).release();
    await clock.advance(1_000);
    expect(a2.settled).toBe(true);
    await ((await a2.promise) as Ticket).release();
    expect(sem.snapshot().inFlight).toBe(0);
  });

  it("counts a wait at the stage that refused the call", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const sem = m.semaphore("sem", { limit: 2 });
    const bucket = m.tokenBucket("rate", { capacity: 1, refillPerSecond: 10 });
    const gate = new Gate([bucket, sem], { clock });
    const held = [await sem.admit(), await sem.admit()];
    const waiting = gate.admit();
    await clock.advance(40);
    await held[0]!.release();
    const first = await waiting;
    await held[1]!.release();
    // The token went to the first call: the second waits 100 ms for the next one.
    const second = gate.admit();
    await clock.advance(100);
    await first.release();
    await (await second).release();
    expect(sem.snapshot().permitWaitMs).toBe(40);
    expect(bucket.snapshot().tokenWaitMs).toBe(100);
    expect(gate.snapshot()).toMatchObject({ permitWaitMs: 40, tokenWaitMs: 100 });
  });

  it("takes a caller out of line on timeout and abort, and the next goes on", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const sem = m.semaphore("sem", { limit: 2 });
    const gate = new Gate([sem, m.tokenBucket("rate", { capacity: 10, refillPerSecond: 10 })], { clock });
    const held = [await gate.admit(), await gate.admit()];
    const big = track(gate.admit({ cost: 2, timeoutMs: 50 }));
    const controller = new AbortController();
    const aborted = track(gate.admit({ signal: controller.signal }));
    const last = track(gate.admit());
    await clock.advance(50);
    expect(big.error).toBeInstanceOf(AdmitTimeoutError);
    expect((big.error as Error).message).toBe(
      'gate "gate": not admitted within timeoutMs (50); it waited for semaphore "sem"',
    );
    controller.abort(new Error("no longer needed"));
    await clock.flush();
    expect((aborted.error as Error).message).toBe("no longer needed");
    await held[0]!.release();
    await clock.flush();
    expect(last.settled).toBe(true);
    await held[1]!.release();
    await ((await last.promise) as Ticket).release();
    expect(gate.snapshot()).toMatchObject({ waiting: 0, inFlight: 0, timedOut: 1, aborted: 1, admitted: 3 });
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
  });

  it("only tries with timeoutMs: 0 or tryAdmit, never passing anyone in line", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const sem = m.semaphore("sem", { limit: 2 });
    const gate = new Gate([sem, m.tokenBucket("rate", { capacity: 10, refillPerSecond: 10 })], { clock });
    const held = [await gate.admit(), await gate.admit({ cost: 1 })];
    const big = track(gate.admit({ cost: 2 }));
    await held[0]!.release();
    await clock.flush();
    // One permit is free, but the big call waits first.
    expect(await gate.tryAdmit()).toBe(undefined);
    await expect(gate.admit({ timeoutMs: 0 })).rejects.toBeInstanceOf(AdmitTimeoutError);
    await held[1]!.release();
    await ((await big.promise) as Ticket).release();
    const t = await gate.tryAdmit();
    expect(t).toBeDefined();
    await t!.release();
  });

  it("rejects its waiters when a stage or the gate closes", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const sem = m.semaphore("sem", { limit: 1 });
    const bucket = m.tokenBucket("rate", { capacity: 1, refillPerSecond: 0.001 });
    const gate = new Gate([sem, bucket], { clock });
    const held = await gate.admit();
    const forPermit = track(gate.admit());
    await held.release();
    const forToken = track(gate.admit());
    await clock.flush();
    expect([forPermit.settled, forToken.settled]).toEqual([false, false]);
    await bucket.close();
    await clock.flush();
    expect(forPermit.error).toBeInstanceOf(ClosedError);
    expect(forToken.error).toBeInstanceOf(ClosedError);
    await expect(gate.admit()).rejects.toBeInstanceOf(ClosedError);

    const m2 = memory({ clock });
    const gate2 = new Gate(
      [m2.semaphore("sem", { limit: 1 }), m2.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 })],
      {
        clock,
      },
    );
    const first = await gate2.admit();
    const waiting = track(gate2.admit());
    await gate2.close();
    await clock.flush();
    expect(waiting.error).toBeInstanceOf(ClosedError);
    await first.release();
  });

  it("refuses a signal it cannot listen to with an error naming it, holding nothing", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const sem = m.semaphore("sem", { limit: 1 });
    const gate = new Gate([sem, m.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 })], { clock });
    const held = await gate.admit();
    const boom = () => {
      throw new Error("boom");
    };
    const signal = {
      aborted: false,
      addEventListener: boom,
      removeEventListener: boom,
    } as unknown as AbortSignal;
    const error = await gate.admit({ signal }).catch((e) => e);
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect(error.field).toBe("signal");
    await held.release();
    expect(gate.snapshot()).toMatchObject({ waiting: 0, inFlight: 0 });
    expect(sem.snapshot().inFlight).toBe(0);
  });

  it("leaves nothing behind after a crowd: every caller admitted once, the cap held throughout", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const sem = m.semaphore("sem", { limit: 3 });
    const aimd = m.aimd("aimd", { initial: 4, max: 4 });
    const bucket = m.tokenBucket("rate", { capacity: 5, refillPerSecond: 50, keyed: true });
    const hosts = m.intervalGate("hosts", { minIntervalMs: 5 });
    const gate = new Gate([bucket, hosts, aimd, sem], { clock });
    let running = 0;
    let peak = 0;
    const calls = Array.from({ length: 60 }, (_, i) =>
      gate.run(
        async () => {
          running++;
          peak = Math.max(peak, running);
          await new Promise<void>((resolve) => clock.setTimeout(resolve, 7 + (i % 5)));
          running--;
          return i;
        },
        { key: `k${i % 3}`, host: `h${i % 2}`, costs: { rate: 1 + (i % 2) } },
      ),
    );
    for (let n = 0; n < 2_000 && running + gate.snapshot().waiting > 0; n++) await clock.advance(1);
    expect((await Promise.all(calls)).length).toBe(60);
    expect(peak).toBeLessThanOrEqual(3);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0, admitted: 60 });
  });

  /**
   * The stages a case uses, built twice on one clock: once for the fused gate, once to be taken
   * one after another with a refusal rolling back what was taken.
   */
  function stagesOf(m: MemoryBackend): Stage[] {
    return [
      m.tokenBucket("rpm", { capacity: 3, refillPerSecond: 10, keyed: true }),
      m.semaphore("sem", { limit: 3 }),
      m.intervalGate("hosts", { minIntervalMs: 20, jitterMs: 0 }),
      m.aimd("aimd", { initial: 2, max: 6 }),
      m.tokenBucket("tpm", { capacity: 10, refillPerSecond: 40 }),
    ];
  }

  type Op =
    | { op: "try"; key: string; host: string; costs: Record<string, number> }
    | { op: "release"; pick: number; outcome: "success" | "dropped" }
    | { op: "wait"; ms: number }
    | { op: "occupy"; at: 1 | 3 };

  const opArb: fc.Arbitrary<Op> = fc.oneof(
    {
      weight: 5,
      arbitrary: fc.record({
        op: fc.constant("try" as const),
        key: fc.constantFrom("a", "b"),
        host: fc.constantFrom("x", "y"),
        costs: fc.record({ rpm: fc.integer({ min: 0, max: 3 }), tpm: fc.integer({ min: 1, max: 6 }) }),
      }),
    },
    {
      weight: 2,
      arbitrary: fc.record({
        op: fc.constant("release" as const),
        pick: fc.nat(),
        // No refund here: a call taken in turn and rolled back refunds its bucket's latest grant,
        // so an earlier ticket's refund gives nothing back there (a fused refusal leaves it
        // refundable: see the test below).
        outcome: fc.constantFrom("success" as const, "dropped" as const),
      }),
    },
    {
      weight: 2,
      arbitrary: fc.record({ op: fc.constant("wait" as const), ms: fc.integer({ min: 0, max: 60 }) }),
    },
    // A permit taken outside the gate, at the semaphore or the AIMD limiter: a direct caller.
    {
      weight: 1,
      arbitrary: fc.record({
        op: fc.constant("occupy" as const),
        at: fc.constantFrom(1 as const, 3 as const),
      }),
    },
  );

  it("decides as the stages taken in turn at that instant, all rolled back on the first refusal", async () => {
    // How often each stage was the first to refuse, taken in turn: every one must have been.
    const refusedAt = new Map<string, number>();
    await fc.assert(
      fc.asyncProperty(fc.array(opArb, { minLength: 1, maxLength: 100 }), async (ops) => {
        const clock = new FakeClock();
        const fusedStages = stagesOf(memory({ clock }));
        const turnStages = stagesOf(memory({ clock }));
        const gate = new Gate(fusedStages, { clock });
        expect(gate.fused).toBe(true);
        const fusedHeld: Ticket[] = [];
        const turnHeld: Ticket[][] = [];
        for (const op of ops) {
          if (op.op === "wait") {
            await clock.advance(op.ms);
          } else if (op.op === "occupy") {
            const f = await fusedStages[op.at]!.tryAdmit();
            const t = await turnStages[op.at]!.tryAdmit();
            expect(f !== undefined).toBe(t !== undefined);
            if (f && t) {
              fusedHeld.push(f);
              turnHeld.push([t]);
            }
          } else if (op.op === "try") {
            const o = { key: op.key, host: op.host, costs: op.costs };
            const fused = await gate.tryAdmit(o);
            // In turn: each stage's tryAdmit, and a refusal refunds what was taken.
            const taken: Ticket[] = [];
            for (const stage of turnStages) {
              const cost = (op.costs as Record<string, number>)[stage.name] ?? 1;
              const t = await stage.tryAdmit({
                cost,
                ...(stage.keyedBy === "key" ? { key: op.key } : {}),
                host: op.host,
              });
              if (t === undefined) {
                refusedAt.set(stage.name, (refusedAt.get(stage.name) ?? 0) + 1);
                break;
              }
              taken.push(t);
            }
            const all = taken.length === turnStages.length;
            if (!all) for (const t of taken.reverse()) await t.refund();
            expect(fused !== undefined).toBe(all);
            if (fused) {
              fusedHeld.push(fused);
              turnHeld.push(taken);
            }
          } else if (fusedHeld.length > 0) {
            const i = op.pick % fusedHeld.length;
            const [f] = fusedHeld.splice(i, 1);
            const [t] = turnHeld.splice(i, 1);
            await f!.release(op.outcome);
            for (const x of [...t!].reverse()) await x.release(op.outcome);
          }
          // The same state on both sides: permits held, tokens per key, each host's next slot.
          const [rpm, sem, hosts, aimd, tpm] = fusedStages as [any, any, any, any, any];
          const [rpm2, sem2, hosts2, aimd2, tpm2] = turnStages as [any, any, any, any, any];
          expect(sem.snapshot().inFlight).toBe(sem2.snapshot().inFlight);
          expect(aimd.snapshot()).toMatchObject({
            inFlight: aimd2.snapshot().inFlight,
            limit: aimd2.snapshot().limit,
          });
          for (const key of ["a", "b"]) expect(rpm.tokens(key)).toBeCloseTo(rpm2.tokens(key), 6);
          expect(tpm.tokens()).toBeCloseTo(tpm2.tokens(), 6);
          for (const host of ["x", "y"]) expect(hosts.delayFor(host)).toBe(hosts2.delayFor(host));
        }
      }),
      { numRuns: 150 },
    );
    expect([...refusedAt.keys()].sort()).toEqual(["aimd", "hosts", "rpm", "sem", "tpm"]);
  });

  it("leaves a refused call's stages untouched: the latest grant before it can still be refunded", async () => {
    const clock = new FakeClock();
    const m = memory({ clock });
    const bucket = m.tokenBucket("rate", { capacity: 4, refillPerSecond: 1 });
    const hosts = m.intervalGate("hosts", { minIntervalMs: 1_000 });
    const gate = new Gate([bucket, hosts], { clock });
    const first = await gate.admit({ host: "x" });
    expect(bucket.tokens()).toBe(3);
    // Refused by the interval gate: the bucket is never touched.
    expect(await gate.tryAdmit({ host: "x" })).toBe(undefined);
    expect(bucket.tokens()).toBe(3);
    await first.refund();
    expect(bucket.tokens()).toBe(4);
    expect(hosts.delayFor("x")).toBe(0);
  });
});
