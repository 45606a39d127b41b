import { AsyncLocalStorage } from "node:async_hooks";
import {
  AdmitTimeoutError,
  ClosedError,
  InvalidOptionsError,
  type RunOptions,
  ShedError,
  type Stage,
  type Ticket,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { backends, track, useBackend } from "./backends.js";

/** `stage.run`, which memory stages and Redis stages built to fail closed (these backends) have. */
function run<T>(
  stage: Stage,
  fn: (ticket: Ticket) => T | PromiseLike<T>,
  options?: RunOptions<T>,
): Promise<T> {
  if (typeof stage.run !== "function") throw new Error(`${stage.kind} "${stage.name}" has no run`);
  return stage.run(fn, options);
}

describe.each(backends)("stage.run on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock();
  });

  it("calls fn with the ticket, releases it, and resolves with fn's value", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 1 });
    let inside: Ticket | undefined;
    const value = await run(sem, (ticket) => {
      inside = ticket;
      expect(sem.snapshot().inFlight).toBe(1);
      return 42;
    });
    expect(value).toBe(42);
    expect(inside?.stage).toBe("sem");
    expect(inside?.released).toBe(true);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, admitted: 1, waiting: 0 });
  });

  it("rejects with fn's error, thrown or returned, and releases the ticket", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 1 });
    const boom = new Error("boom");
    await expect(
      run(sem, () => {
        throw boom;
      }),
    ).rejects.toBe(boom);
    await expect(run(sem, async () => Promise.reject(boom))).rejects.toBe(boom);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, admitted: 2 });
  });

  it("makes calls wait for a permit and runs them first in, first out", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 1 });
    const held = await sem.admit();
    const order: number[] = [];
    const calls = [1, 2, 3].map((n) => run(sem, async () => order.push(n)));
    await clock.flush();
    expect(order).toEqual([]);
    expect(sem.snapshot().waiting).toBe(3);
    await clock.advance(100);
    await held.release();
    await Promise.all(calls);
    expect(order).toEqual([1, 2, 3]);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0, admitted: 4, permitWaitMs: 300 });
  });

  it("keeps each caller's AsyncLocalStorage context across the wait", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 1 });
    const als = new AsyncLocalStorage<string>();
    const held = await sem.admit();
    const seen: (string | undefined)[] = [];
    const calls = ["a", "b", "c"].map((id) =>
      als.run(id, () => run(sem, async () => seen.push(als.getStore()))),
    );
    await als.run("releaser", () => held.release());
    await Promise.all(calls);
    expect(seen).toEqual(["a", "b", "c"]);
  });

  it("releases with dropped on a 429, so an AIMD stage cuts its limit", async () => {
    const aimd = backend.make(clock).aimd("adaptive", { initial: 8, min: 1, max: 8, backoffRatio: 0.5 });
    const res = await run(aimd, async () => ({ status: 429 }));
    expect(res).toEqual({ status: 429 });
    expect(aimd.snapshot().limit).toBe(4);
  });

  it("prefers the outcome recorded in fn, then classify's", async () => {
    const aimd = backend.make(clock).aimd("adaptive", { initial: 8, min: 1, max: 8, backoffRatio: 0.5 });
    await run(aimd, async (ticket) => {
      ticket.record("ignored");
      return { status: 503 };
    });
    expect(aimd.snapshot().limit).toBe(8);
    await run(aimd, async () => "fine", { classify: () => "dropped" });
    expect(aimd.snapshot().limit).toBe(4);
  });

  it("rejects an aborted or timed-out wait and never calls fn", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 1 });
    const held = await sem.admit();
    let called = 0;
    const controller = new AbortController();
    const aborted = track(run(sem, () => called++, { signal: controller.signal }));
    const timed = track(run(sem, () => called++, { timeoutMs: 500 }));
    await clock.flush();
    controller.abort(new Error("stop"));
    await clock.advance(500);
    expect(aborted.error).toEqual(new Error("stop"));
    expect(timed.error).toBeInstanceOf(AdmitTimeoutError);
    await held.release();
    await clock.flush();
    expect(called).toBe(0);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0, aborted: 1, timedOut: 1 });
    const pre = new AbortController();
    pre.abort(new Error("before"));
    await expect(run(sem, () => called++, { signal: pre.signal })).rejects.toEqual(new Error("before"));
    expect(called).toBe(0);
  });

  it("rejects waiting calls with ClosedError on close", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 1 });
    const held = await sem.admit();
    const waiting = run(sem, () => 1);
    await clock.flush();
    await sem.close();
    await expect(waiting).rejects.toBeInstanceOf(ClosedError);
    await expect(run(sem, () => 1)).rejects.toBeInstanceOf(ClosedError);
    await held.release();
  });

  it("refuses what is not a function, naming the stage", async () => {
    const sem = backend.make(clock).semaphore("sem", { limit: 1 });
    const error = await run(sem, "nope" as never).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect((error as Error).message).toBe('semaphore "sem": run needs a function');
  });

  it("runs on every kind of stage", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("rate", { keyed: true, capacity: 1, refillPerSecond: 1 });
    expect(await run(bucket, () => "first", { key: "k" })).toBe("first");
    const second = track(run(bucket, () => "second", { key: "k" }));
    await clock.advance(999);
    expect(second.settled).toBe(false);
    await clock.advance(1);
    await clock.flush();
    expect(second.value).toBe("second");
    const hosts = b.intervalGate("hosts", { minIntervalMs: 100 });
    expect(await run(hosts, () => "host", { host: "h" })).toBe("host");
    const queue = b.queue("jobs", { maxSize: 1, whenFull: "shed" });
    let release!: () => void;
    const slow = run(queue, () => new Promise<void>((resolve) => (release = resolve)));
    await clock.flush();
    await expect(run(queue, () => 1)).rejects.toBeInstanceOf(ShedError);
    release();
    await slow;
    expect(queue.snapshot()).toMatchObject({ queueDepth: 0, shed: 1 });
  });
});
