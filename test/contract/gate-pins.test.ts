import {
  type AdmitOptions,
  AdmitTimeoutError,
  ClosedError,
  Gate,
  InvalidOptionsError,
  type Logger,
  memory,
  type Snapshot,
  type Stage,
  type Ticket,
  type TryAdmitOptions,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it, vi } from "vitest";
import { thrown } from "../thrown.js";

/**
 * What a Gate does that the other suites leave loose: its refusals (their field and message),
 * what it hands each stage (key, host, cost, costs, timeoutMs), its counters, its logs, and
 * what it gives back when a call fails part-way. Memory only: the Gate's own logic.
 */

/** The reason `p` rejects with, or fails. */
async function rejection(p: Promise<unknown>): Promise<unknown> {
  return p.then(
    () => {
      throw new Error("did not reject");
    },
    (error: unknown) => error,
  );
}

function expectInvalid(error: unknown, field: string, message: string): void {
  expect(error).toBeInstanceOf(InvalidOptionsError);
  expect((error as InvalidOptionsError).field).toBe(field);
  expect((error as InvalidOptionsError).message).toBe(message);
}

/** A promise whose settling settles `settled`, for watching a call without awaiting it. */
function watch<T>(p: Promise<T>) {
  const w = { settled: false, value: undefined as T | undefined, error: undefined as unknown };
  p.then(
    (v) => {
      w.settled = true;
      w.value = v;
    },
    (e: unknown) => {
      w.settled = true;
      w.error = e;
    },
  );
  return w;
}

function deferred<T>() {
  let resolve!: (v: T) => void;
  let reject!: (e: unknown) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}

interface Logged {
  level: string;
  bindings: Record<string, unknown>[];
  obj: object;
  msg: string | undefined;
}

/** A pino-shaped logger that records every line with the bindings of its child chain. */
function recordingLogger() {
  const lines: Logged[] = [];
  const children: Record<string, unknown>[] = [];
  const make = (bindings: Record<string, unknown>[]): Logger => {
    const at =
      (level: string) =>
      (obj: object, msg?: string): void => {
        lines.push({ level, bindings, obj, msg });
      };
    return {
      child: (b) => {
        children.push(b);
        return make([...bindings, b]);
      },
      debug: at("debug"),
      info: at("info"),
      warn: at("warn"),
      error: at("error"),
      isLevelEnabled: () => false,
    };
  };
  return { logger: make([]), lines, children };
}

const ZERO: Omit<Snapshot, "name" | "kind"> = {
  backend: "spy",
  inFlight: 0,
  waiting: 0,
  queueDepth: 0,
  shed: 0,
  admitted: 0,
  timedOut: 0,
  aborted: 0,
  tokenWaitMs: 0,
  permitWaitMs: 0,
  queueWaitMs: 0,
  leasesLost: 0,
  limit: Number.POSITIVE_INFINITY,
};

interface SpyTicket extends Ticket {
  released: boolean;
  outcome: string | undefined;
  refunded: boolean;
}

function spyTicket(stage: string, cost: number, refund: () => Promise<void> = () => Promise.resolve()) {
  const t: SpyTicket = {
    stage,
    cost,
    released: false,
    outcome: undefined,
    refunded: false,
    signal: new AbortController().signal,
    record: () => {},
    release: (outcome) => {
      t.released = true;
      t.outcome = outcome;
      return Promise.resolve();
    },
    refund: () => {
      t.released = true;
      t.refunded = true;
      return refund();
    },
    settle: () => Promise.resolve(),
    close: () => t.release(),
    [Symbol.asyncDispose]: () => t.release(),
  };
  return t;
}

/**
 * A stage of one's own that records what the Gate passes it. `admit` resolves at once with a
 * ticket unless `onAdmit` says otherwise.
 */
