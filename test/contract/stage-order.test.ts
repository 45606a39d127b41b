import { Gate, InvalidOptionsError, type Logger, type Stage, stageOrderWarning } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { backends, useBackend } from "./backends.js";

/**
 * The one stage-order rule, measured: stages that hold a call (queue, semaphore, AIMD) first,
 * token buckets next, interval gates last. A metering stage's promise then holds for the starts
 * of calls; listed before a holding stage, it holds only for admissions, and starts bunch.
 */

/** Uneven call lengths (ms), so permits free up at uneven times. */
const LENGTHS = [250, 30, 400, 60, 120, 10, 300, 5];

describe.each(backends)("the stage order on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock(1_000_000);
  });

  const sleep = (ms: number) => new Promise<void>((resolve) => clock.setTimeout(resolve, ms));

  /** Run one call per length through `gate` at once; the start time of each, in order. */
  async function starts(gate: Gate, lengths: readonly number[]): Promise<number[]> {
    const started: number[] = [];
    let done = 0;
    for (const ms of lengths) {
      void gate
        .run(
          async () => {
            started.push(clock.now());
            await sleep(ms);
          },
          { host: "registry.example" },
        )
        .then(() => done++);
    }
    for (let i = 0; i < 1_000 && done < lengths.length; i++) await clock.advance(10);
    expect(done).toBe(lengths.length);
    return started.sort((a, b) => a - b);
  }

  const gaps = (t: number[]) => t.slice(1).map((at, i) => at - t[i]!);

  it("keeps every start to a host at least the spacing apart with the interval gate last", async () => {
    const b = backend.make(clock);
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 2 }), b.intervalGate("hosts", { minIntervalMs: 100 })],
      { clock },
    );
    const t = await starts(gate, LENGTHS);
    expect(Math.min(...gaps(t))).toBeGreaterThanOrEqual(100);
  });

  it("with the interval gate first, lets starts come closer than the spacing unless fused (why the rule)", async () => {
    const b = backend.make(clock);
    const gate = new Gate(
      [b.intervalGate("hosts", { minIntervalMs: 100 }), b.semaphore("inflight", { limit: 2 })],
      { clock, logger: quiet() },
    );
    const t = await starts(gate, LENGTHS);
    if (gate.fused) {
      // Decided together at one instant: a call takes its slot only when it starts, in any order.
      expect(Math.min(...gaps(t))).toBeGreaterThanOrEqual(100);
    } else {
      // Admitted 100 ms apart, but two calls waited at the semaphore and started together.
      expect(Math.min(...gaps(t))).toBeLessThan(100);
    }
  });

  it("meters the starts of calls with the token bucket after the semaphore", async () => {
    const b = backend.make(clock);
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 1 }), b.tokenBucket("rate", { capacity: 1, refillPerSecond: 10 })],
      { clock },
    );
    const t = await starts(gate, [500, 1, 1, 1, 1]);
    // One token at once, then one per 100 ms: every start at least 100 ms after the one before.
    expect(Math.min(...gaps(t))).toBeGreaterThanOrEqual(100);
  });

  it("with the bucket first, lets starts bunch past the bucket's rate unless fused (why the rule)", async () => {
    const b = backend.make(clock);
    const gate = new Gate(
      [b.tokenBucket("rate", { capacity: 1, refillPerSecond: 10 }), b.semaphore("inflight", { limit: 1 })],
      { clock, logger: quiet() },
    );
    const t = await starts(gate, [500, 1, 1, 1, 1]);
    if (gate.fused) {
      // A token is taken only with a permit, at the start of the call: one per 100 ms.
      expect(Math.min(...gaps(t))).toBeGreaterThanOrEqual(100);
    } else {
      // Tokens were taken 100 ms apart while the first call ran; the rest then started back to back.
      expect(Math.min(...gaps(t))).toBeLessThan(100);
    }
  });

  it("holds the permit while a call waits for its token, unless fused (the price of the rule)", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("inflight", { limit: 2 });
    const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 })], { clock });
    const first = await gate.admit();
    const second = gate.admit();
    await clock.advance(10);
    // Chained, the second call waits for a token with a permit in hand; fused, with nothing.
    expect(sem.snapshot().inFlight).toBe(gate.fused ? 1 : 2);
    if (gate.fused) expect(await sem.tryAdmit().then((t) => t?.release("success"))).toBe(undefined);
    await clock.advance(1_000);
    await (await second).release("success");
    await first.release("success");
    expect(sem.snapshot().inFlight).toBe(0);
  });

  it("refuses a cost no stage could ever admit before it takes any stage, even with the bucket last", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("inflight", { limit: 1 });
    const gate = new Gate([sem, b.tokenBucket("tpm", { capacity: 1_000, refillPerSecond: 100 })], { clock });
    const busy = await sem.admit();
    // The semaphore is busy, but the call is refused at once: it could never get 1 001 tokens.
    const error = await gate.run(async () => 1, { costs: { tpm: 1_001 } }).catch((e) => e);
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect(error.message).toBe(
      'tokenBucket "tpm": costs.tpm must be <= capacity (1000), got 1001 (number); it could never be admitted',
    );
    expect(error.field).toBe("costs.tpm");
    expect(sem.snapshot()).toMatchObject({ inFlight: 1, waiting: 0 });
    await busy.release("success");
  });
});

