import {
  DrainingError,
  Gate,
  InvalidOptionsError,
  isFloodgateError,
  type Stage,
  type Ticket,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { backends, track, useBackend } from "./backends.js";

/**
 * `drain()`: refuse new calls at once, reject (or admit) the waiting ones, give the calls in
 * flight a grace, then abort and release the rest and close. Alike on every backend.
 */
describe.each(backends)("drain on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock(1_000);
  });

  /** Every stage kind of the backend, each with room for two calls of cost 1. */
  function kinds(b = backend.make(clock)): Record<string, Stage> {
    return {
      semaphore: b.semaphore("sem", { limit: 2 }),
      aimd: b.aimd("aimd", { initial: 2, max: 2 }),
      queue: b.queue("queue", { maxSize: 2 }),
      tokenBucket: b.tokenBucket("bucket", { capacity: 2, refillPerSecond: 0.001 }),
      intervalGate: b.intervalGate("hosts", { minIntervalMs: 60_000, defaultHost: "api" }),
    };
  }

  /** Two calls of `stage` in flight (the interval gate: one), and one waiting. */
  async function busy(stage: Stage) {
    const held = [await stage.admit()];
    if (stage.kind !== "intervalGate") held.push(await stage.admit());
    const waiting = track(stage.admit());
    await clock.flush();
    expect(waiting.settled).toBe(false);
    return { held, waiting };
  }

  it.each(["semaphore", "aimd", "queue", "tokenBucket", "intervalGate"])(
    "%s: refuses new calls at once, rejects the waiting ones, and resolves once the calls in flight release",
    async (kind) => {
      const stage = kinds()[kind]!;
      const { held, waiting } = await busy(stage);
      const drained = track(stage.drain!({ graceMs: 5_000 }));
      await clock.flush();
      expect(waiting.error).toBeInstanceOf(DrainingError);
      for (const call of [stage.admit(), stage.tryAdmit(), stage.run!(() => 1)]) {
        const error = await call.then(
          () => undefined,
          (e: unknown) => e,
        );
        expect(isFloodgateError(error, "DRAINING")).toBe(true);
        expect((error as Error).message).toMatch(/is draining/);
      }
      await clock.advance(1_000);
      for (const t of held) await t.release("success");
      await clock.flush();
      expect(drained.settled).toBe(true);
      expect(drained.value).toEqual({ completed: held.length, aborted: 0, rejected: 1, tookMs: 1_000 });
      expect(stage.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
      // Drained means closed.
      await expect(stage.admit()).rejects.toMatchObject({ code: "CLOSED" });
    },
  );

  it("with waiting: admit, lets the waiting calls through as room frees, within the grace", async () => {
    const { semaphore: sem } = kinds();
    const { held, waiting } = await busy(sem!);
    const drained = track(sem!.drain!({ graceMs: 5_000, waiting: "admit" }));
    await clock.flush();
    expect(waiting.settled).toBe(false);
    await expect(sem!.admit()).rejects.toBeInstanceOf(DrainingError);
    await held[0]!.release("success");
    await clock.flush();
    expect(waiting.settled).toBe(true);
    const late = waiting.value as Ticket;
    await held[1]!.release("success");
    await clock.advance(100);
    expect(drained.settled).toBe(false);
    await late.release("success");
    await clock.flush();
    expect(drained.value).toEqual({ completed: 3, aborted: 0, rejected: 0, tookMs: 100 });
  });

  it("aborts the calls still in flight when the grace runs out, through their signal, and releases them", async () => {
    const { semaphore: sem } = kinds();
    const t = await sem!.admit();
    const signal = t.signal;
    const drained = track(sem!.drain!({ graceMs: 2_000 }));
    await clock.advance(1_999);
    expect(signal.aborted).toBe(false);
    expect(drained.settled).toBe(false);
    await clock.advance(1);
    await clock.flush();
    expect(signal.aborted).toBe(true);
    expect(signal.reason).toBeInstanceOf(DrainingError);
    expect((signal.reason as Error).message).toMatch(/grace of 2000 ms ran out/);
    expect(drained.value).toEqual({ completed: 0, aborted: 1, rejected: 0, tookMs: 2_000 });
    expect(sem!.snapshot().inFlight).toBe(0);
    // The caller's own release, late, gives back nothing more.
    await t.release("success");
    expect(sem!.snapshot().inFlight).toBe(0);
  });

  it("drains a gate: its waiting calls rejected, its calls in flight given the grace, every stage closed", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("sem", { limit: 1 });
    const bucket = b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 });
    const gate = new Gate([b.queue("jobs", { maxSize: 5 }), sem, bucket], { clock });
    const first = await gate.admit();
    const waiting = track(gate.admit());
    await clock.flush();
    const drained = track(gate.drain({ graceMs: 3_000 }));
    await clock.flush();
    expect(waiting.error).toBeInstanceOf(DrainingError);
    await expect(gate.run(async () => 1)).rejects.toBeInstanceOf(DrainingError);
    await clock.advance(500);
    await first.release("success");
    await clock.flush();
    expect(drained.value).toEqual({ completed: 1, aborted: 0, rejected: 1, tookMs: 500 });
    expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    for (const stage of gate.stages) await expect(stage.admit()).rejects.toMatchObject({ code: "CLOSED" });
  });

  it("drains a gate whose call outlives the grace: its signal aborts, every stage's ticket is released", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("sem", { limit: 2 });
    const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 })], { clock });
    const seen: unknown[] = [];
    const call = gate.run(
      (ticket) =>
        new Promise((_, reject) => {
          ticket.signal.addEventListener("abort", () => {
            seen.push(ticket.signal.reason);
            reject(ticket.signal.reason);
          });
        }),
    );
    const outcome = track(call);
    await clock.flush();
    const drained = track(gate.drain({ graceMs: 1_000 }));
    await clock.advance(1_000);
    await clock.flush();
    expect(seen).toHaveLength(1);
    expect(seen[0]).toBeInstanceOf(DrainingError);
    expect(outcome.error).toBeInstanceOf(DrainingError);
    expect(drained.value).toEqual({ completed: 0, aborted: 1, rejected: 0, tookMs: 1_000 });
    expect(sem.snapshot().inFlight).toBe(0);
    expect(gate.snapshot().inFlight).toBe(0);
  });

  it("with waiting: admit, lets a gate's waiting calls through, and rejects those still waiting when the grace ends", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("sem", { limit: 1 });
    const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 })], { clock });
    const first = await gate.admit();
    const second = track(gate.admit());
    const third = track(gate.admit());
    await clock.flush();
    const drained = track(gate.drain({ graceMs: 1_000, waiting: "admit" }));
    await clock.advance(100);
    await first.release("success");
    await clock.flush();
    expect(second.settled).toBe(true);
    expect(third.settled).toBe(false);
    await clock.advance(900);
    await clock.flush();
    expect(third.error).toBeInstanceOf(DrainingError);
    expect(drained.value).toMatchObject({ completed: 1, aborted: 1, rejected: 1 });
    expect(sem.snapshot().inFlight).toBe(0);
  });

  it("answers a second drain with the same promise, and a closed stage with nothing to do", async () => {
    const { semaphore: sem, tokenBucket: bucket } = kinds();
    const one = sem!.drain!();
    expect(sem!.drain!()).toBe(one);
    await expect(one).resolves.toEqual({ completed: 0, aborted: 0, rejected: 0, tookMs: 0 });
    await bucket!.close();
    await expect(bucket!.drain!()).resolves.toEqual({ completed: 0, aborted: 0, rejected: 0, tookMs: 0 });
  });

  it("refuses bad options with an error naming the field, and stays open", async () => {
    const { semaphore: sem } = kinds();
    const gate = new Gate([sem!, backend.make(clock).tokenBucket("r", { capacity: 1, refillPerSecond: 1 })], {
      clock,
    });
    for (const [options, field] of [
      [{ graceMs: -1 }, "graceMs"],
      [{ graceMs: Number.NaN }, "graceMs"],
      [{ graceMs: "5" }, "graceMs"],
      [{ waiting: "drop" }, "waiting"],
      [{ grace: 5 }, "grace"],
    ] as const) {
      for (const target of [sem!, gate]) {
        const error = await target.drain!(options as never).catch((e: unknown) => e);
        expect(error).toBeInstanceOf(InvalidOptionsError);
        expect((error as InvalidOptionsError).field).toBe(field);
      }
    }
    const t = await gate.admit();
    await t.release("success");
  });
});
