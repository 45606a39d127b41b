import diagnostics_channel from "node:diagnostics_channel";
import { CHANNELS, Gate, InvalidOptionsError, memory } from "floodgate";
import { instrument } from "floodgate/otel";
import { FakeClock } from "floodgate/testing";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { backends, track, useBackend } from "../contract/backends.js";
import { pointOf, seriesOf, TestMetrics } from "./reader.js";

/**
 * `instrument` read back through the SDK's own reader: exact counts, histogram counts and sums,
 * calls in flight and waiting as they go up and down, on every backend; then what only memory
 * needs to show (AIMD, classes, a queue that sheds, a gate, a drain, close).
 */

const at = (stage: string, kind: string, backend: string, more: Record<string, string> = {}) => ({
  "floodgate.stage.name": stage,
  "floodgate.stage.kind": kind,
  "floodgate.backend": backend,
  ...more,
});

let m: TestMetrics;
let clock: FakeClock;
beforeEach(() => {
  m = new TestMetrics();
  clock = new FakeClock(1_000);
});
afterEach(async () => {
  await m.shutdown();
});

describe.each(backends)("instrument on $name", (backend) => {
  useBackend(backend);
  const where = backend.name === "memory" ? "memory" : "redis";

  it("counts admissions and refusals, times waits and service, and follows calls in flight and waiting", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("sem", { limit: 2 });
    using _ = instrument(sem, { meterProvider: m.provider });
    const a = at("sem", "semaphore", where);

    const first = await sem.admit();
    const second = await sem.admit();
    const third = track(sem.admit());
    await clock.flush();
    let seen = await m.collect();
    expect(pointOf(seen, "floodgate.call.active", a)).toBe(2);
    expect(pointOf(seen, "floodgate.call.waiting", a)).toBe(1);
    expect(pointOf(seen, "floodgate.permit.limit", a)).toBe(2);

    await clock.advance(40);
    await first.release("success");
    await clock.flush();
    await until(() => third.settled);
    const late = track(sem.admit({ timeoutMs: 10 }));
    const controller = new AbortController();
    const aborted = track(sem.admit({ signal: controller.signal }));
    await clock.flush();
    controller.abort();
    await clock.advance(10);
    await until(() => late.settled && aborted.settled);
    expect(late.error).toMatchObject({ code: "ADMIT_TIMEOUT" });

    seen = await m.collect();
    expect(pointOf(seen, "floodgate.admissions", a)).toBe(3);
    expect(pointOf(seen, "floodgate.refusals", { ...a, "floodgate.refusal.reason": "timeout" })).toBe(1);
    expect(pointOf(seen, "floodgate.refusals", { ...a, "floodgate.refusal.reason": "abort" })).toBe(1);
    expect(pointOf(seen, "floodgate.refusals", { ...a, "floodgate.refusal.reason": "drain" })).toBe(0);
    expect(pointOf(seen, "floodgate.sheds", a)).toBe(0);
    expect(pointOf(seen, "floodgate.call.active", a)).toBe(2);
    expect(pointOf(seen, "floodgate.call.waiting", a)).toBe(0);
    const wait = pointOf(seen, "floodgate.admission.wait.duration", a) as { count: number; sum: number };
    expect(wait.count).toBe(3);
    const held = pointOf(seen, "floodgate.call.duration", { ...a, "floodgate.call.outcome": "success" }) as {
      count: number;
      sum: number;
    };
    expect(held.count).toBe(1);
    if (backend.name === "memory") {
      // Two admitted at once, one after 40 ms; the first held its ticket those 40 ms.
      expect(wait.sum).toBe(0.04);
      expect(held.sum).toBe(0.04);
    } else {
      expect(wait.sum).toBeGreaterThanOrEqual(0.04);
      expect(held.sum).toBeGreaterThanOrEqual(0.04);
    }

    await second.release("dropped");
    await (third.value as Awaited<ReturnType<typeof sem.admit>>).release("success");
    seen = await m.collect();
    expect(pointOf(seen, "floodgate.call.active", a)).toBe(0);
    expect(
      (
        pointOf(seen, "floodgate.call.duration", { ...a, "floodgate.call.outcome": "success" }) as {
          count: number;
        }
      ).count,
    ).toBe(2);
    expect(
      (
        pointOf(seen, "floodgate.call.duration", { ...a, "floodgate.call.outcome": "dropped" }) as {
          count: number;
        }
      ).count,
    ).toBe(1);
    await b.close();
  });
});

