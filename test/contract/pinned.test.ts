import {
  AdmitTimeoutError,
  type Clock,
  type ClockTimer,
  ClosedError,
  Gate,
  InvalidOptionsError,
  memory,
  ShedError,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { allBackends, backends, selectBackends, track, useBackend } from "./backends.js";

/**
 * Behaviour of the core that no other test holds to its exact value: the refusals a Gate's call
 * meets before it may pass a stage at once, its place in a stage's line, its counters, its
 * tickets, the token bucket's penalties and debts, and the memory backend on a clock that goes
 * backwards.
 */
describe.each(backends)("pinned behaviour on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock();
  });

  describe("a Gate's call at a semaphore with callers in line", () => {
    it("does not overtake a weighted waiter, though a permit is free", async () => {
      const b = backend.make(clock);
      const sem = b.semaphore("sem", { limit: 3 });
      const gate = new Gate([sem], { clock });
      const order: string[] = [];
      const holder = await sem.admit({ cost: 2 }); // one permit of three left
      const big = sem.admit({ cost: 3 }).then((t) => {
        order.push("big");
        return t;
      });
      await clock.flush();
      expect(sem.snapshot().waiting).toBe(1);

      expect(await gate.tryAdmit({ cost: 1 })).toBeUndefined();
      const small = gate.admit({ cost: 1 }).then((t) => {
        order.push("gate");
        return t;
      });
      const run = track(gate.run(() => order.push("run"), { cost: 1 }));
      await clock.flush();
      expect(order).toEqual([]);
      expect(run.settled).toBe(false);

      await holder.release("success");
      const bigTicket = await big;
      await clock.flush();
      expect(order).toEqual(["big"]); // three permits held by the head: nothing left for the gate
      await bigTicket.release("success");
      const smallTicket = await small;
      await clock.flush();
      expect(order[0]).toBe("big");
      expect(order.slice(1).sort()).toEqual(["gate", "run"]);
      await smallTicket.release("success");
      expect(gate.snapshot()).toMatchObject({ admitted: 2, inFlight: 0, waiting: 0 });
    });

    it("does not overtake a token bucket's or an interval gate's line either", async () => {
      const b = backend.make(clock);
      const bucket = b.tokenBucket("bucket", { capacity: 2, refillPerSecond: 1 });
      const hosts = b.intervalGate("hosts", { minIntervalMs: 1000 });
      await bucket.admit({ cost: 2 });
      const bigWait = track(bucket.admit({ cost: 2 })); // due at 2000
      await hosts.admit({ host: "h" });
      const hostWait = track(hosts.admit({ host: "h" })); // due at 1000
      await clock.flush();
      await clock.advance(1000); // one token back, the host's slot free
      expect(hostWait.settled).toBe(true);
      const viaBucket = track(new Gate([bucket], { clock }).admit({ cost: 1 }));
      await clock.flush();
      expect(viaBucket.settled).toBe(false); // one token there, but the cost-2 waiter is first
      await clock.advance(1000);
      expect(bigWait.settled).toBe(true);
      expect(viaBucket.settled).toBe(false);
      await clock.advance(1000);
      expect(viaBucket.settled).toBe(true);

      const third = track(hosts.admit({ host: "h" })); // due at 2000... now 3000: at once
      await clock.flush();
      expect(third.settled).toBe(true);
      const lined = track(hosts.admit({ host: "h" })); // due at 4000
      await clock.flush();
      const viaHosts = track(new Gate([hosts], { clock }).admit({ host: "h" }));
      await clock.advance(1000);
      expect(lined.settled).toBe(true);
      expect(viaHosts.settled).toBe(false);
      await clock.advance(1000);
      expect(viaHosts.settled).toBe(true);
    });

    it("passes the line at once with a cost of 0", async () => {
      const b = backend.make(clock);
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock });
      const held = await sem.admit();
      const waiting = track(sem.admit());
      await clock.flush();
      const free = await gate.admit({ cost: 0 });
      expect(free).toMatchObject({ stage: "gate", cost: 0, released: false });
      expect(waiting.settled).toBe(false);
      await free.release("success");
      await held.release("success");
      await clock.flush();
      expect(waiting.settled).toBe(true);
    });
  });

  describe("a Gate's call waiting in a semaphore's line", () => {
    it("waits in order with the semaphore's own callers", async () => {
      const b = backend.make(clock);
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock });
      const order: string[] = [];
      const held = await sem.admit();
      const calls = [
        gate.run(() => order.push("g1")),
        sem.run!(() => order.push("s1")),
        gate.admit().then((t) => {
          order.push("g2");
          return t.release("success");
        }),
        gate.run(() => order.push("g3")),
      ];
      await clock.flush();
      expect(sem.snapshot().waiting).toBe(4);
      expect(gate.snapshot().waiting).toBe(3);
      await held.release("success");
      await Promise.all(calls);
      expect(order).toEqual(["g1", "s1", "g2", "g3"]);
      expect(gate.snapshot()).toMatchObject({ admitted: 3, waiting: 0, inFlight: 0 });
    });

    it("times out in line, counted on the gate, and refuses timeoutMs: 0 at once", async () => {
      const b = backend.make(clock);
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock });
      const held = await sem.admit();
      await expect(gate.admit({ timeoutMs: 0 })).rejects.toBeInstanceOf(AdmitTimeoutError);
      const waiting = track(gate.admit({ timeoutMs: 500 }));
      await clock.advance(499);
      expect(waiting.settled).toBe(false);
      await clock.advance(1);
      expect(waiting.error).toBeInstanceOf(AdmitTimeoutError);
      expect(gate.snapshot()).toMatchObject({ timedOut: 2, aborted: 0, waiting: 0, admitted: 0 });
      await held.release("success");
      expect(await sem.tryAdmit()).toBeDefined(); // the timed-out calls hold nothing
    });

    it("leaves the line on abort, counted on the gate", async () => {
      const b = backend.make(clock);
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock });
      const held = await sem.admit();
      const controller = new AbortController();
      const waiting = gate.run(() => "never", { signal: controller.signal });
      await clock.flush();
      controller.abort();
      await expect(waiting).rejects.toBe(controller.signal.reason);
      expect(gate.snapshot()).toMatchObject({ aborted: 1, timedOut: 0, waiting: 0, inFlight: 0 });
      await held.release("success");
      expect(await sem.tryAdmit()).toBeDefined();
    });
  });

  it("sheds a Gate's call at a full shedding queue instead of lining it up", async () => {
    const b = backend.make(clock);
    const queue = b.queue("q", { maxSize: 1, whenFull: "shed" });
    const sem = b.semaphore("sem", { limit: 1 });
    const gate = new Gate([queue, sem], { clock });
    const held = await sem.admit();
    const first = track(gate.admit()); // holds the queue's slot while it waits at the semaphore
    await clock.flush();
    await expect(gate.admit()).rejects.toBeInstanceOf(ShedError);
    expect(queue.snapshot().shed).toBe(1);
    await held.release("success");
    await clock.flush();
    expect(first.settled).toBe(true);
  });

  it("rejects sem.run with a cost above the limit at once, even when it would wait", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("sem", { limit: 2 });
    const held = await sem.admit({ cost: 2 });
    let called = false;
    const error = await sem.run!(
      () => {
        called = true;
      },
      { cost: 3 },
    ).catch((e) => e);
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect(error.field).toBe("cost");
    expect(called).toBe(false);
    expect(sem.snapshot()).toMatchObject({ waiting: 0, inFlight: 1 });
    await held.release("success");
  });

  describe("token bucket penalties", () => {
    const penalised = { capacity: 1, refillPerSecond: 1, penalty: { factor: 0.5, recoveryMs: 10_000 } };

    it("penalises a key on dropped only, not on success or ignored", async () => {
      const b = backend.make(clock);
      const bucket = b.tokenBucket("b", { ...penalised, keyed: true });
      const outcomes = ["success", "ignored", "dropped"] as const;
      const waits = [];
      for (const outcome of outcomes) {
        const t = await bucket.admit({ key: outcome });
        await t.release(outcome);
        waits.push(track(bucket.admit({ key: outcome })));
      }
      await clock.flush();
      await clock.advance(1000);
      expect(waits.map((w) => w.settled)).toEqual([true, true, false]);
      await clock.advance(1000);
      expect(waits[2]!.settled).toBe(true);
    });

    it("slows a key from the time of the drop, not from time 0", async () => {
      clock = new FakeClock(50_000);
      const b = backend.make(clock);
      const bucket = b.tokenBucket("b", penalised);
      const t = await bucket.admit();
      await clock.advance(1000); // one token back
      await t.release("dropped"); // at 51 000: half the rate, climbing back to full by 61 000
      await bucket.admit();
      const next = track(bucket.admit());
      await clock.flush();
      // ∫ (0.5 + 0.5·x/10 000) dx = 1 000 effective ms at x ≈ 1 832.2 ms after the drop.
      await clock.advance(1832);
      expect(next.settled).toBe(false);
      await clock.advance(1);
      expect(next.settled).toBe(true);
    });

    it("refuses at once a wait the penalised rate cannot meet, saying when it could", async () => {
      clock = new FakeClock(50_000);
      const b = backend.make(clock);
      const bucket = b.tokenBucket("b", penalised);
      const t = await bucket.admit();
      await clock.advance(1000);
      await t.release("dropped"); // at 51 000, as above: the next token is 1 833 ms away
      await bucket.admit();
      const error = await bucket.admit({ timeoutMs: 1500 }).catch((e) => e);
      expect(error).toBeInstanceOf(AdmitTimeoutError);
      expect(error.retryAfterMs).toBe(1833);
      expect(clock.now()).toBe(51_000);
      const next = track(bucket.admit({ timeoutMs: 1833 }));
      await clock.flush();
      await clock.advance(1833);
      expect(next.settled).toBe(true);
      expect(next.error).toBeUndefined();
    });

    it("compounds a second drop made later, from the rate at that time", async () => {
      clock = new FakeClock(20_000);
      const b = backend.make(clock);
      const bucket = b.tokenBucket("b", {
        ...penalised,
        penalty: { factor: 0.5, recoveryMs: 10_000, minFactor: 0.1 },
      });
      await (await bucket.admit()).release("dropped"); // 20 000: factor 0.5
      await clock.advance(5000); // 25 000: the rate is back to 0.75; 1 token by then
      await (await bucket.admit()).release("dropped"); // factor 0.375 from 25 000
      const next = track(bucket.admit());
      await clock.flush();
      // ∫ (0.375 + 0.625·x/10 000) dx = 1 000 at x ≈ 2 246.2 ms after the second drop.
      await clock.advance(2246);
      expect(next.settled).toBe(false);
      await clock.advance(1);
      expect(next.settled).toBe(true);
    });
  });

  it("puts a key settled above its estimate into a debt later calls wait out", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("tpm", { capacity: 10, refillPerSecond: 10 });
    const t = await bucket.admit({ cost: 10 });
    await t.settle(15); // 5 more than the bucket held: -5 tokens
    expect(t.cost).toBe(15);
    const next = track(bucket.admit({ cost: 1 }));
    await clock.flush();
    await clock.advance(599); // 6 tokens to come at 10 a second
    expect(next.settled).toBe(false);
    expect(await bucket.tryAdmit()).toBeUndefined();
    await clock.advance(1);
    expect(next.settled).toBe(true);
    await t.release("success");
  });

  describe("a Gate's ticket", () => {
    it("does nothing on a second release or a refund after release", async () => {
      const b = backend.make(clock);
      const sem = b.semaphore("sem", { limit: 1 });
      const bucket = b.tokenBucket("bucket", { capacity: 2, refillPerSecond: 1 });
      const gate = new Gate([sem, bucket], { clock });
      const t = await gate.admit();
      await t.release("dropped");
      expect(t.released).toBe(true);
      await t.release("success");
      await t.refund();
      await t.close();
      expect(gate.snapshot()).toMatchObject({ inFlight: 0, admitted: 1 });
      // The semaphore gave its one permit back once: one call gets it, a second does not.
      const again = await sem.tryAdmit();
      expect(again).toBeDefined();
      expect(await sem.tryAdmit()).toBeUndefined();
      // And the bucket was not refunded by the late refund: one of its two tokens is gone.
      expect(await bucket.tryAdmit({ cost: 2 })).toBeUndefined();
      expect(await bucket.tryAdmit({ cost: 1 })).toBeDefined();
      await again!.release("success");

      await clock.advance(1000);
      const r = await gate.admit();
      await r.refund();
      await r.release("success");
      expect(gate.snapshot()).toMatchObject({ inFlight: 0, admitted: 2 });
      expect(sem.snapshot().inFlight).toBe(0);
    });

    it("refuses an outcome that is none of the three, and stays held", async () => {
      const b = backend.make(clock);
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock, name: "g" });
      const t = await gate.admit();
      const message = 'gate "g": outcome must be "success", "dropped" or "ignored", got "ok" (string)';
      const error = await t.release("ok" as never).catch((e) => e);
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect(error).toMatchObject({ field: "outcome", stage: "g", message });
      expect(() => t.record("ok" as never)).toThrow(message);
      expect(() => t.record(undefined as never)).toThrow(InvalidOptionsError);
      expect(t.released).toBe(false);
      expect(gate.snapshot().inFlight).toBe(1);
      expect(await sem.tryAdmit()).toBeUndefined();
      t.record("dropped");
      await t.release();
      expect(t.released).toBe(true);
      await expect(t.release("nope" as never)).rejects.toBeInstanceOf(InvalidOptionsError);
      expect(gate.snapshot().inFlight).toBe(0);
    });
  });

  it("counts queueWaitMs on the gate as its queues count it", async () => {
    const b = backend.make(clock);
    const queue = b.queue("q", { maxSize: 1 });
    const sem = b.semaphore("sem", { limit: 1 });
    const gate = new Gate([queue, sem], { clock });
    const a = await gate.admit(); // the queue's slot given back once it has its permit
    const second = track(gate.admit()); // holds the queue's slot, waits at the semaphore
    await clock.flush();
    const third = track(gate.admit()); // waits for the queue's slot
    await clock.flush();
    await clock.advance(100);
    await a.release("success"); // second gets its permit and gives the slot to third
    await clock.flush();
    expect(second.settled).toBe(true);
    expect(third.settled).toBe(false);
    expect(gate.snapshot().queueWaitMs).toBe(100);
    expect(gate.snapshot().queueWaitMs).toBe(queue.snapshot().queueWaitMs);
    expect(gate.snapshot().permitWaitMs).toBe(100);
    await (second.value as { release(o: string): Promise<void> }).release("success");
    await clock.flush();
    expect(third.settled).toBe(true);
  });

  describe("a Gate's calls when closed or aborted", () => {
    it("refuses every call after close with ClosedError, never calling fn", async () => {
      const b = backend.make(clock);
      const sem = b.semaphore("sem", { limit: 5 });
      const gate = new Gate([sem], { clock, name: "g" });
      await gate.close();
      let called = false;
      const fn = () => {
        called = true;
      };
      for (const call of [gate.admit(), gate.run(fn), gate.tryAdmit(), gate.enqueue(fn)]) {
        const error = await call.then(
          () => undefined,
          (e) => e,
        );
        expect(error).toBeInstanceOf(ClosedError);
        expect(error.stage).toBe("g");
      }
      expect(called).toBe(false);
      expect(gate.snapshot()).toMatchObject({ admitted: 0, inFlight: 0 });
      await gate.close(); // a second close is a no-op
    });

    it("refuses a call at a stage closed on its own, though the gate is open", async () => {
      const b = backend.make(clock);
      const stages = [
        b.semaphore("sem", { limit: 5 }),
        b.tokenBucket("bucket", { capacity: 5, refillPerSecond: 1 }),
        b.intervalGate("hosts", { minIntervalMs: 10, defaultHost: "h" }),
      ];
      for (const stage of stages) {
        const gate = new Gate([stage], { clock });
        await stage.close();
        let called = false;
        const run = gate.run(() => {
          called = true;
        });
        await expect(gate.admit()).rejects.toBeInstanceOf(ClosedError);
        await expect(run).rejects.toBeInstanceOf(ClosedError);
        expect(called).toBe(false);
        expect(gate.snapshot()).toMatchObject({ admitted: 0, inFlight: 0, waiting: 0 });
      }
    });

    it("rejects a waiting call with ClosedError when the gate closes, holding nothing", async () => {
      const b = backend.make(clock);
      const bucket = b.tokenBucket("bucket", { capacity: 1, refillPerSecond: 1 });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([bucket, sem], { clock });
      const held = await sem.admit();
      const waiting = track(gate.admit());
      await clock.flush();
      await gate.close();
      await clock.flush();
      expect(waiting.error).toBeInstanceOf(ClosedError);
      expect(gate.snapshot().inFlight).toBe(0);
      await held.release("success");
    });

    it("refuses an already-aborted call with its reason though every stage has room", async () => {
      const b = backend.make(clock);
      const sem = b.semaphore("sem", { limit: 5 });
      const bucket = b.tokenBucket("bucket", { capacity: 5, refillPerSecond: 1 });
      const gate = new Gate([sem, bucket], { clock });
      const controller = new AbortController();
      controller.abort(new Error("gone"));
      let called = false;
      const fn = () => {
        called = true;
      };
      const signal = controller.signal;
      await expect(gate.admit({ signal })).rejects.toBe(signal.reason);
      await expect(gate.run(fn, { signal })).rejects.toBe(signal.reason);
      await expect(gate.enqueue(fn, { signal })).rejects.toBe(signal.reason);
      expect(called).toBe(false);
      expect(gate.snapshot()).toMatchObject({ admitted: 0, inFlight: 0, aborted: 0 });
      expect(sem.snapshot().inFlight).toBe(0);
      expect(await bucket.tryAdmit({ cost: 5 })).toBeDefined(); // no token was taken
    });
  });

  it("passes a call's host, cost and key to its stages with gate.tryAdmit", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("bucket", { capacity: 5, refillPerSecond: 1, keyed: true });
    const hosts = b.intervalGate("hosts", { minIntervalMs: 1000 });
    const gate = new Gate([bucket, hosts], { clock });
    const t = await gate.tryAdmit({ key: "acme", host: "a.test", cost: 3 });
    expect(t).toMatchObject({ stage: "gate", cost: 3, released: false });
    // The key "acme" paid 3 of its 5 tokens; another key paid nothing.
    expect(await bucket.tryAdmit({ key: "acme", cost: 3 })).toBeUndefined();
    expect(await bucket.tryAdmit({ key: "globex", cost: 5 })).toBeDefined();
    // The host "a.test" is spaced; another host is not.
    expect(await hosts.tryAdmit({ host: "a.test" })).toBeUndefined();
    expect(await hosts.tryAdmit({ host: "b.test" })).toBeDefined();
    // A call the bucket cannot pay for takes nothing from the host either.
    expect(await gate.tryAdmit({ key: "acme", host: "c.test", cost: 3 })).toBeUndefined();
    expect(await hosts.tryAdmit({ host: "c.test" })).toBeDefined();
    expect(await bucket.tryAdmit({ key: "acme", cost: 2 })).toBeDefined();
  });
});

