import { AdmitTimeoutError, Gate, isFloodgateError, ShedError } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { backends, track, useBackend } from "./backends.js";

describe.each(backends)("bounded queue on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;

  beforeEach(() => {
    clock = new FakeClock();
  });

  it("holds up to maxSize jobs and sheds the next with a typed, counted error", async () => {
    const queue = backend.make(clock).queue("q", { maxSize: 2, whenFull: "shed" });
    await queue.admit();
    await queue.admit();
    const error = await queue.admit().catch((e) => e);
    expect(error).toBeInstanceOf(ShedError);
    expect(isFloodgateError(error, "SHED")).toBe(true);
    expect(error.stage).toBe("q");
    expect(queue.snapshot()).toMatchObject({ shed: 1, queueDepth: 2, limit: 2 });
  });

  it("blocks the producer when full, by default, until a slot frees", async () => {
    const queue = backend.make(clock).queue("q", { maxSize: 1 });
    const first = await queue.admit();
    const second = track(queue.admit());
    await clock.advance(300);
    expect(second.settled).toBe(false);
    expect(queue.snapshot()).toMatchObject({ queueDepth: 1, waiting: 1, shed: 0 });
    await first.release();
    await clock.flush();
    expect(second.settled).toBe(true);
    expect(queue.snapshot().queueWaitMs).toBe(300);
  });

  it("times out a blocked producer and holds nothing", async () => {
    const queue = backend.make(clock).queue("q", { maxSize: 1 });
    await queue.admit();
    const blocked = track(queue.admit({ timeoutMs: 100 }));
    await clock.advance(100);
    expect(blocked.error).toBeInstanceOf(AdmitTimeoutError);
    expect(queue.snapshot()).toMatchObject({ queueDepth: 1, waiting: 0 });
  });

  it("lets enqueue resolve when the job is accepted, not when it is done", async () => {
    const b = backend.make(clock);
    const queue = b.queue("jobs", { maxSize: 2, whenFull: "block" });
    const sem = b.semaphore("workers", { limit: 1 });
    const gate = new Gate([queue, sem], { clock });
    let finishFirst!: () => void;
    const running = new Promise<void>((r) => {
      finishFirst = r;
    });
    const job1 = await gate.enqueue(() => running);
    const job2 = await gate.enqueue(async () => "two");
    const job3 = await gate.enqueue(async () => "three");
    // job1 runs and left the queue; job2 and job3 wait in it: the queue is full.
    expect(queue.snapshot().queueDepth).toBe(2);
    const job4 = track(gate.enqueue(async () => "four"));
    await clock.flush();
    expect(job4.settled).toBe(false); // the producer is held back
    finishFirst();
    await job1.done;
    expect(await job2.done).toBe("two");
    await clock.flush();
    expect(job4.settled).toBe(true);
    expect(await job3.done).toBe("three");
    expect(await (job4.value as { done: Promise<string> }).done).toBe("four");
    expect(gate.snapshot()).toMatchObject({ queueDepth: 0, inFlight: 0, waiting: 0 });
  });

  it("sheds through a gate with ShedError when the queue is full", async () => {
    const b = backend.make(clock);
    const gate = new Gate(
      [b.queue("jobs", { maxSize: 1, whenFull: "shed" }), b.semaphore("w", { limit: 1 })],
      {
        clock,
      },
    );
    let release!: () => void;
    const first = gate.run(() => new Promise<void>((r) => (release = r)));
    await clock.flush();
    const second = track(gate.run(async () => 2)); // waits in the queue for the worker
    await clock.flush();
    await expect(gate.run(async () => 3)).rejects.toBeInstanceOf(ShedError);
    expect(gate.snapshot().shed).toBe(1);
    release();
    await first;
    await clock.flush();
    expect(second.value).toBe(2);
  });

  it("refuses bad options with the stage, field, rule and value", () => {
    const b = backend.make(clock);
    expect(() => b.queue("q", { maxSize: 0 })).toThrow(
      'queue "q": maxSize must be an integer >= 1, got 0 (number)',
    );
    expect(() => b.queue("q", { maxSize: 1, whenFull: "drop" as never })).toThrow(
      'queue "q": whenFull must be "block" or "shed", got "drop" (string)',
    );
  });
});