function spyStage(
  name: string,
  extra: {
    keyedBy?: "key" | "host";
    maxCost?: number;
    onAdmit?: (o: AdmitOptions | undefined) => Promise<Ticket>;
    onTryAdmit?: (o: TryAdmitOptions | undefined) => Promise<Ticket | undefined>;
  } = {},
) {
  const admits: (AdmitOptions | undefined)[] = [];
  const tryAdmits: (TryAdmitOptions | undefined)[] = [];
  const tickets: SpyTicket[] = [];
  let closes = 0;
  const issue = (o: AdmitOptions | undefined) => {
    const t = spyTicket(name, o?.cost ?? 1);
    tickets.push(t);
    return t;
  };
  const stage: Stage = {
    name,
    kind: "spy",
    holds: "call",
    keyedBy: extra.keyedBy,
    maxCost: extra.maxCost,
    admit: (o) => {
      admits.push(o);
      return extra.onAdmit ? extra.onAdmit(o) : Promise.resolve(issue(o));
    },
    tryAdmit: (o) => {
      tryAdmits.push(o);
      return extra.onTryAdmit ? extra.onTryAdmit(o) : Promise.resolve(issue(o));
    },
    snapshot: () => ({ name, kind: "spy", ...ZERO }),
    close: () => {
      closes++;
      return Promise.resolve();
    },
    [Symbol.asyncDispose]: () => Promise.resolve(),
  };
  return {
    stage,
    admits,
    tryAdmits,
    tickets,
    issue,
    get closes() {
      return closes;
    },
  };
}

/** A stage with `admitNow` that admits at once with `ticket`, or throws `error`. */
function nowStage(name: string, now: () => Ticket | undefined): Stage {
  return {
    name,
    kind: "now",
    holds: "call",
    admit: () => Promise.reject(new Error(`${name}: admit is not reached`)),
    tryAdmit: () => Promise.resolve(undefined),
    admitNow: now,
    snapshot: () => ({ name, kind: "now", ...ZERO }),
    close: () => Promise.resolve(),
    [Symbol.asyncDispose]: () => Promise.resolve(),
  };
}