describe.each(backends)("instrument of a stage with classes on $name", (backend) => {
  useBackend(backend);
  const where = backend.name === "memory" ? "memory" : "redis";

  it("names the class of each admission, wait and release", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("llm", { limit: 2, classes: { interactive: { share: 1 }, bulk: { share: 1 } } });
    using _ = instrument(sem, { meterProvider: m.provider });
    const interactive = at("llm", "semaphore", where, { "floodgate.class": "interactive" });
    const bulk = at("llm", "semaphore", where, { "floodgate.class": "bulk" });
    await (await sem.admit({ class: "interactive" })).release("success");
    await (await sem.admit({ class: "bulk" })).release("dropped");
    await (await sem.admit({ class: "bulk" })).release("success");
    const seen = await m.collect();
    expect(pointOf(seen, "floodgate.admissions", interactive)).toBe(1);
    expect(pointOf(seen, "floodgate.admissions", bulk)).toBe(2);
    expect(pointOf(seen, "floodgate.call.active", bulk)).toBe(0);
    expect(pointOf(seen, "floodgate.admission.wait.duration", bulk)).toMatchObject({ count: 2 });
    expect(
      pointOf(seen, "floodgate.call.duration", { ...bulk, "floodgate.call.outcome": "dropped" }),
    ).toMatchObject({ count: 1 });
    expect(pointOf(seen, "floodgate.permit.limit", at("llm", "semaphore", where))).toBe(2);
    await b.close();
  });
});

/** Let Redis replies and timers' follow-ups land until `done` holds (no real wait is asserted). */
async function until(done: () => boolean): Promise<void> {
  for (let i = 0; i < 500 && !done(); i++) {
    await clock.flush();
    await new Promise((resolve) => setImmediate(resolve));
  }
  expect(done()).toBe(true);
}

