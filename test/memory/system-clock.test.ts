import { AdmitTimeoutError, memory } from "floodgate";
import { afterEach, describe, expect, it, vi } from "vitest";

describe("the default clock", () => {
  afterEach(() => {
    vi.useRealTimers();
  });

  it("follows fake timers installed after the library was imported", async () => {
    vi.useFakeTimers();
    const sem = memory().semaphore("fake-timers", { limit: 1 });
    await sem.admit();
    let error: unknown;
    const waiting = sem.admit({ timeoutMs: 60_000 }).catch((e) => {
      error = e;
    });
    await vi.advanceTimersByTimeAsync(59_999);
    expect(error).toBeUndefined();
    await vi.advanceTimersByTimeAsync(1);
    await waiting;
    expect(error).toBeInstanceOf(AdmitTimeoutError);
  });
});
