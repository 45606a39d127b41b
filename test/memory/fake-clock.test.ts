import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";

describe("FakeClock", () => {
  it("runs due timers in order of due time, then of creation", async () => {
    const clock = new FakeClock(1000);
    const fired: string[] = [];
    clock.setTimeout(() => fired.push(`b@${clock.now()}`), 20);
    clock.setTimeout(() => fired.push(`a@${clock.now()}`), 10);
    clock.setTimeout(() => fired.push(`c@${clock.now()}`), 20);
    clock.setTimeout(() => fired.push("late"), 31);
    await clock.advance(30);
    expect(fired).toEqual(["a@1010", "b@1020", "c@1020"]);
    expect(clock.now()).toBe(1030);
    expect(clock.pendingTimers).toBe(1);
  });

  it("lets promises settle between timers", async () => {
    const clock = new FakeClock();
    const seen: number[] = [];
    const sleep = (ms: number) => new Promise<void>((r) => clock.setTimeout(r, ms));
    const chain = (async () => {
      await sleep(10);
      seen.push(clock.now());
      await sleep(10); // scheduled by a continuation of the first timer
      seen.push(clock.now());
    })();
    await clock.advance(20);
    await chain;
    expect(seen).toEqual([10, 20]);
  });

  it("does not run cancelled timers", async () => {
    const clock = new FakeClock();
    let ran = false;
    const t = clock.setTimeout(() => {
      ran = true;
    }, 5);
    clock.clearTimeout(t);
    await clock.advance(10);
    expect(ran).toBe(false);
    expect(clock.pendingTimers).toBe(0);
  });

  it("runs every timer with runAll and stops a timer that reschedules for ever", async () => {
    const clock = new FakeClock();
    let count = 0;
    clock.setTimeout(() => count++, 100);
    clock.setTimeout(() => count++, 5000);
    await clock.runAll();
    expect(count).toBe(2);
    expect(clock.now()).toBe(5000);
    const forever = () => clock.setTimeout(forever, 1);
    forever();
    await expect(clock.runAll(50)).rejects.toThrow(/keeps rescheduling/);
  });

  it("refuses to go backwards", async () => {
    await expect(new FakeClock().advance(-1)).rejects.toThrow(RangeError);
  });
});