describe("instrument in memory", () => {
  it("reports an AIMD limiter's limit after a decrease", async () => {
    const aimd = memory({ clock }).aimd("adaptive", { initial: 10, min: 1, max: 20 });
    using _ = instrument(aimd, { meterProvider: m.provider });
    const a = at("adaptive", "aimd", "memory");
    expect(await m.value("floodgate.permit.limit", a)).toBe(10);
    await (await aimd.admit()).release("dropped");
    expect(await m.value("floodgate.permit.limit", a)).toBe(9);
  });

  it("splits a classed stage's admissions, calls in flight, waiting calls and waits by class", async () => {
    const sem = memory({ clock }).semaphore("llm", {
      limit: 2,
      classes: { interactive: { share: 1 }, bulk: { share: 1 } },
    });
    using _ = instrument(sem, { meterProvider: m.provider });
    const interactive = at("llm", "semaphore", "memory", { "floodgate.class": "interactive" });
    const bulk = at("llm", "semaphore", "memory", { "floodgate.class": "bulk" });
    const one = await sem.admit({ class: "interactive" });
    const two = await sem.admit({ class: "interactive" });
    const three = sem.admit({ class: "bulk" });
    await clock.flush();
    let seen = await m.collect();
    expect(pointOf(seen, "floodgate.admissions", interactive)).toBe(2);
    expect(pointOf(seen, "floodgate.admissions", bulk)).toBe(0);
    expect(pointOf(seen, "floodgate.call.active", interactive)).toBe(2);
    expect(pointOf(seen, "floodgate.call.waiting", bulk)).toBe(1);
    await clock.advance(25);
    await one.release("success");
    await (await three).release("success");
    await two.release("success");
    seen = await m.collect();
    expect(pointOf(seen, "floodgate.admissions", bulk)).toBe(1);
    expect(pointOf(seen, "floodgate.admission.wait.duration", bulk)).toMatchObject({ count: 1, sum: 0.025 });
    expect(pointOf(seen, "floodgate.admission.wait.duration", interactive)).toMatchObject({
      count: 2,
      sum: 0,
    });
    expect(
      pointOf(seen, "floodgate.call.duration", { ...interactive, "floodgate.call.outcome": "success" }),
    ).toMatchObject({ count: 2, sum: 0.05 });
    // Refusals, sheds and the limit are the stage's, with no class.
    expect(pointOf(seen, "floodgate.permit.limit", at("llm", "semaphore", "memory"))).toBe(2);
  });

  it("counts a full queue's sheds", async () => {
    const queue = memory({ clock }).queue("jobs", { maxSize: 1, whenFull: "shed" });
    using _ = instrument([queue], { meterProvider: m.provider });
    const held = await queue.admit();
    await expect(queue.admit()).rejects.toMatchObject({ code: "SHED" });
    await expect(queue.admit()).rejects.toMatchObject({ code: "SHED" });
    const a = at("jobs", "queue", "memory");
    const seen = await m.collect();
    expect(pointOf(seen, "floodgate.sheds", a)).toBe(2);
    expect(pointOf(seen, "floodgate.admissions", a)).toBe(1);
    expect(pointOf(seen, "floodgate.permit.limit", a)).toBe(1);
    await held.release("success");
  });

  it("measures a gate as a stage of kind gate, and each of its stages", async () => {
    const b = memory({ clock });
    const gate = new Gate([
      b.semaphore("inflight", { limit: 4 }),
      b.tokenBucket("rate", { capacity: 10, refillPerSecond: 1 }),
    ]);
    using _ = instrument(gate, { meterProvider: m.provider });
    await gate.run(async () => "ok");
    await gate.run(async () => "ok");
    const seen = await m.collect();
    expect(seriesOf(seen, "floodgate.admissions")).toEqual([
      at("gate", "gate", "gate"),
      at("inflight", "semaphore", "memory"),
      at("rate", "tokenBucket", "memory"),
    ]);
    for (const series of seriesOf(seen, "floodgate.admissions")) {
      expect(pointOf(seen, "floodgate.admissions", series)).toBe(2);
    }
    // The limit where one applies: the semaphore's, and the gate's (its smallest); a bucket has none.
    expect(seriesOf(seen, "floodgate.permit.limit")).toEqual([
      at("gate", "gate", "gate"),
      at("inflight", "semaphore", "memory"),
    ]);
    expect(
      pointOf(seen, "floodgate.admission.wait.duration", at("rate", "tokenBucket", "memory")),
    ).toMatchObject({ count: 2, sum: 0 });
  });

  it("counts the waiting calls a drain rejects as refusals", async () => {
    const sem = memory({ clock }).semaphore("sem", { limit: 1 });
    using _ = instrument(sem, { meterProvider: m.provider });
    const held = await sem.admit();
    const waiters = [track(sem.admit()), track(sem.admit())];
    await clock.flush();
    const drained = sem.drain({ graceMs: 100 });
    await held.release("success");
    expect(await drained).toMatchObject({ rejected: 2, completed: 1 });
    expect(waiters.map((w) => (w.error as { code?: string })?.code)).toEqual(["DRAINING", "DRAINING"]);
    expect(
      await m.value("floodgate.refusals", {
        ...at("sem", "semaphore", "memory"),
        "floodgate.refusal.reason": "drain",
      }),
    ).toBe(2);
  });

  it("names the units and instrument types", async () => {
    const sem = memory({ clock }).semaphore("sem", { limit: 1 });
    using _ = instrument(sem, { meterProvider: m.provider });
    await (await sem.admit()).release("success");
    const seen = await m.collect();
    expect(Object.fromEntries([...seen.values()].map((c) => [c.name, `${c.type} ${c.unit}`]))).toEqual({
      "floodgate.admission.wait.duration": "histogram s",
      "floodgate.call.duration": "histogram s",
      "floodgate.admissions": "counter {call}",
      "floodgate.refusals": "counter {call}",
      "floodgate.sheds": "counter {call}",
      "floodgate.call.active": "up-down counter {call}",
      "floodgate.call.waiting": "up-down counter {call}",
      "floodgate.permit.limit": "gauge {permit}",
    });
  });

  it("stops measuring on close: no more observations, no subscriber left", async () => {
    const sem = memory({ clock }).semaphore("sem", { limit: 1 });
    const handle = instrument(sem, { meterProvider: m.provider });
    expect(diagnostics_channel.hasSubscribers(CHANNELS.release)).toBe(true);
    await (await sem.admit()).release("success");
    handle.close();
    handle.close();
    for (const name of Object.values(CHANNELS))
      expect(diagnostics_channel.hasSubscribers(name), name).toBe(false);
    await (await sem.admit()).release("success");
    const seen = await m.collect();
    expect(seriesOf(seen, "floodgate.admissions")).toEqual([]);
    expect(
      pointOf(seen, "floodgate.call.duration", {
        ...at("sem", "semaphore", "memory"),
        "floodgate.call.outcome": "success",
      }),
    ).toMatchObject({ count: 1 });
  });

  it("leaves out stages it was not given", async () => {
    const b = memory({ clock });
    const mine = b.semaphore("mine", { limit: 1 });
    const other = b.semaphore("other", { limit: 1 });
    using _ = instrument(mine, { meterProvider: m.provider });
    await (await other.admit()).release("success");
    await (await mine.admit()).release("success");
    const seen = await m.collect();
    const a = at("mine", "semaphore", "memory");
    expect(seriesOf(seen, "floodgate.admissions")).toEqual([a]);
    expect(seriesOf(seen, "floodgate.admission.wait.duration")).toEqual([a]);
    expect(seriesOf(seen, "floodgate.call.duration")).toEqual([
      { ...a, "floodgate.call.outcome": "success" },
    ]);
  });

  it("with histograms: false, keeps the counts and gauges and subscribes to no per-call channel", async () => {
    const sem = memory({ clock }).semaphore("counted", { limit: 2 });
    using _ = instrument(sem, { meterProvider: m.provider, histograms: false });
    for (const name of [CHANNELS.admit, CHANNELS.grant, CHANNELS.release]) {
      expect(diagnostics_channel.hasSubscribers(name), name).toBe(false);
    }
    const held = await sem.admit();
    await (await sem.admit()).release("success");
    const seen = await m.collect();
    const a = at("counted", "semaphore", "memory");
    expect(pointOf(seen, "floodgate.admissions", a)).toBe(2);
    expect(pointOf(seen, "floodgate.call.active", a)).toBe(1);
    expect(seen.has("floodgate.admission.wait.duration")).toBe(false);
    expect(seen.has("floodgate.call.duration")).toBe(false);
    await held.release("success");
  });

  it("measures stages instrumented one call at a time on one provider, each on its own series", async () => {
    const b = memory({ clock });
    const one = b.semaphore("one", { limit: 1 });
    const two = b.semaphore("two", { limit: 3 });
    using _one = instrument(one, { meterProvider: m.provider });
    using _two = instrument(two, { meterProvider: m.provider });
    await (await one.admit()).release("success");
    await (await two.admit()).release("success");
    await (await two.admit()).release("success");
    const seen = await m.collect();
    expect(pointOf(seen, "floodgate.admissions", at("one", "semaphore", "memory"))).toBe(1);
    expect(pointOf(seen, "floodgate.admissions", at("two", "semaphore", "memory"))).toBe(2);
    expect(pointOf(seen, "floodgate.permit.limit", at("two", "semaphore", "memory"))).toBe(3);
    expect(
      pointOf(seen, "floodgate.admission.wait.duration", at("two", "semaphore", "memory")),
    ).toMatchObject({
      count: 2,
    });
  });

  it("measures a stage once per meter: a second instrumentation there is refused until the first closes", async () => {
    const b = memory({ clock });
    const sem = b.semaphore("once", { limit: 2 });
    const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 5, refillPerSecond: 5 })], { name: "g" });
    const first = instrument(gate, { meterProvider: m.provider });
    const refused = (() => {
      try {
        instrument(sem, { meterProvider: m.provider });
      } catch (error) {
        return error;
      }
    })();
    expect(refused).toBeInstanceOf(InvalidOptionsError);
    expect((refused as InvalidOptionsError).field).toBe("targets");
    expect((refused as Error).message).toContain(
      'semaphore "once" (memory) is already measured on this meter',
    );
    // Another meter measures it on its own.
    const other = new TestMetrics();
    using _other = instrument(sem, { meterProvider: other.provider });
    await (await gate.admit()).release("success");
    const wait = (t: TestMetrics) =>
      t.collect().then((seen) =>
        pointOf(seen, "floodgate.call.duration", {
          ...at("once", "semaphore", "memory"),
          "floodgate.call.outcome": "success",
        }),
      );
    // Counted once on each meter, not twice on the first.
    expect(await wait(m)).toMatchObject({ count: 1 });
    expect(await wait(other)).toMatchObject({ count: 1 });
    first.close();
    using _again = instrument(sem, { meterProvider: m.provider });
  });

  it("uses the global meter provider when given none", async () => {
    const { metrics } = await import("@opentelemetry/api");
    metrics.setGlobalMeterProvider(m.provider);
    try {
      const sem = memory({ clock }).semaphore("global", { limit: 3 });
      using _ = instrument(sem);
      expect(await m.value("floodgate.permit.limit", at("global", "semaphore", "memory"))).toBe(3);
    } finally {
      metrics.disable();
    }
  });

  it("takes a meter as it is", async () => {
    const sem = memory({ clock }).semaphore("meter", { limit: 3 });
    using _ = instrument(sem, { meter: m.provider.getMeter("mine") });
    expect(await m.value("floodgate.permit.limit", at("meter", "semaphore", "memory"))).toBe(3);
  });
});