describe("Gate pins", () => {
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock();
  });

  describe("building a gate", () => {
    it("refuses stages that are not an array, naming the field stages", () => {
      expectInvalid(
        thrown(() => new Gate(5 as never)),
        "stages",
        "gate: stages must be an array of stages, got 5 (number)",
      );
    });

    it("refuses an array that cannot be read, with the reason", () => {
      const hostile = new Proxy([], {
        get() {
          throw new Error("nope");
        },
      });
      expectInvalid(
        thrown(() => new Gate(hostile as never)),
        "stages",
        "gate: stages could not be read (nope)",
      );
    });

    it("refuses each kind of non-stage, naming its position", () => {
      const b = memory({ clock });
      const sem = b.semaphore("sem", { limit: 1 });
      const fnWithMethods = Object.assign(() => {}, { admit: () => {}, snapshot: () => {} });
      const noAdmit = { snapshot: () => {} };
      const noSnapshot = { admit: () => {} };
      const throwing = {
        get admit(): never {
          throw new Error("admit getter");
        },
        snapshot: () => {},
      };
      for (const bad of [fnWithMethods, noAdmit, noSnapshot, throwing, null]) {
        const error = thrown(() => new Gate([sem, bad] as never));
        expect(error).toBeInstanceOf(InvalidOptionsError);
        expect((error as InvalidOptionsError).field).toBe("stages.1");
        expect((error as InvalidOptionsError).message).toMatch(/^gate: stages\.1 must be a stage, got /);
      }
    });

    it("names the gate in an options error only when its name is a non-empty string", () => {
      const b = memory({ clock });
      const sem = b.semaphore("sem", { limit: 1 });
      const bad = (options: unknown) =>
        thrown(() => new Gate([sem], options as never)) as InvalidOptionsError;
      expect(bad({ name: "g", clock: 5 }).message).toMatch(/^gate "g": clock must be a Clock/);
      expect(bad({ name: "g", clock: 5 }).field).toBe("clock");
      expect(bad({ name: 5 }).message).toBe("gate: name must be a non-empty string, got 5 (number)");
      expect(bad({ name: "" }).message).toMatch(/^gate: name must be a non-empty string, /);
      expect(bad({ fuse: "yes" }).message).toBe('gate: fuse must be true or false, got "yes" (string)');
      expect(bad({ fuse: "yes" }).field).toBe("fuse");
      const hostile = new Proxy(
        {},
        {
          get() {
            throw new Error("trap");
          },
        },
      );
      expect(bad(hostile)).toBeInstanceOf(InvalidOptionsError);
    });

    it("is a stage of kind gate, keyed by key only when a stage of it (or of a gate in it) is", () => {
      const b = memory({ clock });
      const plain = new Gate([b.tokenBucket("plain", { capacity: 1, refillPerSecond: 1 })], { clock });
      const keyed = new Gate([b.tokenBucket("keyed", { capacity: 1, refillPerSecond: 1, keyed: true })], {
        clock,
      });
      const outer = new Gate([b.semaphore("sem", { limit: 1 }), keyed], { clock });
      const hosts = new Gate([b.intervalGate("hosts", { minIntervalMs: 1 })], { clock });
      expect(plain.kind).toBe("gate");
      expect(plain.keyedBy).toBeUndefined();
      expect(hosts.keyedBy).toBeUndefined();
      expect(keyed.keyedBy).toBe("key");
      expect(outer.keyedBy).toBe("key");
      expect(plain.snapshot()).toMatchObject({ name: "gate", kind: "gate", backend: "gate" });
    });

    it("logs through a child bound to the gate's name, kind and backend", async () => {
      const { logger, lines } = recordingLogger();
      const b = memory({ clock });
      const gate = new Gate([b.semaphore("sem", { limit: 1 })], { clock, logger, name: "g" });
      const job = await gate.enqueue(() => {
        throw new Error("job broke");
      });
      await expect(job.done).rejects.toThrow("job broke");
      await clock.flush();
      const line = lines.find((l) => l.msg === "enqueued job failed");
      expect(line?.level).toBe("warn");
      expect(line?.bindings).toEqual([{ stage: "g", kind: "gate", backend: "gate" }]);
      expect(line?.obj).toEqual({ err: expect.objectContaining({ message: "job broke" }) });
    });

    it("warns on its logger when its stages are out of order and taken in turn, never when fused", () => {
      const { logger, lines } = recordingLogger();
      const b = memory({ clock });
      const fused = new Gate(
        [b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 }), b.semaphore("sem", { limit: 1 })],
        { clock, logger, name: "g" },
      );
      expect(fused.fused).toBe(true);
      expect(lines.filter((l) => l.level === "warn")).toEqual([]);
      new Gate(
        [b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 }), b.semaphore("sem", { limit: 1 })],
        {
          clock,
          logger,
          name: "g",
          fuse: false,
        },
      );
      const warned = lines.filter((l) => l.level === "warn");
      expect(warned).toHaveLength(1);
      expect(warned[0]!.obj).toEqual({ gate: "g" });
      expect(warned[0]!.msg).toMatch(/^tokenBucket "rate" comes before semaphore "sem"/);
      lines.length = 0;
      new Gate(
        [b.semaphore("sem2", { limit: 1 }), b.tokenBucket("rate2", { capacity: 1, refillPerSecond: 1 })],
        {
          clock,
          logger,
          fuse: false,
        },
      );
      expect(lines.filter((l) => l.level === "warn")).toEqual([]);
    });
  });

  it("warns once per process when it has no logger, naming the gate", async () => {
    // A fresh copy of the modules: the process warning is given once per process.
    vi.resetModules();
    const fresh = await import("floodgate");
    const emit = vi.spyOn(process, "emitWarning").mockImplementation(() => {});
    try {
      const b = fresh.memory({ clock });
      new fresh.Gate(
        [b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 }), b.semaphore("sem", { limit: 1 })],
        { clock, name: "g", fuse: false },
      );
      expect(emit).toHaveBeenCalledTimes(1);
      expect(emit.mock.calls[0]![0]).toMatch(/^gate "g": tokenBucket "rate" comes before semaphore "sem"/);
      expect(emit.mock.calls[0]![1]).toEqual({ code: "FLOODGATE_STAGE_ORDER" });
    } finally {
      emit.mockRestore();
    }
  });

  describe("checking a call's options", () => {
    it("refuses a key no stage is keyed by, on admit, run and tryAdmit, before any stage is taken", async () => {
      const b = memory({ clock });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 })], {
        clock,
        name: "g",
      });
      const message =
        'gate "g": key given, got "k" (string), but no stage of the gate is keyed by it; build the token bucket with keyed: true';
      expectInvalid(await rejection(gate.admit({ key: "k" })), "key", message);
      expectInvalid(await rejection(gate.run(() => 1, { key: "k" })), "key", message);
      expectInvalid(await rejection(gate.tryAdmit({ key: "k" })), "key", message);
      expect(sem.snapshot()).toMatchObject({ inFlight: 0, admitted: 0 });
    });

    it("takes a key when a stage of a nested gate is keyed by it, and hands it there", async () => {
      const b = memory({ clock });
      const bucket = b.tokenBucket("keyed", { capacity: 1, refillPerSecond: 0.001, keyed: true });
      const gate = new Gate([b.semaphore("sem", { limit: 5 }), new Gate([bucket], { clock })], { clock });
      await gate.run(() => 1, { key: "a" });
      expect(await bucket.tryAdmit({ key: "a" })).toBeUndefined();
      expect(await bucket.tryAdmit({ key: "b" })).toBeDefined();
    });

    it("refuses costs naming no stage, listing the stages of the gate and of gates in it", async () => {
      const a = spyStage("a");
      const inner = new Gate([spyStage("deep").stage], { clock, name: "inner" });
      const gate = new Gate([a.stage, inner, spyStage("c").stage], { clock, name: "g" });
      const message =
        'gate "g": costs names "nope", which is no stage of the gate (its stages: a, inner, deep, c)';
      expectInvalid(await rejection(gate.admit({ costs: { a: 1, nope: 2 } })), "costs.nope", message);
      expectInvalid(await rejection(gate.tryAdmit({ costs: { nope: 2 } })), "costs.nope", message);
      expect(a.admits).toEqual([]);
      expect(a.tryAdmits).toEqual([]);
      // A stage of the nested gate may be named.
      await (await gate.admit({ costs: { deep: 3 } })).release("success");
    });

    it("refuses a cost above the smallest largest cost before any stage is taken", async () => {
      const b = memory({ clock });
      const first = spyStage("first");
      const gate = new Gate(
        [first.stage, b.semaphore("wide", { limit: 5 }), b.semaphore("narrow", { limit: 2 })],
        { clock },
      );
      expectInvalid(
        await rejection(gate.admit({ cost: 3 })),
        "cost",
        'semaphore "narrow": cost must be <= limit (2), got 3 (number); it could never be admitted',
      );
      expect(first.admits).toEqual([]);
      // At the bound itself the call goes through.
      const t = await gate.admit({ cost: 2 });
      expect(first.admits).toHaveLength(1);
      await t.release("success");
    });

    it("refuses a cost above the one bounded stage, whatever stages have no bound", async () => {
      const b = memory({ clock });
      const first = spyStage("first");
      const gate = new Gate([first.stage, b.semaphore("sem", { limit: 2 })], { clock });
      expect(await rejection(gate.run(() => 1, { cost: 3 }))).toBeInstanceOf(InvalidOptionsError);
      expect(first.admits).toEqual([]);
    });

    it("refuses a cost named in costs above its stage's bound before any stage is taken", async () => {
      const b = memory({ clock });
      const first = spyStage("first");
      const gate = new Gate([first.stage, b.semaphore("sem", { limit: 2 })], { clock });
      expectInvalid(
        await rejection(gate.admit({ costs: { sem: 3 } })),
        "costs.sem",
        'semaphore "sem": costs.sem must be <= limit (2), got 3 (number); it could never be admitted',
      );
      expect(first.admits).toEqual([]);
    });

    it("refuses a function that is not one, naming run or enqueue, and takes nothing", async () => {
      const b = memory({ clock });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock, name: "g" });
      expectInvalid(await rejection(gate.run(5 as never)), "fn", 'gate "g": run needs a function');
      expectInvalid(await rejection(gate.enqueue(5 as never)), "fn", 'gate "g": enqueue needs a function');
      expect(sem.snapshot()).toMatchObject({ inFlight: 0, admitted: 0 });
    });

    it("refuses a bad pause naming the gate", async () => {
      const gate = new Gate([], { clock, name: "g" });
      expectInvalid(
        await rejection(gate.pause("", 5)),
        "host",
        'gate "g": host must be a non-empty string, got "" (string)',
      );
    });
  });

  describe("what each stage is handed", () => {
    it("passes key only to stages keyed by it, costs only to gates, and no timeoutMs without one", async () => {
      const keyed = spyStage("keyed", { keyedBy: "key" });
      const plain = spyStage("plain");
      const gate = new Gate([keyed.stage, plain.stage], { clock });
      const t = await gate.admit({ key: "k", host: "h", cost: 2, costs: { plain: 5 } });
      expect(keyed.admits).toStrictEqual([
        { key: "k", host: "h", cost: 2, signal: undefined, timeoutMs: undefined, costs: undefined },
      ]);
      expect(plain.admits).toStrictEqual([
        { key: undefined, host: "h", cost: 5, signal: undefined, timeoutMs: undefined, costs: undefined },
      ]);
      await t.release("success");

      const u = await gate.tryAdmit({ key: "k", host: "h", cost: 2, costs: { plain: 5 } });
      expect(keyed.tryAdmits).toStrictEqual([{ key: "k", host: "h", cost: 2, costs: undefined }]);
      expect(plain.tryAdmits).toStrictEqual([{ key: undefined, host: "h", cost: 5, costs: undefined }]);
      await u!.release("success");
    });

    it("passes each stage what is left of the call's timeoutMs", async () => {
      const slow = spyStage("slow", {
        onAdmit: (o) =>
          new Promise((resolve) => clock.setTimeout(() => resolve(spyTicket("slow", o?.cost ?? 1)), 100)),
      });
      const next = spyStage("next");
      const gate = new Gate([slow.stage, next.stage], { clock });
      const signal = new AbortController().signal;
      const pending = gate.admit({ timeoutMs: 150, signal });
      await clock.advance(100);
      const t = await pending;
      expect(slow.admits[0]).toMatchObject({ timeoutMs: 150, signal });
      expect(next.admits[0]).toMatchObject({ timeoutMs: 50, signal });
      await t.release("success");
    });

    it("hands a nested gate the call's costs, on admit and tryAdmit", async () => {
      const deep = spyStage("deep");
      const outer = new Gate([new Gate([deep.stage], { clock })], { clock });
      await (await outer.admit({ costs: { deep: 7 } })).release("success");
      expect(deep.admits[0]?.cost).toBe(7);
      await (await outer.tryAdmit({ costs: { deep: 8 } }))!.release("success");
      expect(deep.tryAdmits[0]?.cost).toBe(8);
    });
  });

  describe("a call that fails at a stage it awaits", () => {
    it("counts neither a timeout nor an abort for another error, and gives back what it took", async () => {
      const first = spyStage("first");
      const boom = new Error("boom");
      const second = spyStage("second", { onAdmit: () => Promise.reject(boom) });
      const gate = new Gate([first.stage, second.stage], { clock });
      expect(await rejection(gate.admit())).toBe(boom);
      expect(first.tickets[0]!.refunded).toBe(true);
      expect(gate.snapshot()).toMatchObject({ timedOut: 0, aborted: 0, waiting: 0, inFlight: 0 });
    });

    it("rejects with exactly what the stage rejected with, null included", async () => {
      const gate = new Gate([spyStage("nulls", { onAdmit: () => Promise.reject(null) }).stage], { clock });
      expect(await rejection(gate.admit())).toBeNull();
      expect(gate.snapshot()).toMatchObject({ timedOut: 0, aborted: 0 });
    });

    it("counts a timeout at the stage", async () => {
      const timeout = new AdmitTimeoutError("slow", "slow: timed out");
      const gate = new Gate([spyStage("slow", { onAdmit: () => Promise.reject(timeout) }).stage], { clock });
      expect(await rejection(gate.admit({ timeoutMs: 10 }))).toBe(timeout);
      expect(gate.snapshot()).toMatchObject({ timedOut: 1, aborted: 0 });
    });

    it("gives back a ticket that arrives after an abort, and counts the abort", async () => {
      const d = deferred<Ticket>();
      const gate = new Gate([spyStage("late", { onAdmit: () => d.promise }).stage], { clock });
      const controller = new AbortController();
      const pending = watch(gate.admit({ signal: controller.signal }));
      await clock.flush();
      expect(gate.snapshot().waiting).toBe(1);
      controller.abort();
      const ticket = spyTicket("late", 1);
      d.resolve(ticket);
      await clock.flush();
      expect(pending.error).toBe(controller.signal.reason);
      expect(ticket.refunded).toBe(true);
      expect(gate.snapshot()).toMatchObject({ aborted: 1, timedOut: 0, waiting: 0, inFlight: 0 });
    });

    it("counts what the stage rejected with, not an abort, when the stage fails on its own after an abort", async () => {
      const d = deferred<Ticket>();
      const gate = new Gate([spyStage("deaf", { onAdmit: () => d.promise }).stage], { clock });
      const controller = new AbortController();
      const pending = watch(gate.admit({ signal: controller.signal }));
      await clock.flush();
      controller.abort(); // the stage does not listen: it times out on its own
      const timeout = new AdmitTimeoutError("deaf", "deaf: timed out");
      d.reject(timeout);
      await clock.flush();
      expect(pending.error).toBe(timeout);
      expect(gate.snapshot()).toMatchObject({ aborted: 0, timedOut: 1, waiting: 0 });
    });

    it("gives back a ticket that arrives after the gate closed, and closes each stage once", async () => {
      const d = deferred<Ticket>();
      const late = spyStage("late", { onAdmit: () => d.promise });
      const gate = new Gate([late.stage], { clock });
      const pending = watch(gate.admit());
      await clock.flush();
      await gate.close();
      await gate.close();
      expect(late.closes).toBe(1);
      const ticket = spyTicket("late", 1);
      d.resolve(ticket);
      await clock.flush();
      expect(pending.error).toBeInstanceOf(ClosedError);
      expect(ticket.refunded).toBe(true);
      expect(gate.snapshot()).toMatchObject({ inFlight: 0, admitted: 0, aborted: 0, timedOut: 0 });
    });

    it("logs a refund that fails, and rejects with the call's own error", async () => {
      const { logger, lines } = recordingLogger();
      const refundError = new Error("refund broke");
      const first = spyStage("first", {
        onAdmit: () => Promise.resolve(spyTicket("first", 1, () => Promise.reject(refundError))),
      });
      const boom = new Error("boom");
      const gate = new Gate(
        [first.stage, spyStage("second", { onAdmit: () => Promise.reject(boom) }).stage],
        {
          clock,
          logger,
        },
      );
      expect(await rejection(gate.admit())).toBe(boom);
      const line = lines.find((l) => l.msg === "refund failed");
      expect(line?.level).toBe("warn");
      expect(line?.obj).toEqual({ err: refundError });
    });

    it("does not overcount a tryAdmit whose stage throws: it rejects and gives back the rest", async () => {
      const first = spyStage("first");
      const boom = new Error("boom");
      const gate = new Gate(
        [first.stage, spyStage("second", { onTryAdmit: () => Promise.reject(boom) }).stage],
        {
          clock,
        },
      );
      expect(await rejection(gate.tryAdmit())).toBe(boom);
      expect(first.tickets[0]!.refunded).toBe(true);
      expect(gate.snapshot()).toMatchObject({ inFlight: 0, admitted: 0 });
    });
  });

  describe("a call waiting in a memory stage's line", () => {
    it("counts a timeout in the line as a timeout, not an abort, and never calls fn", async () => {
      const b = memory({ clock });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock });
      const blocker = await sem.admit();
      const fn = vi.fn(() => 1);
      const pending = watch(gate.run(fn, { timeoutMs: 100 }));
      await clock.advance(99);
      expect(pending.settled).toBe(false);
      expect(gate.snapshot().waiting).toBe(1);
      await clock.advance(1);
      expect(pending.error).toBeInstanceOf(AdmitTimeoutError);
      expect(fn).not.toHaveBeenCalled();
      expect(gate.snapshot()).toMatchObject({ timedOut: 1, aborted: 0, waiting: 0 });
      await blocker.release();
    });

    it("counts neither when the gate closes on the line", async () => {
      const b = memory({ clock });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock });
      await sem.admit();
      const pending = watch(gate.run(() => 1, { timeoutMs: 1000 }));
      await clock.flush();
      await gate.close();
      await clock.flush();
      expect(pending.error).toBeInstanceOf(ClosedError);
      expect(gate.snapshot()).toMatchObject({ timedOut: 0, aborted: 0, waiting: 0 });
    });

    it("gives back a permit granted just before the gate closed, and never calls fn", async () => {
      const b = memory({ clock });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock });
      const blocker = await sem.admit();
      const fn = vi.fn(() => 1);
      const pending = watch(gate.run(fn));
      await clock.flush();
      void blocker.release("success"); // grants the gate's call; it goes on in a later microtask
      void gate.close();
      await clock.flush();
      expect(pending.error).toBeInstanceOf(ClosedError);
      expect(fn).not.toHaveBeenCalled();
      expect(sem.snapshot().inFlight).toBe(0);
      expect(gate.snapshot()).toMatchObject({ inFlight: 0, admitted: 0, waiting: 0 });
    });

    it("waits in the line itself rather than through the stage's admit", async () => {
      const b = memory({ clock });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock });
      const blocker = await sem.admit();
      const admit = vi.spyOn(sem, "admit");
      const pending = watch(gate.run(() => "ran"));
      await clock.flush();
      expect(sem.snapshot().waiting).toBe(1);
      await blocker.release("success");
      await clock.flush();
      expect(pending.value).toBe("ran");
      expect(admit).not.toHaveBeenCalled();
    });

    it("logs its timeout at the stage as the stage's own call does, with no key", async () => {
      const { logger, lines } = recordingLogger();
      const b = memory({ clock, logger });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([sem], { clock });
      const blocker = await sem.admit();
      const viaGate = watch(gate.run(() => 1, { timeoutMs: 10 }));
      const direct = watch(sem.admit({ timeoutMs: 10 }));
      await clock.advance(10);
      expect(viaGate.error).toBeInstanceOf(AdmitTimeoutError);
      expect(direct.error).toBeInstanceOf(AdmitTimeoutError);
      const timedOut = lines.filter((l) => l.msg === "admission timed out").map((l) => l.obj);
      expect(timedOut).toEqual([
        { key: "", cost: 1, timeoutMs: 10 },
        { key: "", cost: 1, timeoutMs: 10 },
      ]);
      await blocker.release();
    });
  });

  describe("a stage whose admitNow throws", () => {
    it("rejects with exactly what it threw, null included", async () => {
      const gate = new Gate(
        [
          nowStage("throws", () => {
            throw null;
          }),
        ],
        { clock },
      );
      expect(await rejection(gate.run(() => 1))).toBeNull();
      expect(await rejection(gate.admit())).toBeNull();
      expect(gate.snapshot()).toMatchObject({ timedOut: 0, aborted: 0, inFlight: 0 });
    });

    it("rejects only once what the gate held is given back", async () => {
      const refund = deferred<void>();
      const held = spyTicket("held", 1, () => refund.promise);
      const boom = new Error("boom");
      const fn = vi.fn(() => 1);
      const gate = new Gate(
        [
          nowStage("held", () => held),
          nowStage("throws", () => {
            throw boom;
          }),
        ],
        { clock },
      );
      const pending = watch(gate.run(fn));
      await clock.flush();
      expect(held.refunded).toBe(true);
      expect(pending.settled).toBe(false);
      refund.resolve();
      await clock.flush();
      expect(pending.error).toBe(boom);
      expect(fn).not.toHaveBeenCalled();
    });

    it("logs a refund that fails, and rejects with what admitNow threw", async () => {
      const { logger, lines } = recordingLogger();
      const refundError = new Error("refund broke");
      const boom = new Error("boom");
      const gate = new Gate(
        [
          nowStage("held", () => spyTicket("held", 1, () => Promise.reject(refundError))),
          nowStage("throws", () => {
            throw boom;
          }),
        ],
        { clock, logger },
      );
      expect(await rejection(gate.admit())).toBe(boom);
      const line = lines.find((l) => l.msg === "refund failed");
      expect(line?.level).toBe("warn");
      expect(line?.obj).toEqual({ err: refundError });
    });
  });

  describe("the bounded queues of a gate", () => {
    it("gives the slot back once the call starts, when the gate has only queues", async () => {
      const b = memory({ clock });
      const queue = b.queue("q", { maxSize: 1 });
      const gate = new Gate([queue], { clock });
      let depth = -1;
      await gate.run(() => {
        depth = queue.snapshot().queueDepth;
      });
      expect(depth).toBe(0);
    });

    it("holds, and releases, only the stages after its queues", async () => {
      const b = memory({ clock });
      const q1 = b.queue("q1", { maxSize: 1 });
      const q2 = b.queue("q2", { maxSize: 1 });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([q1, q2, sem], { clock });
      const ticket = await gate.admit();
      expect(q1.snapshot().queueDepth).toBe(0);
      expect(q2.snapshot().queueDepth).toBe(0);
      expect(sem.snapshot().inFlight).toBe(1);
      // A queue the call has left does not abort its ticket; the semaphore it holds does.
      const signal = ticket.signal;
      await q1.close();
      expect(signal.aborted).toBe(false);
      await sem.close();
      expect(signal.aborted).toBe(true);
      await ticket.release("success");
      expect(sem.snapshot().inFlight).toBe(0);
      await expect(gate.run(() => "ok")).rejects.toBeInstanceOf(ClosedError);
    });

    it("runs a call through two queues and a semaphore and releases all", async () => {
      const b = memory({ clock });
      const sem = b.semaphore("sem", { limit: 1 });
      const gate = new Gate([b.queue("q1", { maxSize: 1 }), b.queue("q2", { maxSize: 1 }), sem], { clock });
      await expect(gate.run(() => "ok")).resolves.toBe("ok");
      expect(sem.snapshot().inFlight).toBe(0);
      expect(gate.snapshot()).toMatchObject({ inFlight: 0, admitted: 1 });
    });
  });

  describe("closedSignal", () => {
    it("is one signal, aborted with ClosedError once the gate closes", async () => {
      const gate = new Gate([], { clock, name: "g" });
      const signal = gate.closedSignal;
      expect(gate.closedSignal).toBe(signal);
      expect(signal.aborted).toBe(false);
      await gate.close();
      expect(signal.aborted).toBe(true);
      expect(signal.reason).toBeInstanceOf(ClosedError);
      const late = new Gate([], { clock });
      await late.close();
      expect(late.closedSignal.aborted).toBe(true);
    });
  });
});
