import { InvalidOptionsError } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { backends, track, useBackend } from "./backends.js";

describe.each(backends)("AIMD limiter on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock();
  });

  it("starts at the initial limit and makes the next caller wait", async () => {
    const aimd = backend.make(clock).aimd("ai", { initial: 2, max: 10 });
    await aimd.admit();
    await aimd.admit();
    const third = track(aimd.admit());
    await clock.flush();
    expect(third.settled).toBe(false);
    expect(aimd.snapshot().limit).toBe(2);
  });

  it("cuts the limit by the backoff ratio on a drop", async () => {
    const aimd = backend.make(clock).aimd("ai", { initial: 10, max: 10, backoffRatio: 0.5 });
    await (await aimd.admit()).release("dropped");
    expect(aimd.snapshot().limit).toBe(5);
  });

  it("cuts at most once for a window of drops from calls admitted together", async () => {
    const aimd = backend.make(clock).aimd("ai", { initial: 8, max: 8, backoffRatio: 0.5 });
    const tickets = await Promise.all([aimd.admit(), aimd.admit(), aimd.admit()]);
    for (const t of tickets) await t.release("dropped");
    expect(aimd.snapshot().limit).toBe(4);
    // A call admitted after the cut can cut again.
    await (await aimd.admit()).release("dropped");
    expect(aimd.snapshot().limit).toBe(2);
  });

  it("adds one on success only while at least half the limit is in use", async () => {
    const aimd = backend.make(clock).aimd("ai", { initial: 4, max: 10 });
    await (await aimd.admit()).release("success"); // 1 of 4 in use: no growth
    expect(aimd.snapshot().limit).toBe(4);
    const held = await aimd.admit();
    await (await aimd.admit()).release("success"); // 2 of 4 in use: grows
    expect(aimd.snapshot().limit).toBe(5);
    await held.release("ignored");
    expect(aimd.snapshot().limit).toBe(5);
  });

  it("stays within [min, max]", async () => {
    const aimd = backend.make(clock).aimd("ai", { initial: 2, min: 2, max: 3, backoffRatio: 0.5 });
    await (await aimd.admit()).release("dropped");
    expect(aimd.snapshot().limit).toBe(2);
    for (let i = 0; i < 5; i++) {
      const a = await aimd.admit();
      const b = await aimd.admit();
      await b.release("success");
      await a.release("success");
    }
    expect(aimd.snapshot().limit).toBe(3);
  });

  it("counts a success slower than slowCallMs as a drop", async () => {
    const aimd = backend
      .make(clock)
      .aimd("ai", { initial: 10, max: 10, backoffRatio: 0.5, slowCallMs: 1000 });
    const t = await aimd.admit();
    await clock.advance(1001);
    await t.release("success");
    expect(aimd.snapshot().limit).toBe(5);
  });

  it("learns nothing from ignored outcomes or refunds", async () => {
    const aimd = backend.make(clock).aimd("ai", { initial: 4, max: 10 });
    const a = await aimd.admit();
    const b = await aimd.admit();
    await a.release("ignored");
    await b.refund();
    expect(aimd.snapshot().limit).toBe(4);
  });

  it("wakes waiters when the limit grows", async () => {
    const aimd = backend.make(clock).aimd("ai", { initial: 2, max: 4 });
    const a = await aimd.admit();
    const b = await aimd.admit();
    const c = track(aimd.admit());
    const d = track(aimd.admit());
    const e = track(aimd.admit());
    await b.release("success"); // 2 of 2 in use: the limit grows to 3, one held, two may go
    await clock.flush();
    expect(aimd.snapshot().limit).toBe(3);
    expect([c.settled, d.settled, e.settled]).toEqual([true, true, false]);
    await a.release("success"); // 3 of 3 in use: the limit grows to 4
    await clock.flush();
    expect(aimd.snapshot().limit).toBe(4);
    expect(e.settled).toBe(true);
  });

  it("refuses a cost above min at once", async () => {
    const aimd = backend.make(clock).aimd("ai", { initial: 4, min: 1, max: 10 });
    const error = await aimd.admit({ cost: 2 }).catch((e) => e);
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect(error.field).toBe("cost");
  });

  it("refuses bad options with the stage, field, rule and value", () => {
    const b = backend.make(clock);
    expect(() => b.aimd("ai", { initial: 5, max: 4 })).toThrow(
      'aimd "ai": initial must be in [min, max], got 5 (number)',
    );
    expect(() => b.aimd("ai", { initial: 2, min: 3, max: 2 })).toThrow("max must be >= min, got 2 (number)");
    expect(() => b.aimd("ai", { initial: 2, max: 4, backoffRatio: 0.4 })).toThrow(
      "backoffRatio must be a number in [0.5, 1), got 0.4 (number)",
    );
    expect(() => b.aimd("ai", { initial: 2, max: 4, backoffRatio: 1 })).toThrow(
      "backoffRatio must be a number in [0.5, 1), got 1 (number)",
    );
  });
});
