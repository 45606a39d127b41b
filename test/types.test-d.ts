import type {
  AimdOptions,
  IntervalGateOptions,
  MemoryBackendOptions,
  QueueOptions,
  RunOptions,
  SemaphoreOptions,
  Stage,
  Ticket,
  TokenBucketOptions,
} from "floodgate";
import { Gate, memory } from "floodgate";
import { describe, expectTypeOf, it } from "vitest";
import type { z } from "zod";
import type {
  aimdSchema,
  intervalGateSchema,
  memoryBackendSchema,
  queueSchema,
  semaphoreSchema,
  tokenBucketSchema,
} from "../src/validate.js";

describe("option schemas match the documented interfaces", () => {
  it("semaphore", () => {
    expectTypeOf<z.input<typeof semaphoreSchema>>().toEqualTypeOf<SemaphoreOptions>();
  });
  it("token bucket", () => {
    expectTypeOf<z.input<typeof tokenBucketSchema>>().toEqualTypeOf<TokenBucketOptions>();
  });
  it("queue", () => {
    expectTypeOf<z.input<typeof queueSchema>>().toEqualTypeOf<QueueOptions>();
  });
  it("interval gate", () => {
    expectTypeOf<z.input<typeof intervalGateSchema>>().toEqualTypeOf<IntervalGateOptions>();
  });
  it("aimd", () => {
    expectTypeOf<z.input<typeof aimdSchema>>().toEqualTypeOf<AimdOptions>();
  });
  it("memory backend", () => {
    expectTypeOf<z.input<typeof memoryBackendSchema>>().toEqualTypeOf<MemoryBackendOptions>();
  });
});

describe("public shapes", () => {
  it("a gate is a stage, so gates nest", () => {
    expectTypeOf<Gate>().toExtend<Stage>();
    const b = memory();
    expectTypeOf(new Gate([new Gate([b.semaphore("s", { limit: 1 })])])).toExtend<Stage>();
  });
  it("tickets are async-disposable", () => {
    expectTypeOf<Ticket>().toExtend<AsyncDisposable>();
  });
  it("run returns what the function returns", () => {
    const gate = new Gate([]);
    expectTypeOf(gate.run(async () => 42)).toEqualTypeOf<Promise<number>>();
    expectTypeOf(gate.enqueue(() => "x"))
      .resolves.toHaveProperty("done")
      .toEqualTypeOf<Promise<string>>();
  });
  it("stage.run returns what the function returns and hands it the ticket", () => {
    const b = memory();
    const sem = b.semaphore("s", { limit: 1 });
    expectTypeOf(sem.run(async () => 42)).toEqualTypeOf<Promise<number>>();
    expectTypeOf(sem.run((ticket) => ticket.stage)).toEqualTypeOf<Promise<string>>();
    expectTypeOf(b.tokenBucket("t", { capacity: 1, refillPerSecond: 1 }).run)
      .parameter(1)
      .toEqualTypeOf<RunOptions<unknown> | undefined>();
    // A stage of your own may leave run out, so on the Stage interface it is optional.
    expectTypeOf<Stage["run"]>().toExtend<((...args: never[]) => unknown) | undefined>();
  });
  it("refuses options of the wrong shape at compile time", () => {
    const b = memory();
    // @ts-expect-error limit is required
    b.semaphore("s", {});
    // @ts-expect-error whenFull is a union of two strings
    b.queue("q", { maxSize: 1, whenFull: "drop" });
  });
});
