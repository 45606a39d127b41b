import { Writable } from "node:stream";
import { BackendUnavailableError, isFloodgateError, type Ticket } from "floodgate";
import { redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import { Redis } from "ioredis";
import { pino } from "pino";
import { afterEach, describe, expect, it } from "vitest";
import { testClient } from "../contract/backends.js";
import { freePort } from "../setup/redis-server.js";
import { until } from "./helpers.js";

/** A client for a port nothing listens on: never ready, every call fails closed at once. */
async function deadClient(): Promise<Redis> {
  return new Redis(await freePort(), "127.0.0.1", {
    lazyConnect: true,
    enableOfflineQueue: false,
    maxRetriesPerRequest: 0,
  });
}

function capture() {
  const lines: Record<string, unknown>[] = [];
  const stream = new Writable({
    write(chunk, _enc, done) {
      lines.push(JSON.parse(String(chunk)));
      done();
    },
  });
  return { lines, logger: pino({ level: "warn" }, stream) };
}

describe("when Redis cannot be reached", () => {
  const clients: Redis[] = [];
  afterEach(async () => {
    for (const c of clients.splice(0)) c.disconnect();
  });

  it("fails closed by default with BackendUnavailableError", async () => {
    const client = await deadClient();
    clients.push(client);
    const sem = redis(client, { clock: new FakeClock() }).semaphore("closed", { limit: 2 });
    const error = await sem.admit().catch((e) => e);
    expect(error).toBeInstanceOf(BackendUnavailableError);
    expect(isFloodgateError(error, "BACKEND_UNAVAILABLE")).toBe(true);
    expect(error.stage).toBe("closed");
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
  });

  it("fails closed for every kind of stage", async () => {
    const client = await deadClient();
    clients.push(client);
    const b = redis(client, { clock: new FakeClock() });
    const stages = [
      b.semaphore("s", { limit: 1 }),
      b.queue("q", { maxSize: 1 }),
      b.aimd("a", { initial: 1, max: 2 }),
      b.tokenBucket("t", { capacity: 1, refillPerSecond: 1 }),
      b.tokenBucket("tc", {
        capacity: 1,
        refillPerSecond: 1,
        classes: { a: { share: 1 } },
        defaultClass: "a",
      }),
      b.intervalGate("i", { minIntervalMs: 10, defaultHost: "api" }),
    ];
    for (const stage of stages) {
      await expect(stage.admit()).rejects.toBeInstanceOf(BackendUnavailableError);
      await expect(stage.tryAdmit()).rejects.toBeInstanceOf(BackendUnavailableError);
    }
  });

  it("lets calls through with fail-open, and logs the switch", async () => {
    const client = await deadClient();
    clients.push(client);
    const { lines, logger } = capture();
    const sem = redis(client, { clock: new FakeClock(), logger }).semaphore("open", {
      limit: 1,
      onBackendError: "fail-open",
    });
    // Three calls at once on a limit of 1, and one more that never waits: every one goes through.
    const tickets = await Promise.all([sem.admit(), sem.admit(), sem.admit({ cost: 1 })]);
    const tried = await sem.tryAdmit();
    expect(tried).toBeDefined();
    const all = [...tickets, tried!];
    expect(new Set(all).size).toBe(4);
    for (const t of all) {
      expect(t).toMatchObject({ stage: "open", cost: 1, released: false });
      expect(t.signal.aborted).toBe(false);
    }
    expect(sem.snapshot()).toMatchObject({ admitted: 4, waiting: 0 });
    for (const t of all) {
      await t.release("success");
      expect(t.released).toBe(true);
    }
    const switched = () => lines.filter((l) => l.msg === "Redis unavailable; switching to fallback");
    await until(() => switched().length > 0, { timeoutMs: 5000, message: "the switch was never logged" });
    expect(switched()).toHaveLength(1);
    expect(switched()[0]).toMatchObject({ policy: "fail-open", stage: "open" });
  });

  it("runs a call with stage.run through either fallback, releasing it with its outcome", async () => {
    for (const onBackendError of ["fail-open", "local"] as const) {
      const client = await deadClient();
      clients.push(client);
      const sem = redis(client, { clock: new FakeClock() }).semaphore(`run-${onBackendError}`, {
        limit: 1,
        onBackendError,
      });
      expect(sem.run).toBeTypeOf("function");
      let seen: Ticket | undefined;
      const value = await sem.run!((ticket) => {
        seen = ticket;
        ticket.record("dropped");
        return 42;
      });
      expect(value).toBe(42);
      expect(seen?.released).toBe(true);
      await expect(
        sem.run!(() => {
          throw new Error("boom");
        }),
      ).rejects.toThrow("boom");
      expect(sem.snapshot().inFlight).toBe(0);
      expect(sem.snapshot().admitted).toBe(2);
      await expect(sem.run!(undefined as never)).rejects.toMatchObject({ field: "fn" });
    }
  });

  it("holds this process to its share of the limit with local", async () => {
    const client = await deadClient();
    clients.push(client);
    const clock = new FakeClock();
    const sem = redis(client, { clock }).semaphore("local", {
      limit: 4,
      onBackendError: "local",
      localShare: 0.5,
    });
    const a = await sem.admit();
    const b = await sem.admit();
    let third = false;
    const c = sem.admit().then((t) => {
      third = true;
      return t;
    });
    await clock.flush();
    expect(third).toBe(false);
    await a.release("success");
    await c;
    expect(third).toBe(true);
    await b.release();
  });

  it("keeps a token bucket's classes on its local fallback, at its share of the rate", async () => {
    const client = await deadClient();
    clients.push(client);
    const clock = new FakeClock();
    const bucket = redis(client, { clock }).tokenBucket("local-classes", {
      capacity: 4,
      refillPerSecond: 10,
      classes: { interactive: { share: 3, priority: 1 }, bulk: { share: 1 } },
      onBackendError: "local",
      localShare: 0.5,
    });
    // Half the capacity here: bulk takes both tokens, then interactive is owed the next one.
    await bucket.admit({ class: "bulk" });
    await bucket.admit({ class: "bulk" });
    const bulk = bucket.admit({ class: "bulk" });
    const interactive = bucket.admit({ class: "interactive" });
    await clock.advance(200);
    const first = await Promise.race([interactive.then(() => "interactive"), bulk.then(() => "bulk")]);
    expect(first).toBe("interactive");
    await expect(bucket.admit({ class: "batch" })).rejects.toMatchObject({ field: "class" });
    await clock.advance(1_000);
    await bulk;
  });

  it("takes a backend-wide default policy", async () => {
    const client = await deadClient();
    clients.push(client);
    const backend = redis(client, { clock: new FakeClock(), onBackendError: "fail-open" });
    const bucket = backend.tokenBucket("b", { capacity: 1, refillPerSecond: 1 });
    // Two tokens at the same instant from a bucket of one, and a third that never waits.
    const first = await bucket.admit();
    const second = await bucket.admit();
    const third = await bucket.tryAdmit();
    for (const t of [first, second, third]) expect(t).toMatchObject({ stage: "b", cost: 1, released: false });
    expect(bucket.snapshot()).toMatchObject({ admitted: 3, waiting: 0 });
    // A stage's own policy wins over the backend's.
    const closed = backend.tokenBucket("c", {
      capacity: 1,
      refillPerSecond: 1,
      onBackendError: "fail-closed",
    });
    await expect(closed.admit()).rejects.toBeInstanceOf(BackendUnavailableError);
    await expect(closed.tryAdmit()).rejects.toBeInstanceOf(BackendUnavailableError);
    expect(closed.snapshot().admitted).toBe(0);
  });

  it("goes back to Redis once it answers again", async () => {
    // Connected once, then closed: not ready, and floodgate does not connect it again itself.
    const client = testClient();
    clients.push(client);
    await client.connect();
    await client.quit();
    const clock = new FakeClock();
    const { lines, logger } = capture();
    const prefix = `policy:${Date.now()}:${Math.random()}:`;
    const sem = redis(client, { clock, logger, prefix, time: "clock" }).semaphore("back", {
      limit: 1,
      onBackendError: "local",
    });
    const local = await sem.admit();
    await local.release();
    await client.connect();
    await clock.advance(1000);
    const shared = await sem.admit();
    expect(await client.exists(`${prefix}{back}:holders`)).toBe(1);
    await shared.release();
    const switches = () => lines.map((l) => String(l.msg)).filter((m) => m.includes("switching"));
    await until(() => switches().length >= 2, { timeoutMs: 5000, message: "the switches were never logged" });
    expect(switches()).toEqual([
      "Redis unavailable; switching to fallback",
      "Redis answers again; switching back",
    ]);
  });

  it("refuses a bad policy, naming the field", async () => {
    const client = await deadClient();
    clients.push(client);
    expect(() => redis(client).semaphore("x", { limit: 1, onBackendError: "retry" as never })).toThrow(
      'semaphore "x": onBackendError must be "fail-closed", "fail-open" or "local", got "retry" (string)',
    );
    expect(() => redis(client).semaphore("y", { limit: 1, localShare: 0 })).toThrow(
      "localShare must be a number in (0, 1], got 0 (number)",
    );
  });
});
