/**
 * One abort listener per signal for an owner's waits (src/base/signal-waits.ts): each wait told
 * once, in order; one taken away meanwhile not told; one that begins meanwhile told; a signal
 * that throws from removeEventListener left with a listener that finds no wait.
 */
import { getEventListeners } from "node:events";
import { describe, expect, it } from "vitest";
import { SignalWaits } from "../../src/base/signal-waits.js";

describe("SignalWaits", () => {
  it("tells each wait once, in order, through one listener, and drops it with the last wait", () => {
    const waits = new SignalWaits();
    const controller = new AbortController();
    const told: string[] = [];
    const a = () => told.push("a");
    const b = { handleEvent: () => told.push("b") };
    const c = () => told.push("c");
    waits.add(controller.signal, a);
    waits.add(controller.signal, b);
    waits.add(controller.signal, c);
    expect(getEventListeners(controller.signal, "abort")).toHaveLength(1);
    waits.remove(controller.signal, b);
    expect(getEventListeners(controller.signal, "abort")).toHaveLength(1);
    controller.abort();
    expect(told).toEqual(["a", "c"]);
    expect(getEventListeners(controller.signal, "abort")).toHaveLength(0);
    const other = new AbortController();
    waits.add(other.signal, a);
    waits.remove(other.signal, a);
    waits.remove(other.signal, a);
    expect(getEventListeners(other.signal, "abort")).toHaveLength(0);
  });

  it("does not tell a wait an earlier one's end took away, and tells one that began meanwhile", () => {
    const waits = new SignalWaits();
    const controller = new AbortController();
    const told: string[] = [];
    const late = () => told.push("late");
    const second = () => told.push("second");
    const first = () => {
      told.push("first");
      waits.remove(controller.signal, second);
      waits.add(controller.signal, late);
    };
    waits.add(controller.signal, first);
    waits.add(controller.signal, second);
    controller.abort();
    expect(told).toEqual(["first", "late"]);
    // (A signal aborted already is not listened to again: its waits are checked before.)
    const after = new AbortController();
    waits.add(after.signal, () => told.push("after"));
    after.abort();
    expect(told).toEqual(["first", "late", "after"]);
  });

  it("keeps going when a signal's listener methods throw", () => {
    const waits = new SignalWaits();
    const throwsOnAdd = {
      aborted: false,
      addEventListener() {
        throw new Error("no listening here");
      },
      removeEventListener() {},
    } as unknown as AbortSignal;
    expect(() => waits.add(throwsOnAdd, () => {})).toThrow("no listening here");
    const target = new EventTarget();
    const throwsOnRemove = Object.assign(target, {
      aborted: false,
      removeEventListener() {
        throw new Error("cannot let go");
      },
    }) as unknown as AbortSignal;
    const told: string[] = [];
    const w = () => told.push("w");
    waits.add(throwsOnRemove, w);
    expect(() => waits.remove(throwsOnRemove, w)).not.toThrow();
    target.dispatchEvent(new Event("abort"));
    expect(told).toEqual([]);
  });
});
