import { AsyncLocalStorage } from "node:async_hooks";
import { getEventListeners } from "node:events";
import {
  AdmitTimeoutError,
  ClosedError,
  Gate,
  InvalidOptionsError,
  type Stage,
  type Ticket,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it, vi } from "vitest";
import { recorder } from "../recorder.js";
import { warningsDuring } from "../warnings.js";
import { backends, track, useBackend } from "./backends.js";

describe.each(backends)("Gate on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock();
  });

  function fiveStages(b = backend.make(clock)) {
    const queue = b.queue("q", { maxSize: 100 });
    const bucket = b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 });
    const hosts = b.intervalGate("hosts", { minIntervalMs: 100, defaultHost: "api" });
    const sem = b.semaphore("inflight", { limit: 2 });
    const aimd = b.aimd("adaptive", { initial: 2, max: 2, backoffRatio: 0.5 });
    return { queue, bucket, hosts, sem, aimd, gate: new Gate([queue, bucket, hosts, sem, aimd], { clock }) };
  }

  it("is fused in memory and on one Redis server, and taken stage by stage on a Cluster", () => {
    const { gate } = fiveStages();
    expect(gate.fused).toBe(!backend.name.startsWith("redis-cluster"));
  });

  it("runs a call through every stage and returns its result", async () => {
    const { gate } = fiveStages();
    await expect(gate.run(async () => 42, { host: "a" })).resolves.toBe(42);
    expect(gate.snapshot()).toMatchObject({ inFlight: 0, admitted: 1, waiting: 0 });
  });

  it("holds no permit while it waits for a token", async () => {
    const { gate, bucket, sem } = fiveStages();
    const first = await gate.admit();
    const second = track(gate.admit());
    await clock.advance(500);
    expect(second.settled).toBe(false);
    // Chained, it waits in the bucket's line; fused, in the gate, in no stage's line.
    expect(bucket.snapshot().waiting).toBe(gate.fused ? 0 : 1);
    expect(gate.snapshot().waiting).toBe(1);
    expect(sem.snapshot().inFlight).toBe(1); // only the first call's permit
    await clock.advance(500);
    expect(second.settled).toBe(true);
    await first.release("success");
  });

  it("releases in reverse order with the outcome", async () => {
    const released: string[] = [];
    const spy = (name: string, inner: Stage): Stage => ({
      ...inner,
      name,
      kind: inner.kind,
      holds: inner.holds,
      snapshot: () => inner.snapshot(),
      close: () => inner.close(),
      [Symbol.asyncDispose]: () => inner.close(),
      tryAdmit: (o) => inner.tryAdmit(o),
      admit: async (o) => {
        const t = await inner.admit(o);
        const release = t.release.bind(t);
        return Object.assign(Object.create(t), {
          release: (outcome?: string) => {
            released.push(`${name}:${outcome}`);
            return release(outcome as never);
          },
        });
      },
    });
    const b = backend.make(clock);
    const gate = new Gate(
      [spy("one", b.semaphore("one", { limit: 1 })), spy("two", b.semaphore("two", { limit: 1 }))],
      { clock },
    );
    await gate.run(async () => ({ status: 429 }));
    expect(released).toEqual(["two:dropped", "one:dropped"]);
  });

  it("classifies a 429 or 503 response as dropped and moves the adaptive limit", async () => {
    const { gate, aimd } = fiveStages();
    await gate.run(async () => ({ status: 503 }));
    expect(aimd.snapshot().limit).toBe(1);
  });

  it("lets an outcome recorded on the ticket win over the classifier", async () => {
    const { gate, aimd } = fiveStages();
    await gate.run(async (ticket) => {
      ticket.record("dropped");
      return { status: 200 };
    });
    expect(aimd.snapshot().limit).toBe(1);
  });

  it("releases as ignored when the call throws, and rethrows", async () => {
    const { gate, aimd, sem } = fiveStages();
    const boom = new Error("boom");
    await expect(gate.run(() => Promise.reject(boom))).rejects.toBe(boom);
    expect(sem.snapshot().inFlight).toBe(0);
    expect(aimd.snapshot().limit).toBe(2);
  });

  it("treats a thrown timeout as dropped", async () => {
    const { gate, aimd } = fiveStages();
    const timeout = new DOMException("timed out", "TimeoutError");
    await expect(gate.run(() => Promise.reject(timeout))).rejects.toBe(timeout);
    expect(aimd.snapshot().limit).toBe(1);
  });

  it("refunds the tokens it took when a later stage times out", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("rate", { keyed: true, capacity: 1, refillPerSecond: 0.001 });
    const sem = b.semaphore("inflight", { limit: 1 });
    const gate = new Gate([bucket, sem], { clock });
    const blocker = await sem.admit();
    const waiting = track(gate.admit({ timeoutMs: 100, key: "k" }));
    await clock.advance(100);
    // The gate took the token, waited at the semaphore, timed out and gave the token back.
    expect(waiting.error).toBeInstanceOf(AdmitTimeoutError);
    expect(await bucket.tryAdmit({ key: "k" })).toBeDefined();
    await blocker.release();
  });

  it("listens once to a signal its waiting calls share, and rejects each when it aborts", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("rate", { capacity: 100, refillPerSecond: 100 });
    const sem = b.semaphore("inflight", { limit: 1 });
    const gate = new Gate([bucket, sem], { clock });
    const blocker = await gate.admit();
    const controller = new AbortController();
    const warnings = await warningsDuring(async () => {
      const waiting = Array.from({ length: 25 }, () =>
        gate.admit({ signal: controller.signal }).catch((e: unknown) => e),
      );
      await clock.flush();
      expect(gate.snapshot().waiting).toBe(25);
      // (One listener for the gate's calls, or for its stages' waits when taken stage by stage.)
      expect(getEventListeners(controller.signal, "abort").length).toBeLessThanOrEqual(2);
      const reason = new Error("worker shutting down");
      controller.abort(reason);
      for (const outcome of await Promise.all(waiting)) expect(outcome).toBe(reason);
      expect(gate.snapshot()).toMatchObject({ waiting: 0, aborted: 25 });
      expect(getEventListeners(controller.signal, "abort")).toHaveLength(0);
      await blocker.release();
    });
    expect(warnings).not.toContain("MaxListenersExceededWarning");
  });

  it("refunds what it holds when the caller aborts part-way", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("rate", { capacity: 1, refillPerSecond: 0.001 });
    const sem = b.semaphore("inflight", { limit: 1 });
    const gate = new Gate([bucket, sem], { clock });
    const blocker = await sem.admit();
    const controller = new AbortController();
    const waiting = gate.admit({ signal: controller.signal });
    await clock.flush();
    controller.abort();
    await expect(waiting).rejects.toBe(controller.signal.reason);
    expect(await bucket.tryAdmit()).toBeDefined();
    expect(sem.snapshot().waiting).toBe(0);
    expect(gate.snapshot()).toMatchObject({ waiting: 0, aborted: 1 });
    await blocker.release();
  });

  it("shares one timeoutMs across its stages", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("rate", { capacity: 1, refillPerSecond: 10 });
    const sem = b.semaphore("inflight", { limit: 1 });
    const gate = new Gate([bucket, sem], { clock });
    await bucket.admit();
    const blocker = await sem.admit();
    const waiting = track(gate.admit({ timeoutMs: 150 }));
    await clock.advance(100); // the token came at 100 ms; 50 ms are left for the permit
    expect(waiting.settled).toBe(false);
    await clock.advance(50);
    expect(waiting.error).toBeInstanceOf(AdmitTimeoutError);
    // The stage it waited for last is named: the gate's own error says so when fused; a stage's
    // own error, taken in turn.
    expect((waiting.error as Error).message).toMatch(
      gate.fused
        ? /^gate "gate": not admitted within timeoutMs \(150\); it waited for semaphore "inflight"$/
        : /^semaphore "inflight": not admitted within timeoutMs/,
    );
    await blocker.release();
  });

  it("refuses at once a call its rates cannot admit within timeoutMs, saying when they could", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("inflight", { limit: 2 });
    const bucket = b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 });
    const gate = new Gate([sem, bucket], { clock });
    await bucket.admit();
    // (No time passes: were it to wait for its deadline, it would never settle.)
    const error = (await gate.admit({ timeoutMs: 200 }).catch((e: unknown) => e)) as AdmitTimeoutError;
    expect(error).toBeInstanceOf(AdmitTimeoutError);
    expect(error.retryAfterMs).toBe(1000);
    // The gate names the rate when fused; taken in turn, the bucket refuses so itself.
    expect(error.message).toMatch(
      gate.fused
        ? /^gate "gate": not admitted within timeoutMs \(200\); tokenBucket "rate" could admit it in 1000 ms at the soonest$/
        : /^tokenBucket "rate": not admitted within timeoutMs \(200\)$/,
    );
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    expect(gate.snapshot()).toMatchObject({ waiting: 0, timedOut: 1 });
    // So is a call that waits for nothing (`timeoutMs: 0`): it says when it could go too.
    const now = (await gate.admit({ timeoutMs: 0 }).catch((e: unknown) => e)) as AdmitTimeoutError;
    expect(now).toBeInstanceOf(AdmitTimeoutError);
    expect(now.retryAfterMs).toBe(1000);
    // With time enough, it waits for the token and is admitted when it comes.
    const waits = track(gate.admit({ timeoutMs: 1500 }));
    await clock.advance(999);
    expect(waits.settled).toBe(false);
    await clock.advance(1);
    expect(waits.value).toBeDefined();
    await (waits.value as Ticket).release();
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
  });

  it("logs a fused gate's own timeout through the gate's logger, as a stage logs its own", async () => {
    const b = backend.make(clock);
    const { logger, entries } = recorder();
    const sem = b.semaphore("inflight", { limit: 1 });
    const bucket = b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 });
    const gate = new Gate([sem, bucket], { clock, logger });
    await bucket.admit();
    await gate.admit({ timeoutMs: 200 }).catch(() => {});
    const blocker = await sem.admit();
    const waiting = track(gate.admit({ timeoutMs: 300 }));
    await clock.advance(300);
    await vi.waitFor(() => expect(waiting.settled).toBe(true), { timeout: 5_000, interval: 5 });
    const timedOut = entries
      .filter((e) => e.msg === "admission timed out")
      .map(({ level, stage, timeoutMs, retryAfterMs }) => ({ level, stage, timeoutMs, retryAfterMs }));
    // Taken stage by stage, the stages log their own (through theirs), and the gate nothing.
    expect(timedOut).toEqual(
      gate.fused
        ? [
            { level: "warn", stage: "gate", timeoutMs: 200, retryAfterMs: 1000 },
            { level: "warn", stage: "gate", timeoutMs: 300 },
          ]
        : [],
    );
    await blocker.release();
  });

  it("refuses a waiting call once its rates cannot admit it before its deadline, not at it", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 });
    const gate = new Gate([b.semaphore("inflight", { limit: 4 }), bucket], { clock });
    await bucket.admit();
    const first = track(gate.admit({ timeoutMs: 5000 }));
    const second = track(gate.admit({ timeoutMs: 1500 }));
    await clock.advance(1000);
    // The first has the token that came at 1000 ms; the next comes at 2000, after the second's
    // deadline: it is refused now (taken in turn, the bucket refused it on arrival, seeing the line).
    expect(first.value).toBeDefined();
    // (On Redis the second is told to ask again as the first leaves the lane: waited for, the
    // fake clock standing still.)
    await vi.waitFor(() => expect(second.settled).toBe(true), { timeout: 5_000, interval: 5 });
    expect(second.error).toBeInstanceOf(AdmitTimeoutError);
    expect((second.error as AdmitTimeoutError).retryAfterMs).toBe(gate.fused ? 1000 : 2000);
    expect(gate.snapshot()).toMatchObject({ waiting: 0, timedOut: 1 });
    await (first.value as Ticket).release();
  });

  it("refuses a call that waited for permits once they free and its rates cannot admit it in time", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("inflight", { limit: 1 });
    const bucket = b.tokenBucket("rate", { capacity: 1, refillPerSecond: 0.5 });
    const gate = new Gate([sem, bucket], { clock });
    const blocker = await sem.admit();
    await bucket.admit(); // the next token comes at 2000 ms
    const waiting = track(gate.admit({ timeoutMs: 1500 }));
    await clock.advance(800);
    expect(waiting.settled).toBe(false);
    await blocker.release();
    // Permits free at 800 ms, the token 1200 ms later, past its deadline: refused now, holding
    // nothing. (On Redis the waiter hears of the freed permits on its pub/sub connection: waited
    // for, the fake clock standing still; were it to wait for its deadline, it would never settle.)
    await vi.waitFor(() => expect(waiting.settled).toBe(true), { timeout: 5_000, interval: 5 });
    expect(waiting.error).toBeInstanceOf(AdmitTimeoutError);
    expect((waiting.error as AdmitTimeoutError).retryAfterMs).toBe(1200);
    expect(gate.snapshot()).toMatchObject({ waiting: 0, timedOut: 1 });
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    const ticket = await sem.tryAdmit();
    expect(ticket).toBeDefined();
    await ticket!.release();
  });

  it("charges each stage the cost named for it", async () => {
    const b = backend.make(clock);
    const rpm = b.tokenBucket("rpm", { capacity: 10, refillPerSecond: 1 });
    const tpm = b.tokenBucket("tpm", { capacity: 1000, refillPerSecond: 10 });
    const gate = new Gate([rpm, tpm], { clock });
    await gate.run(async () => "ok", { costs: { tpm: 800 } });
    expect(await rpm.tryAdmit({ cost: 9 })).toBeDefined();
    expect(await tpm.tryAdmit({ cost: 201 })).toBeUndefined();
    expect(await tpm.tryAdmit({ cost: 200 })).toBeDefined();
  });

  it("settles each stage by name: reserve the estimate, pay the actual", async () => {
    const b = backend.make(clock);
    const rpm = b.tokenBucket("rpm", { capacity: 10, refillPerSecond: 1 });
    const tpm = b.tokenBucket("tpm", { capacity: 1000, refillPerSecond: 1 });
    const gate = new Gate([rpm, tpm, b.semaphore("inflight", { limit: 4 })], { clock });
    await gate.run(
      async (ticket) => {
        await ticket.settle({ tpm: 200 }); // the response said 200 tokens, not 800
      },
      { costs: { tpm: 800 } },
    );
    expect(await tpm.tryAdmit({ cost: 801 })).toBeUndefined();
    expect(await tpm.tryAdmit({ cost: 800 })).toBeDefined();
    expect(await rpm.tryAdmit({ cost: 9 })).toBeDefined(); // one request, as admitted
  });

  it("refuses a settle naming no stage of the gate, as costs are refused, and settles nothing", async () => {
    const b = backend.make(clock);
    const tpm = b.tokenBucket("tpm", { capacity: 1000, refillPerSecond: 1 });
    const gate = new Gate([b.semaphore("inflight", { limit: 4 }), tpm], { clock, name: "g" });
    const ticket = await gate.admit({ costs: { tpm: 800 } });
    for (const actual of [{ TPM: 200 }, { tpm: 200, nope: 1 }] as Record<string, number>[]) {
      const error = await ticket.settle(actual).catch((e: unknown) => e);
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect(error).toMatchObject({ field: `actual.${Object.keys(actual).at(-1)}` });
      expect((error as Error).message).toBe(
        `gate "g": actual names "${Object.keys(actual).at(-1)}", which is no stage of the gate (its stages: inflight, tpm)`,
      );
    }
    // Nothing was settled: the 800 reserved are still taken.
    expect(await tpm.tryAdmit({ cost: 201 })).toBeUndefined();
    await ticket.settle({ tpm: 200 });
    expect(await tpm.tryAdmit({ cost: 800 })).toBeDefined();
    await ticket.release("success");
  });

  it("nests: a gate is a stage of another gate", async () => {
    const b = backend.make(clock);
    const inner = new Gate([b.semaphore("inner", { limit: 1 })], { clock, name: "inner-gate" });
    const outer = new Gate([b.tokenBucket("outer", { capacity: 5, refillPerSecond: 1 }), inner], { clock });
    const first = await outer.admit();
    const second = track(outer.admit());
    await clock.flush();
    expect(second.settled).toBe(false);
    await first.release("success");
    await clock.flush();
    expect(second.settled).toBe(true);
    expect(outer.snapshot().stages.map((s) => s.name)).toEqual(["outer", "inner-gate"]);
  });

  it("pauses a host on its interval gates", async () => {
    const { gate, hosts } = fiveStages();
    await gate.pause("a", 3000);
    const next = track(gate.run(async () => 1, { host: "a" }));
    await clock.advance(2999);
    expect(next.settled).toBe(false);
    await clock.advance(1);
    expect(next.settled).toBe(true);
    expect(hosts.snapshot().tokenWaitMs).toBe(3000);
  });

  it("reports the four numbers that localise a bottleneck", async () => {
    const { gate } = fiveStages();
    const calls = Array.from({ length: 3 }, () => gate.run(async () => 1, { host: "a" }));
    await clock.advance(5000);
    await Promise.all(calls);
    const s = gate.snapshot();
    expect(s).toMatchObject({ queueDepth: 0, shed: 0, permitWaitMs: 0, limit: 2 });
    expect(s.tokenWaitMs).toBe(1000 + 2000);
    expect(s.stages).toHaveLength(5);
  });

  it("keeps the caller's AsyncLocalStorage context inside the call", async () => {
    const { gate } = fiveStages();
    const als = new AsyncLocalStorage<number>();
    const seen: (number | undefined)[] = [];
    const calls = [1, 2, 3].map((n) => als.run(n, () => gate.run(async () => seen.push(als.getStore()))));
    await clock.advance(5000);
    await Promise.all(calls);
    expect(seen).toEqual([1, 2, 3]);
  });

  it("admits with tryAdmit only when every stage can, and takes nothing otherwise", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("rate", { capacity: 2, refillPerSecond: 1 });
    const sem = b.semaphore("inflight", { limit: 1 });
    const gate = new Gate([bucket, sem], { clock });
    const t = await gate.tryAdmit();
    expect(t).toBeDefined();
    expect(await gate.tryAdmit()).toBeUndefined(); // the semaphore refused: the token comes back
    expect(await bucket.tryAdmit()).toBeDefined();
    await t!.release();
  });

  it("rejects waiting and new calls after close", async () => {
    const { gate, sem } = fiveStages();
    const blocker = await sem.admit({ cost: 2 });
    const waiting = gate.run(async () => 1);
    await clock.advance(1000);
    await gate.close();
    await expect(waiting).rejects.toBeInstanceOf(ClosedError);
    await expect(gate.run(async () => 1)).rejects.toBeInstanceOf(ClosedError);
    await blocker.release();
  });

  it("refuses what is not a stage, naming its position", () => {
    expect(() => new Gate([{} as Stage])).toThrow("gate: stages.0 must be a stage");
  });
});