describe("the Gate's warning", () => {
  const kinds = (...list: Stage["kind"][]) =>
    list.map((kind, i) => ({ kind, name: `s${i}` }) as unknown as Stage);

  it("says nothing for the rule's order", () => {
    expect(
      stageOrderWarning(kinds("queue", "semaphore", "aimd", "tokenBucket", "tokenBucket", "intervalGate")),
    ).toBe(undefined);
    expect(stageOrderWarning(kinds("semaphore"))).toBe(undefined);
    expect(stageOrderWarning(kinds("intervalGate"))).toBe(undefined);
  });

  it("names the metering stage and the stage after it that can still make a call wait", () => {
    expect(stageOrderWarning(kinds("intervalGate", "semaphore"))).toMatch(
      /^intervalGate "s0" comes before semaphore "s1", which can still make a call wait after it: its spacing then holds for admissions, not for the starts of calls/,
    );
    expect(stageOrderWarning(kinds("tokenBucket", "queue"))).toMatch(
      /^tokenBucket "s0" comes before queue "s1".* its rate /,
    );
    expect(stageOrderWarning(kinds("intervalGate", "tokenBucket"))).toMatch(
      /^intervalGate "s0" comes before tokenBucket "s1"/,
    );
    expect(stageOrderWarning(kinds("semaphore", "tokenBucket", "aimd"))).toMatch(
      /^tokenBucket "s1" comes before aimd "s2"/,
    );
  });

  it("looks into a gate in the list: its stages count where it stands", () => {
    const gate = (...stages: Stage[]) => ({ kind: "gate", name: "inner", stages }) as unknown as Stage;
    const [bucket, sem, spacing] = kinds("tokenBucket", "semaphore", "intervalGate");
    expect(stageOrderWarning([gate(bucket!), sem!])).toMatch(/^tokenBucket "s0" comes before semaphore "s1"/);
    expect(stageOrderWarning([sem!, gate(gate(spacing!)), bucket!])).toMatch(
      /^intervalGate "s2" comes before tokenBucket "s0"/,
    );
    expect(stageOrderWarning([gate(sem!, bucket!), spacing!])).toBe(undefined);
  });

  it("is logged once, when a gate taken in turn is built, on the gate's logger", async () => {
    const warned: string[] = [];
    const logger = quiet((msg) => warned.push(msg));
    const clock = new FakeClock();
    const { memory } = await import("floodgate");
    const b = memory({ clock });
    const gate = new Gate([b.intervalGate("h", { minIntervalMs: 10 }), b.semaphore("s", { limit: 1 })], {
      clock,
      logger,
      fuse: false,
    });
    await (await gate.admit({ host: "a" })).release("success");
    await (await gate.admit({ host: "b" })).release("success");
    expect(warned).toHaveLength(1);
    expect(warned[0]).toMatch(/^intervalGate "h" comes before semaphore "s"/);
  });
});

/** A logger that drops everything but hands warnings to `onWarn`. */
function quiet(onWarn: (msg: string) => void = () => {}): Logger {
  const log: Logger = {
    child: () => log,
    debug: () => {},
    info: () => {},
    warn: (_obj, msg) => onWarn(msg ?? ""),
    error: () => {},
    isLevelEnabled: () => false,
  };
  return log;
}
