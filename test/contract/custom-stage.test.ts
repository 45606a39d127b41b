import { mkdirSync, writeFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { ClosedError, Gate, memory, type Stage } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeAll, describe, expect, it } from "vitest";
import { snippets } from "../docs/snippets.js";
import { backends, useBackend } from "./backends.js";

/**
 * A stage of one's own joins a Gate on equal terms. The stage is the circuit breaker of
 * docs/custom-stage.md, taken from the page itself (its class, without the demo after it), so
 * the page cannot drift from what is tested.
 */

const root = fileURLToPath(new URL("../../", import.meta.url));

type Breaker = Stage & { threshold: number };
type BreakerClass = new (name: string, threshold: number, coolDownMs: number, now?: () => number) => Breaker;
let CircuitBreaker: BreakerClass;

beforeAll(async () => {
  const block = snippets(`${root}docs/custom-stage.md`).find((s) => s.code.includes("class CircuitBreaker"));
  if (!block) throw new Error("docs/custom-stage.md has no CircuitBreaker block");
  const code = block.code.slice(0, block.code.indexOf("\n// In a Gate"));
  const dir = `${root}build/test-custom-stage`;
  mkdirSync(dir, { recursive: true });
  writeFileSync(`${dir}/breaker.ts`, code);
  ({ CircuitBreaker } = (await import(`${dir}/breaker.ts`)) as { CircuitBreaker: BreakerClass });
});

describe.each(backends)("a stage of one's own in a Gate on $name", (backend) => {
  useBackend(backend);

  function setup(threshold = 2) {
    const clock = new FakeClock(1_000);
    const b = backend.make(clock);
    const sem = b.semaphore("inflight", { limit: 2 });
    const breaker = new CircuitBreaker("breaker", threshold, 1_000, () => clock.now());
    const gate = new Gate([sem, breaker], { clock });
    return { clock, sem, breaker, gate };
  }

  it("opens after drops in a row, refuses while open holding nothing before it, and tries again after the cool-down", async () => {
    const { clock, sem, breaker, gate } = setup();
    for (let i = 0; i < 2; i++) await gate.run(async () => ({ status: 429 }));
    const refused = await gate.run(async () => "sent").catch((e: Error) => e);
    expect((refused as { code?: string }).code).toBe("BREAKER_OPEN");
    expect(sem.snapshot().inFlight).toBe(0);
    expect(await gate.tryAdmit()).toBeUndefined();
    expect(sem.snapshot().inFlight).toBe(0);
    await clock.advance(1_000);
    expect(await gate.run(async () => "sent")).toBe("sent");
    expect(breaker.snapshot()).toMatchObject({ inFlight: 0, admitted: 3, kind: "circuitBreaker" });
    await gate.close();
  });

  it("is released once, with the call's outcome; a refund teaches it nothing", async () => {
    const { sem, breaker, gate } = setup(1);
    const ticket = await gate.admit();
    await ticket.refund();
    await ticket.release("dropped");
    expect(breaker.snapshot().inFlight).toBe(0);
    // The refund did not count as a drop: the breaker is still closed.
    const next = await gate.admit();
    next.record("success");
    await next.release();
    expect(await gate.run(async () => 1)).toBe(1);
    expect(sem.snapshot().inFlight).toBe(0);
    await gate.close();
  });

  it("is counted in the gate's snapshot and refuses new calls once closed", async () => {
    const { breaker, gate } = setup();
    const held = await gate.admit();
    expect(gate.snapshot().stages.map((s) => s.kind)).toEqual(["semaphore", "circuitBreaker"]);
    expect(gate.snapshot().stages[1]).toMatchObject({ inFlight: 1, backend: "custom" });
    await breaker.close();
    expect(held.signal.aborted).toBe(true);
    await expect(breaker.admit()).rejects.toBeInstanceOf(ClosedError);
    await held.release("success");
    await gate.close();
  });

  it("is admitted through admitNow while it has room, and through admit once admitNow says no", async () => {
    const clock = new FakeClock(1_000);
    const sem = backend.make(clock).semaphore("inflight", { limit: 2 });
    const breaker = new CircuitBreaker("breaker", 1, 1_000, () => clock.now());
    // First in the list, so the Gate asks it whatever the backend of the stage after it.
    const gate = new Gate([breaker, sem], { clock });
    let admits = 0;
    let nows = 0;
    const admit = breaker.admit.bind(breaker);
    const admitNow = breaker.admitNow!.bind(breaker);
    breaker.admit = (o) => {
      admits++;
      return admit(o);
    };
    breaker.admitNow = (o, cost) => {
      nows++;
      return admitNow(o, cost);
    };
    await gate.run(async () => ({ status: 503 }));
    expect([nows, admits]).toEqual([1, 0]);
    const refused = await gate.run(async () => "sent").catch((e: Error) => e);
    expect((refused as { code?: string }).code).toBe("BREAKER_OPEN");
    expect([nows, admits]).toEqual([2, 1]);
    expect(sem.snapshot().inFlight).toBe(0);
    await gate.close();
  });
});

/**
 * A Gate asks `admitNow` of the stages at the head of its list that have it: after a memory
 * semaphore (which has it), a throwing `admitNow` is met with the permit already taken.
 */
describe("a stage of one's own whose admitNow throws, after a memory semaphore", () => {
  function setup() {
    const clock = new FakeClock(1_000);
    const sem = memory({ clock }).semaphore("inflight", { limit: 1 });
    const broken = new Error("admitNow broke");
    const stage: Stage = {
      name: "broken",
      kind: "broken",
      holds: "call",
      admit: () => Promise.reject(new Error("admit is not reached")),
      tryAdmit: () => Promise.resolve(undefined),
      admitNow: () => {
        throw broken;
      },
      snapshot: () => sem.snapshot(),
      close: () => Promise.resolve(),
      [Symbol.asyncDispose]: () => Promise.resolve(),
    };
    const gate = new Gate([sem, stage], { clock });
    return { sem, gate, broken };
  }

  it("rejects run and admit with its error and gives back what the gate held", async () => {
    const { sem, gate, broken } = setup();
    let called = false;
    await expect(
      gate.run(async () => {
        called = true;
      }),
    ).rejects.toBe(broken);
    await expect(gate.admit()).rejects.toBe(broken);
    expect(called).toBe(false);
    expect(sem.snapshot().inFlight).toBe(0);
    expect(gate.snapshot().inFlight).toBe(0);
    await gate.close();
  });

  it("gives back the permit a waiting call was just granted", async () => {
    const { sem, gate, broken } = setup();
    const held = await sem.admit();
    const waiting = gate.run(async () => "sent");
    await held.release("success");
    await expect(waiting).rejects.toBe(broken);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    await gate.close();
  });
});
