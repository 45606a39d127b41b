import { type DrainResult, drainOnSignals, Gate, InvalidOptionsError, memory } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";

/** `drainOnSignals`: the signal handlers a worker installs to drain on SIGTERM and SIGINT. */
describe("drainOnSignals", () => {
  function gateOf(clock: FakeClock) {
    const m = memory({ clock });
    return new Gate(
      [m.semaphore("sem", { limit: 1 }), m.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 })],
      {
        clock,
      },
    );
  }

  it("drains every target on the first signal, hands over the summed result, and removes its handlers", async () => {
    const clock = new FakeClock();
    const one = gateOf(clock);
    const two = gateOf(clock);
    const held = await one.admit();
    const results: DrainResult[] = [];
    const before = process.listenerCount("SIGUSR2");
    const remove = drainOnSignals([one, two], {
      signals: ["SIGUSR2"],
      graceMs: 1_000,
      exit: false,
      onDrained: (r) => results.push(r),
    });
    expect(process.listenerCount("SIGUSR2")).toBe(before + 1);
    process.emit("SIGUSR2");
    // A second signal while draining does nothing more without `exit`.
    process.emit("SIGUSR2");
    await clock.advance(300);
    await held.release("success");
    await clock.flush();
    expect(results).toEqual([{ completed: 1, aborted: 0, rejected: 0, tookMs: 300 }]);
    await expect(one.admit()).rejects.toMatchObject({ code: "CLOSED" });
    await expect(two.admit()).rejects.toMatchObject({ code: "CLOSED" });
    remove();
    expect(process.listenerCount("SIGUSR2")).toBe(before);
  });

  it("refuses what is not a gate or stage, and bad options, naming the field, installing nothing", () => {
    const gate = gateOf(new FakeClock());
    const before = process.listenerCount("SIGTERM");
    for (const [call, field] of [
      [() => drainOnSignals(42 as never), "targets"],
      [() => drainOnSignals([gate, {} as never]), "targets.1"],
      [() => drainOnSignals(gate, { graceMs: -5 }), "graceMs"],
      [() => drainOnSignals(gate, { signals: "SIGTERM" as never }), "signals"],
      [() => drainOnSignals(gate, { exit: "yes" as never }), "exit"],
      [() => drainOnSignals(gate, { onDrained: 1 as never }), "onDrained"],
      [() => drainOnSignals(gate, { sigs: [] } as never), "sigs"],
    ] as const) {
      let error: unknown;
      try {
        call();
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect((error as InvalidOptionsError).field).toBe(field);
    }
    expect(process.listenerCount("SIGTERM")).toBe(before);
  });
});
