import { Gate, InvalidOptionsError } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { backends, useBackend } from "./backends.js";

/**
 * What a new user might pass, and the field the error must name. Each row builds a stage with
 * one bad value on top of good options; construction must throw InvalidOptionsError naming the
 * field, with the value received in the message.
 */
const BAD_VALUES: [string, unknown][] = [
  ["a string", "8"],
  ["a negative", -1],
  ["NaN", Number.NaN],
  ["Infinity", Number.POSITIVE_INFINITY],
  ["null", null],
  ["an object", {}],
  ["huge", 2 ** 53],
  ["a fraction", 1.5],
];

type Kind = "semaphore" | "tokenBucket" | "queue" | "intervalGate" | "aimd";
const GOOD: Record<Kind, Record<string, unknown>> = {
  semaphore: { limit: 4 },
  tokenBucket: { capacity: 10, refillPerSecond: 2 },
  queue: { maxSize: 10 },
  intervalGate: { minIntervalMs: 100 },
  aimd: { initial: 4, min: 1, max: 8 },
};

/** Fields and the bad values each must refuse (some values are fine for some fields). */
const FIELDS: [Kind, string, string[]][] = [
  [
    "semaphore",
    "limit",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  [
    "semaphore",
    "leaseMs",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  [
    "tokenBucket",
    "capacity",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  ["tokenBucket", "refillPerSecond", ["a string", "a negative", "NaN", "Infinity", "null", "an object"]],
  [
    "tokenBucket",
    "initialTokens",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  ["tokenBucket", "penalty", ["a string", "a negative", "NaN", "Infinity", "null", "huge", "a fraction"]],
  [
    "queue",
    "maxSize",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  [
    "queue",
    "whenFull",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  ["intervalGate", "minIntervalMs", ["a string", "a negative", "NaN", "Infinity", "null", "an object"]],
  ["intervalGate", "jitterMs", ["a string", "a negative", "NaN", "Infinity", "null", "an object"]],
  [
    "intervalGate",
    "random",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  [
    "aimd",
    "initial",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  ["aimd", "min", ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"]],
  ["aimd", "max", ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"]],
  [
    "aimd",
    "backoffRatio",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  ["aimd", "slowCallMs", ["a string", "a negative", "NaN", "Infinity", "null", "an object"]],
  ["semaphore", "onBackendError", ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge"]],
  [
    "semaphore",
    "localShare",
    ["a string", "a negative", "NaN", "Infinity", "null", "an object", "huge", "a fraction"],
  ],
  ["semaphore", "clock", ["a string", "a negative", "NaN", "null", "an object"]],
  ["semaphore", "logger", ["a string", "a negative", "NaN", "null", "an object"]],
];

const rows = FIELDS.flatMap(([kind, field, names]) =>
  names.map((name) => [kind, field, name, BAD_VALUES.find(([n]) => n === name)![1]] as const),
);

describe.each(backends)("bad options on $name", (backend) => {
  useBackend(backend);

  it.each(rows)("%s refuses %s given %s", (kind, field, _name, value) => {
    const b = backend.make(new FakeClock());
    const options = { ...GOOD[kind], [field]: value };
    let error: unknown;
    try {
      (b[kind] as (name: string, options: unknown) => unknown)("bad", options);
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(InvalidOptionsError);
    const e = error as InvalidOptionsError;
    expect(e.field.split(".")[0]).toBe(field);
    expect(e.message).toContain(`${kind} "bad": ${field}`);
    expect(e.message).toMatch(/, got .*$/);
  });

  it("refuses options that are not an object, and an unknown option, naming it", () => {
    const b = backend.make(new FakeClock());
    expect(() => b.semaphore("bad", null as never)).toThrow(InvalidOptionsError);
    expect(() => b.semaphore("bad", 8 as never)).toThrow(InvalidOptionsError);
    expect(() =>
      b.tokenBucket("bad", { capacity: 1, refillPerSecond: 1, refilPerSecond: 2 } as never),
    ).toThrow('tokenBucket "bad": unknown option "refilPerSecond"');
  });

  it("refuses bad admit arguments at once, naming the field", async () => {
    const b = backend.make(new FakeClock());
    const sem = b.semaphore("args", { limit: 2 });
    for (const [field, options] of [
      ["cost", { cost: -1 }],
      ["cost", { cost: 0.5 }],
      ["cost", { cost: "1" }],
      ["cost", { cost: 3 }],
      ["timeoutMs", { timeoutMs: -5 }],
      ["timeoutMs", { timeoutMs: Number.NaN }],
      ["timeoutMs", { timeoutMs: null }],
      ["timeoutMs", { timeoutMs: "5" }],
      ["timeoutMs", { timeoutMs: true }],
      ["timeoutMs", { timeoutMs: 10n }],
      ["cost", { cost: 1n }],
      ["cost", { cost: null }],
      ["signal", { signal: {} }],
      ["signal", { signal: null }],
      ["key", { key: "" }],
      ["key", { key: 7 }],
      ["host", { host: null }],
      ["costs", { costs: [1] }],
      ["costs.args", { costs: { args: -1 } }],
    ] as const) {
      // A promise-returning call never throws synchronously, whatever it is given.
      const promise = sem.admit(options as never);
      const error: unknown = await promise.catch((e) => e);
      expect(error, String(Object.keys(options))).toBeInstanceOf(InvalidOptionsError);
      const e = error as InvalidOptionsError;
      expect(e.field).toBe(field);
      expect(e.message).toContain(`semaphore "args": ${field} `);
      expect(e.message).toMatch(/, got .*/);
    }
    // classify is for run: refused on admit, and checked on run.
    const onAdmit = await sem.admit({ classify: () => "success" } as never).catch((e) => e);
    expect(onAdmit).toBeInstanceOf(InvalidOptionsError);
    expect(onAdmit.message).toBe(
      'semaphore "args": admit takes no classify (only run and enqueue call a function)',
    );
    const onRun = await sem.run!(() => 1, { classify: "success" } as never).catch((e) => e);
    expect(onRun).toBeInstanceOf(InvalidOptionsError);
    expect(onRun.message).toBe(
      'semaphore "args": classify must be a function (settled) => outcome, got "success" (string)',
    );
    expect(sem.snapshot()).toMatchObject({ waiting: 0, inFlight: 0 });
    const ticket = await sem.admit();
    await expect(ticket.release("maybe" as never)).rejects.toBeInstanceOf(InvalidOptionsError);
    expect(() => ticket.record(Symbol("x") as never)).toThrow(", got Symbol(x) (symbol)");
    await expect(ticket.settle(null as never)).rejects.toMatchObject({ field: "actual" });
    await expect(ticket.settle(undefined as never)).rejects.toMatchObject({ field: "actual" });
    await ticket.release("success");
    // Both permits are still there.
    const both = await Promise.all([sem.tryAdmit(), sem.tryAdmit()]);
    expect(both.every(Boolean)).toBe(true);
    expect(await sem.tryAdmit()).toBeUndefined();
    for (const t of both) await t!.release();
  });

  it("names the field when an option is a BigInt, a Symbol or an object whose toString throws", () => {
    const b = backend.make(new FakeClock());
    const hostile = {
      toString: () => {
        throw new Error("no");
      },
      valueOf: () => {
        throw new Error("no");
      },
    };
    for (const [kind, field, value] of [
      ["semaphore", "limit", 4n],
      ["tokenBucket", "capacity", Symbol("cap")],
      ["intervalGate", "minIntervalMs", hostile],
      ["aimd", "initial", Object.create(null)],
    ] as const) {
      let error: unknown;
      try {
        (b[kind] as (name: string, options: unknown) => unknown)("hostile", {
          ...GOOD[kind],
          [field]: value,
        });
      } catch (e) {
        error = e;
      }
      expect(error, `${kind}.${field}`).toBeInstanceOf(InvalidOptionsError);
      expect((error as InvalidOptionsError).field).toBe(field);
      expect((error as InvalidOptionsError).message).toMatch(/, got .*$/);
    }
  });

  it("rejects bad pause arguments on both backends alike, and a gate's pause too", async () => {
    const b = backend.make(new FakeClock());
    const hosts = b.intervalGate("pauses", { minIntervalMs: 10 });
    const gate = new Gate([b.semaphore("pauses-sem", { limit: 1 })]);
    for (const [host, ms, field] of [
      ["", 5, "host"],
      [7, 5, "host"],
      ["h", -1, "ms"],
      ["h", Number.NaN, "ms"],
      ["h", Number.POSITIVE_INFINITY, "ms"],
      ["h", 5n, "ms"],
      ["h", "5", "ms"],
    ] as const) {
      for (const target of [hosts, gate]) {
        const promise = target.pause(host as never, ms as never);
        await expect(promise).rejects.toMatchObject({ code: "INVALID_OPTIONS", field });
      }
    }
  });
});
