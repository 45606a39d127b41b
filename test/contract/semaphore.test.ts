import { AsyncLocalStorage } from "node:async_hooks";
import { getEventListeners } from "node:events";
import { AdmitTimeoutError, ClosedError, InvalidOptionsError, type Ticket } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { thrown } from "../thrown.js";
import { warningsDuring } from "../warnings.js";
import { backends, track, useBackend } from "./backends.js";

describe.each(backends)("semaphore on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;
  const make = (limit: number) => backend.make(clock).semaphore("sem", { limit });

  beforeEach(() => {
    clock = new FakeClock();
  });

  it("grants up to the limit at once and makes the next caller wait", async () => {
    const sem = make(2);
    await sem.admit();
    await sem.admit();
    const third = track(sem.admit());
    await clock.flush();
    expect(third.settled).toBe(false);
    expect(sem.snapshot()).toMatchObject({ inFlight: 2, waiting: 1, limit: 2 });
  });

  it("serves waiters first in, first out", async () => {
    const sem = make(1);
    const first = await sem.admit();
    const order: number[] = [];
    const waits = [1, 2, 3].map((n) =>
      sem.admit().then((t) => {
        order.push(n);
        return t;
      }),
    );
    await first.release("success");
    for (const w of waits) await (await w).release("success");
    expect(order).toEqual([1, 2, 3]);
  });

  it("does not starve a large waiter at the head with small ones behind it", async () => {
    const sem = make(4);
    const small = await sem.admit({ cost: 1 });
    const big = track(sem.admit({ cost: 4 }));
    const later = track(sem.admit({ cost: 1 }));
    await clock.flush();
    expect(big.settled).toBe(false);
    expect(later.settled).toBe(false); // 3 permits are free, but the head needs 4
    await small.release();
    await clock.flush();
    expect(big.settled).toBe(true);
    expect(later.settled).toBe(false);
  });

  it("weighs large costs without one entry per permit (a tokens-per-minute budget)", async () => {
    const sem = make(1_000_000);
    const tickets = await Promise.all(Array.from({ length: 10 }, () => sem.admit({ cost: 100_000 })));
    const next = track(sem.admit({ cost: 100_000 }));
    await clock.flush();
    expect(next.settled).toBe(false);
    await tickets[0]!.release("success");
    await clock.flush();
    expect(next.settled).toBe(true);
  });

  it("refuses a cost above the limit at once, naming the field", async () => {
    const sem = make(3);
    const error = await sem.admit({ cost: 4 }).catch((e) => e);
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect(error.field).toBe("cost");
    expect(error.message).toContain('semaphore "sem": cost must be <= limit (3), got 4 (number)');
  });

  it("rejects a cost that is not an integer >= 0", async () => {
    const sem = make(3);
    for (const cost of [-1, 1.5, Number.NaN]) {
      const error = await sem.admit({ cost }).catch((e) => e);
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect(error.field).toBe("cost");
    }
  });

  it("ignores a second release", async () => {
    const sem = make(1);
    const ticket = await sem.admit();
    await ticket.release("success");
    await ticket.release("success");
    await ticket.refund();
    expect(sem.snapshot().inFlight).toBe(0);
    const a = await sem.admit();
    const b = track(sem.admit());
    await clock.flush();
    expect(b.settled).toBe(false); // the double release did not free a second permit
    await a.release();
  });

  it("releases a ticket when an `await using` block ends", async () => {
    const sem = make(1);
    {
      await using ticket = await sem.admit();
      expect(ticket.released).toBe(false);
      expect(sem.snapshot().inFlight).toBe(1);
    }
    expect(sem.snapshot().inFlight).toBe(0);
  });

  it("rejects an aborted wait with the signal's reason and leaves no waiter", async () => {
    const sem = make(1);
    const held = await sem.admit();
    const controller = new AbortController();
    const waiting = sem.admit({ signal: controller.signal });
    const reason = new Error("caller gave up");
    controller.abort(reason);
    await expect(waiting).rejects.toBe(reason);
    expect(sem.snapshot()).toMatchObject({ waiting: 0, aborted: 1, inFlight: 1 });
    await held.release();
    expect(sem.snapshot().inFlight).toBe(0);
  });

  it("listens once to a signal many waits share, and tells each of them, in order, when it aborts", async () => {
    const sem = make(1);
    const held = await sem.admit();
    const controller = new AbortController();
    const warnings = await warningsDuring(async () => {
      const order: number[] = [];
      const waiting = Array.from({ length: 30 }, (_, i) =>
        sem.admit({ signal: controller.signal }).then(
          (t) => t,
          (e: unknown) => {
            order.push(i);
            return e;
          },
        ),
      );
      await clock.flush();
      expect(sem.snapshot().waiting).toBe(30);
      expect(getEventListeners(controller.signal, "abort")).toHaveLength(1);
      // The first is granted before the abort: the listener stays for the others, and goes with the last.
      await held.release();
      const first = await waiting[0]!;
      expect(first).not.toBeInstanceOf(Error);
      expect(getEventListeners(controller.signal, "abort")).toHaveLength(1);
      const reason = new Error("worker shutting down");
      controller.abort(reason);
      const outcomes = await Promise.all(waiting.slice(1));
      for (const outcome of outcomes) expect(outcome).toBe(reason);
      expect(order).toEqual(Array.from({ length: 29 }, (_, i) => i + 1));
      expect(sem.snapshot()).toMatchObject({ waiting: 0, aborted: 29, inFlight: 1 });
      await (first as Ticket).release();
      // Waits that all end otherwise take the listener with the last of them.
      const other = new AbortController();
      const again = await sem.admit();
      const more = Array.from({ length: 12 }, () => sem.admit({ signal: other.signal }));
      await clock.flush();
      expect(getEventListeners(other.signal, "abort")).toHaveLength(1);
      await again.release();
      for (const p of more) await (await p).release();
      expect(getEventListeners(other.signal, "abort")).toHaveLength(0);
    });
    expect(warnings).not.toContain("MaxListenersExceededWarning");
  });

  it("rejects at once when the signal is already aborted", async () => {
    const sem = make(1);
    const held = await sem.admit();
    const reason = new Error("already");
    await expect(sem.admit({ signal: AbortSignal.abort(reason) })).rejects.toBe(reason);
    expect(sem.snapshot().waiting).toBe(0);
    await held.release();
  });

  it("rejects an already-aborted signal even when permits are free", async () => {
    const sem = make(1);
    const reason = new Error("gone");
    await expect(sem.admit({ signal: AbortSignal.abort(reason) })).rejects.toBe(reason);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, admitted: 0 });
  });

  it("lets the waiters behind an aborted one move up", async () => {
    const sem = make(2);
    const held = await sem.admit({ cost: 1 });
    const controller = new AbortController();
    const big = track(sem.admit({ cost: 2, signal: controller.signal }));
    const small = track(sem.admit({ cost: 1 }));
    await clock.flush();
    expect(small.settled).toBe(false);
    controller.abort();
    await clock.flush();
    expect(big.error).toBeDefined();
    expect(small.settled).toBe(true);
    await held.release();
  });

  it("times out with AdmitTimeoutError and holds nothing afterwards", async () => {
    const sem = make(1);
    const held = await sem.admit();
    const waiting = track(sem.admit({ timeoutMs: 500 }));
    await clock.advance(499);
    expect(waiting.settled).toBe(false);
    await clock.advance(1);
    expect(waiting.error).toBeInstanceOf(AdmitTimeoutError);
    expect((waiting.error as AdmitTimeoutError).stage).toBe("sem");
    expect(sem.snapshot()).toMatchObject({ waiting: 0, timedOut: 1, inFlight: 1 });
    await held.release();
    expect(clock.pendingTimers).toBe(0);
  });

  it("treats timeoutMs 0 as 'only if free now'", async () => {
    const sem = make(1);
    const ticket = await sem.admit({ timeoutMs: 0 });
    await expect(sem.admit({ timeoutMs: 0 })).rejects.toBeInstanceOf(AdmitTimeoutError);
    await ticket.release();
  });

  it("tryAdmit never waits and never jumps the queue", async () => {
    const sem = make(2);
    const a = await sem.tryAdmit({ cost: 2 });
    expect(a).toBeDefined();
    expect(await sem.tryAdmit()).toBeUndefined();
    const waiter = track(sem.admit({ cost: 2 }));
    await a!.release();
    await clock.flush();
    expect(waiter.settled).toBe(true);
    expect(await sem.tryAdmit()).toBeUndefined();
  });

  it("keeps each caller's AsyncLocalStorage context across the wait", async () => {
    const sem = make(1);
    const als = new AsyncLocalStorage<string>();
    const held = await sem.admit();
    const seen: (string | undefined)[] = [];
    const callers = ["a", "b", "c"].map((id) =>
      als.run(id, async () => {
        const t = await sem.admit();
        seen.push(als.getStore());
        await t.release();
      }),
    );
    await als.run("releaser", () => held.release());
    await Promise.all(callers);
    expect(seen).toEqual(["a", "b", "c"]);
  });

  it("counts the time waited for permits", async () => {
    const sem = make(1);
    const held = await sem.admit();
    const next = sem.admit();
    await clock.advance(250);
    await held.release();
    await (await next).release();
    expect(sem.snapshot().permitWaitMs).toBe(250);
  });

  it("rejects waiters and new admissions after close, and aborts tickets' signals", async () => {
    const sem = make(1);
    const held = await sem.admit();
    // A signal handed out before the close (to a call on its way) aborts too.
    const handedOut = held.signal;
    const waiting = sem.admit();
    await sem.close();
    await expect(waiting).rejects.toBeInstanceOf(ClosedError);
    await expect(sem.admit()).rejects.toBeInstanceOf(ClosedError);
    expect(held.signal.aborted).toBe(true);
    expect(handedOut.aborted).toBe(true);
    expect(handedOut.reason).toBeInstanceOf(ClosedError);
    await held.release();
  });

  it("refuses bad options with the stage, field, rule and value", () => {
    const b = backend.make(clock);
    expect(() => b.semaphore("bad", { limit: 0 })).toThrow(
      'semaphore "bad": limit must be an integer >= 1, got 0 (number)',
    );
    expect(() => b.semaphore("bad", { limit: 2.5 })).toThrow(
      "limit must be an integer >= 1, got 2.5 (number)",
    );
    expect(() => b.semaphore("bad", { limit: 2, leaseMs: 10 })).toThrow(
      "leaseMs must be an integer >= 100, got 10 (number)",
    );
    expect(() => b.semaphore("bad", { limt: 2 } as never)).toThrow('semaphore "bad": unknown option "limt"');
    expect(() => b.semaphore("", { limit: 1 })).toThrow(InvalidOptionsError);
  });

  it("returns the same stage for the same name and refuses other options under it", () => {
    const b = backend.make(clock);
    const a = b.semaphore("shared", { limit: 2 });
    expect(b.semaphore("shared", { limit: 2 })).toBe(a);
    expect(() => b.semaphore("shared", { limit: 3 })).toThrow(/already built with other options/);
  });

  // (On Redis a semaphore, a bounded queue and an AIMD limiter of one name would share keys.)
  it("refuses a stage of another kind under a name taken, naming the field, and the name still names its stage", () => {
    const b = backend.make(clock);
    const a = b.semaphore("taken", { limit: 2 });
    const others: [string, () => unknown][] = [
      ["aimd", () => b.aimd("taken", { initial: 2, max: 4 })],
      ["queue", () => b.queue("taken", { maxSize: 2 })],
      ["tokenBucket", () => b.tokenBucket("taken", { capacity: 2, refillPerSecond: 1 })],
      ["intervalGate", () => b.intervalGate("taken", { minIntervalMs: 1 })],
    ];
    for (const [kind, build] of others) {
      const error = thrown(build);
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect((error as InvalidOptionsError).field).toBe("name");
      expect((error as Error).message).toBe(
        `${kind} "taken": this backend has a semaphore of that name already; one name, one stage (give each its own name)`,
      );
    }
    // The name still names the semaphore, and other names build as before.
    expect(b.semaphore("taken", { limit: 2 })).toBe(a);
    expect(b.aimd("taken-too", { initial: 2, max: 4 }).kind).toBe("aimd");
  });
});