/** A clock whose time is set by hand, backwards too; its timers are kept and never fire. */
class HandClock implements Clock {
  time: number;
  timers = new Set<object>();
  constructor(start: number) {
    this.time = start;
  }
  now(): number {
    return this.time;
  }
  setTimeout(_callback: () => void, _ms: number): ClockTimer {
    const timer = {};
    this.timers.add(timer);
    return timer;
  }
  clearTimeout(timer: ClockTimer): void {
    this.timers.delete(timer as object);
  }
}

describe("memory on a clock that goes backwards", () => {
  it("grants no extra tokens, and refills only past the latest time seen", async () => {
    const clock = new HandClock(10_000);
    const bucket = memory({ clock }).tokenBucket("b", { capacity: 2, refillPerSecond: 1 });
    expect(await bucket.tryAdmit({ cost: 2 })).toBeDefined();
    clock.time = 5_000;
    expect(await bucket.tryAdmit()).toBeUndefined();
    clock.time = 10_999;
    expect(await bucket.tryAdmit()).toBeUndefined();
    clock.time = 11_000;
    expect(await bucket.tryAdmit()).toBeDefined();
    expect(await bucket.tryAdmit()).toBeUndefined();
    clock.time = 9_000; // back again, after a take
    expect(bucket.tokens()).toBe(0);
    clock.time = 12_000;
    expect(bucket.tokens()).toBe(1);
  });

  it("keeps the spacing of an interval gate, directly and through a Gate", async () => {
    const clock = new HandClock(10_000);
    const b = memory({ clock });
    const hosts = b.intervalGate("hosts", { minIntervalMs: 1000 });
    const gate = new Gate([hosts], { clock });
    expect(await hosts.tryAdmit({ host: "h" })).toBeDefined(); // next slot at 11 000
    clock.time = 5_000;
    expect(await hosts.tryAdmit({ host: "h" })).toBeUndefined();
    expect(await gate.tryAdmit({ host: "h" })).toBeUndefined();
    expect(hosts.delayFor("h")).toBe(6_000);
    clock.time = 10_999;
    expect(await gate.tryAdmit({ host: "h" })).toBeUndefined();
    clock.time = 11_000;
    expect(await gate.tryAdmit({ host: "h" })).toBeDefined(); // next slot at 12 000
    clock.time = 11_500;
    expect(await hosts.tryAdmit({ host: "h" })).toBeUndefined();
  });

  it("grants no extra tokens through a Gate either", async () => {
    const clock = new HandClock(10_000);
    const bucket = memory({ clock }).tokenBucket("b", { capacity: 1, refillPerSecond: 1 });
    const gate = new Gate([bucket], { clock });
    const t = await gate.admit();
    expect(t).toMatchObject({ cost: 1 });
    clock.time = 0;
    expect(await gate.tryAdmit()).toBeUndefined();
    const waiting = track(gate.admit());
    await Promise.resolve();
    expect(waiting.settled).toBe(false);
    clock.time = 10_999;
    expect(await bucket.tryAdmit()).toBeUndefined();
    expect(bucket.snapshot()).toMatchObject({ waiting: 1, admitted: 1 });
  });
});

describe("selecting contract backends", () => {
  it("takes every backend when nothing is named", () => {
    expect(selectBackends(allBackends, undefined).map((b) => b.name)).toEqual([
      "memory",
      "redis",
      "redis-ioredis6",
      "redis-cluster",
      "redis-node-redis",
      "redis-cluster-node-redis",
      "redis-node-redis5",
      "redis-cluster-node-redis5",
      "redis-iovalkey",
      "redis-cluster-iovalkey",
    ]);
    expect(selectBackends(allBackends, " ").length).toBe(10);
  });

  it("takes the backends named, in their own order", () => {
    expect(selectBackends(allBackends, "redis-cluster, memory").map((b) => b.name)).toEqual([
      "memory",
      "redis-cluster",
    ]);
  });

  it("refuses a name it does not know", () => {
    expect(() => selectBackends(allBackends, "memory,mem")).toThrow(
      'FLOODGATE_BACKENDS names "mem", which is no contract backend',
    );
  });
});
