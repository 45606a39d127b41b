import { InvalidOptionsError } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { backends, track, useBackend } from "./backends.js";

describe.each(backends)("interval gate on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock();
  });

  it("spaces the starts of calls to one host by minIntervalMs", async () => {
    const gate = backend.make(clock).intervalGate("hosts", { minIntervalMs: 1500 });
    const starts: number[] = [];
    const calls = Array.from({ length: 4 }, () =>
      gate.admit({ host: "a.test" }).then((t) => {
        starts.push(clock.now());
        return t.release("success");
      }),
    );
    await clock.advance(10_000);
    await Promise.all(calls);
    expect(starts).toEqual([0, 1500, 3000, 4500]);
    expect(gate.snapshot().tokenWaitMs).toBe(1500 + 3000 + 4500);
  });

  it("adds jitter on top of the minimum, never below it", async () => {
    const randoms = [0, 0.5, 0.999];
    const gate = backend
      .make(clock, () => randoms.shift() ?? 0)
      .intervalGate("hosts", {
        minIntervalMs: 1000,
        jitterMs: 400,
      });
    const starts: number[] = [];
    const calls = Array.from({ length: 4 }, () =>
      gate.admit({ host: "a" }).then(() => starts.push(clock.now())),
    );
    await clock.advance(10_000);
    await Promise.all(calls);
    expect(starts).toEqual([0, 1000, 2200, 3599.6]);
  });

  it("prefers a random given to the stage over the backend's", async () => {
    const gate = backend
      .make(clock, () => 0.9)
      .intervalGate("hosts", {
        minIntervalMs: 100,
        jitterMs: 100,
        random: () => 0.5,
        defaultHost: "api",
      });
    await gate.admit();
    const next = track(gate.admit());
    await clock.advance(149);
    expect(next.settled).toBe(false);
    await clock.advance(1);
    expect(next.settled).toBe(true);
  });

  it("spaces each host on its own", async () => {
    const gate = backend.make(clock).intervalGate("hosts", { minIntervalMs: 1000 });
    await gate.admit({ host: "a" });
    const b = track(gate.admit({ host: "b" }));
    const a = track(gate.admit({ host: "a" }));
    await clock.flush();
    expect(b.settled).toBe(true);
    expect(a.settled).toBe(false);
  });

  it("holds a paused host back for the whole pause, and never shortens it", async () => {
    const gate = backend.make(clock).intervalGate("hosts", { minIntervalMs: 100 });
    await gate.admit({ host: "a" });
    await gate.pause("a", 5000);
    await gate.pause("a", 1000); // shorter: no effect
    const next = track(gate.admit({ host: "a" }));
    await clock.advance(4999);
    expect(next.settled).toBe(false);
    await clock.advance(1);
    expect(next.settled).toBe(true);
  });

  it("lets every waiter of a gate that spaces nothing go, in order, the instant a pause ends", async () => {
    const gate = backend.make(clock).intervalGate("hosts", { minIntervalMs: 0 });
    await gate.pause("a", 1000);
    const order: number[] = [];
    const waits = Array.from({ length: 40 }, (_, i) =>
      gate.admit({ host: "a" }).then((t) => {
        order.push(i);
        expect(clock.now()).toBe(1000);
        return t.release("success");
      }),
    );
    await clock.advance(999);
    expect(order).toEqual([]);
    await clock.advance(1);
    await Promise.all(waits);
    expect(order).toEqual(Array.from({ length: 40 }, (_, i) => i));
  });

  it("pauses a host that has waiters already queued", async () => {
    const gate = backend.make(clock).intervalGate("hosts", { minIntervalMs: 100 });
    await gate.admit({ host: "a" });
    const queued = track(gate.admit({ host: "a" }));
    await clock.advance(50);
    await gate.pause("a", 2000);
    await clock.advance(1000);
    expect(queued.settled).toBe(false);
    await clock.advance(1050);
    expect(queued.settled).toBe(true);
  });

  it("hands a refunded slot back when no later call has taken one", async () => {
    const gate = backend.make(clock).intervalGate("hosts", { minIntervalMs: 1000 });
    const t = await gate.admit({ host: "a" });
    expect(await gate.tryAdmit({ host: "a" })).toBeUndefined(); // the slot is taken
    await t.refund();
    expect(t.released).toBe(true);
    const again = await gate.tryAdmit({ host: "a" });
    expect(again).toMatchObject({ stage: "hosts", cost: 1, released: false });
    // The slot is taken afresh at the same instant: the next call waits a whole interval from it.
    const next = track(gate.admit({ host: "a" }));
    await clock.advance(999);
    expect(next.settled).toBe(false);
    await clock.advance(1);
    expect(next.settled).toBe(true);
    expect(next.error).toBeUndefined();
    expect(gate.snapshot()).toMatchObject({ admitted: 3, inFlight: 2, tokenWaitMs: 1000 });
  });

  it("leaves nothing behind when a waiter aborts", async () => {
    const gate = backend.make(clock).intervalGate("hosts", { minIntervalMs: 1000 });
    await gate.admit({ host: "a" });
    const controller = new AbortController();
    const waiting = gate.admit({ host: "a", signal: controller.signal });
    controller.abort();
    await expect(waiting).rejects.toBe(controller.signal.reason);
    expect(gate.snapshot().waiting).toBe(0);
    const next = track(gate.admit({ host: "a" }));
    await clock.advance(1000);
    expect(next.settled).toBe(true);
  });

  it("refuses bad options and bad pauses, naming the field", async () => {
    const b = backend.make(clock);
    expect(() => b.intervalGate("h", { minIntervalMs: -1 })).toThrow(
      'intervalGate "h": minIntervalMs must be a finite number >= 0, got -1 (number)',
    );
    expect(() => b.intervalGate("h", { minIntervalMs: 1, jitterMs: Number.NaN })).toThrow(
      "jitterMs must be a finite number >= 0, got NaN (number)",
    );
    const gate = b.intervalGate("ok", { minIntervalMs: 1 });
    await expect(gate.pause("a", -5)).rejects.toBeInstanceOf(InvalidOptionsError);
    await expect(gate.pause("", 5)).rejects.toThrow("host must be a non-empty string");
  });
});
