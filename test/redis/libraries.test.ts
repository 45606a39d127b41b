import {
  AdmitTimeoutError,
  BackendUnavailableError,
  InvalidOptionsError,
  isFloodgateError,
  LeaseLostError,
} from "floodgate";
import { type LeaseTicket, type RedisBackend, type RedisClient, redis, stageKey } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import { afterEach, describe, expect, it } from "vitest";
import { redisClusterNodes, redisUrl } from "../contract/backends.js";
import { freePort } from "../setup/redis-server.js";
import { randomPrefix, rejectionOf, until, within } from "./helpers.js";
import { closeAny, command, dropAny, LIBRARIES, type Library, OTHER_LIBRARIES } from "./libraries.js";

/**
 * Grants, leases, quarantine and refusals on each client library other than ioredis (whose own
 * suites in this folder cover them), on the single server and on the Cluster where the library
 * has one. Two backends, each on its own client, stand for two processes.
 */
interface Target {
  name: string;
  library: Library;
  connect(): Promise<RedisClient>;
}

const targets: Target[] = OTHER_LIBRARIES.flatMap((library) => {
  const single: Target = { name: library.name, library, connect: () => library.connect(redisUrl()) };
  const connectCluster = library.connectCluster;
  if (!connectCluster) return [single];
  return [
    single,
    { name: `${library.name} Cluster`, library, connect: () => connectCluster(redisClusterNodes()) },
  ];
});

describe.each(targets)("grants, leases and quarantine on $name", (target) => {
  const clients: RedisClient[] = [];
  const backends: RedisBackend[] = [];

  afterEach(async () => {
    await Promise.all(backends.splice(0).map((b) => within(b.close(), 5_000, "backend.close()")));
    await Promise.all(clients.splice(0).map(closeAny));
  });

  async function client(): Promise<RedisClient> {
    const c = await target.connect();
    clients.push(c);
    return c;
  }

  /** A backend standing for one process, on a client of its own; wake-ups by pub/sub only. */
  async function backend(prefix: string, options: Parameters<typeof redis>[1] = {}) {
    const c = await client();
    const b = redis(c, { prefix, pollMs: 60_000, ...options });
    backends.push(b);
    return { client: c, backend: b };
  }

  it("adds no listener to the client per backend built on it", async () => {
    const c = await client();
    const emitter = c as unknown as {
      eventNames(): (string | symbol)[];
      listenerCount(e: string | symbol): number;
    };
    const count = () => emitter.eventNames().reduce((n, e) => n + emitter.listenerCount(e), 0);
    const first = redis(c, { prefix: randomPrefix("listeners") });
    const before = count();
    for (let i = 0; i < 20; i++) backends.push(redis(c, { prefix: randomPrefix("listeners") }));
    expect(count()).toBe(before);
    backends.push(first);
  });

  it("hands a permit released in one process to a waiter in another through its grant message", async () => {
    const prefix = randomPrefix(`lib-grant-${target.library.name}`);
    const first = await backend(prefix);
    const raw = first.client;
    const a = first.backend.semaphore("portal", { limit: 1 });
    const b = (await backend(prefix)).backend.semaphore("portal", { limit: 1 });
    const held = await a.admit();
    const waiting = b.admit({ timeoutMs: 10_000 });
    if (!target.name.endsWith("Cluster")) {
      // Its process listens on its grant channel (on a Cluster, channels are counted per node).
      const pattern = `${prefix}{portal}:wake:*`;
      await until(
        async () => ((await command(raw, ["PUBSUB", "CHANNELS", pattern])) as string[]).length === 1,
        {
          timeoutMs: 5_000,
          message: "the waiting process never subscribed to its grant channel",
        },
      );
    }
    // With a poll of a minute, only the grant message can wake the waiter within the timeout.
    await held.release("success");
    const ticket = await within(waiting, 10_000, "the waiter's admit()");
    expect(b.snapshot()).toMatchObject({ inFlight: 1, waiting: 0 });
    await ticket.release("success");
    expect(await a.tryAdmit()).toBeDefined();
  });

  it("hands a waiter in the releasing process its permit from the release reply", async () => {
    const prefix = randomPrefix(`lib-local-${target.library.name}`);
    const sem = (await backend(prefix)).backend.semaphore("local", { limit: 1 });
    const held = await sem.admit();
    const waiting = sem.admit({ timeoutMs: 10_000 });
    await held.release("success");
    const ticket = await within(waiting, 10_000, "the waiter's admit()");
    expect(sem.snapshot()).toMatchObject({ inFlight: 1, waiting: 0 });
    await ticket.release("success");
  });

  it("keeps a running holder's lease past leaseMs by renewing it", async () => {
    const prefix = randomPrefix(`lib-renew-${target.library.name}`);
    const leaseMs = 1_000;
    const mine = (await backend(prefix)).backend.semaphore("renew", { limit: 1, leaseMs });
    const theirs = (await backend(prefix)).backend.semaphore("renew", { limit: 1, leaseMs });
    const ticket = await mine.admit();
    // The other process waits two leases and is refused: the lease was renewed.
    const error = await rejectionOf(theirs.admit({ timeoutMs: leaseMs * 2 }));
    expect(error).toBeInstanceOf(AdmitTimeoutError);
    expect(ticket.signal.aborted).toBe(false);
    await ticket.release("success");
    // The waiter that gave up may still be leaving the line (its leave and this release race on
    // two connections), so the permit may reach it first and come back: wait for it, not try.
    const next = await within(theirs.admit({ timeoutMs: 5_000 }), 10_000, "the next admit()");
    await next.release("success");
  });

  it("gives a dead holder's permit to a waiter once its lease runs out", async () => {
    const prefix = randomPrefix(`lib-dead-${target.library.name}`);
    const leaseMs = 500;
    const dead = await backend(prefix);
    const held = await dead.backend.semaphore("dead", { limit: 1, leaseMs }).admit();
    // The holder's process dies: its connection drops, nothing is released or renewed.
    dropAny(dead.client);
    const waiter = (await backend(prefix)).backend.semaphore("dead", { limit: 1, leaseMs });
    const ticket = await within(waiter.admit({ timeoutMs: 10_000 }), 10_000, "the waiter's admit()");
    expect(ticket.cost).toBe(1);
    await ticket.release("success");
    expect(held.released).toBe(false);
  });

  it("reports a lease found gone on ticket.signal with LeaseLostError", async () => {
    const prefix = randomPrefix(`lib-lost-${target.library.name}`);
    const { client: c, backend: b } = await backend(prefix);
    const sem = b.semaphore("lost", { limit: 1, leaseMs: 400 });
    const ticket = (await sem.admit()) as LeaseTicket;
    await command(c, ["DEL", stageKey(prefix, "lost", "holders")]);
    await until(() => ticket.signal.aborted, {
      timeoutMs: 5_000,
      message: "the lost lease was never noticed",
    });
    expect(ticket.signal.reason).toBeInstanceOf(LeaseLostError);
    expect(sem.snapshot()).toMatchObject({ leasesLost: 1 });
    await ticket.release("success");
  });

  it("grants nothing for one lease length after Redis loses a stage's data, then goes on with higher fencing tokens", async () => {
    const prefix = randomPrefix(`lib-quarantine-${target.library.name}`);
    const clock = new FakeClock(1_000_000);
    const a = await backend(prefix, { clock, time: "clock" });
    const semA = a.backend.semaphore("portal", { limit: 2, leaseMs: 10_000 });
    const held = (await semA.admit()) as LeaseTicket;
    await command(a.client, [
      "DEL",
      ...["holders", "queue", "qexp", "meta"].map((p) => stageKey(prefix, "portal", p)),
    ]);
    expect(await semA.tryAdmit()).toBeUndefined();
    const b = await backend(prefix, { clock, time: "clock" });
    const semB = b.backend.semaphore("portal", { limit: 2, leaseMs: 10_000 });
    expect(await semB.tryAdmit()).toBeUndefined();
    const waiting = semB.admit();
    await clock.advance(9_999);
    expect(await semA.tryAdmit()).toBeUndefined();
    await clock.advance(2);
    const after = (await waiting) as LeaseTicket;
    expect(after.fence).toBeGreaterThan(held.fence);
    await after.release("success");
    await held.release("success");
  });

  it("fails a script Redis refuses closed, with BackendUnavailableError carrying Redis's error", async () => {
    const prefix = randomPrefix(`lib-refused-${target.library.name}`);
    const { client: c, backend: b } = await backend(prefix);
    await command(c, ["SET", stageKey(prefix, "sem", "holders"), "not a sorted set"]);
    const sem = b.semaphore("sem", { limit: 1 });
    const error = await rejectionOf(sem.admit());
    expect(error).toBeInstanceOf(BackendUnavailableError);
    expect((error as Error).message).toMatch(/Redis refused .*WRONGTYPE/);
    expect(((error as Error).cause as Error).message).toMatch(/WRONGTYPE/);
    expect(sem.snapshot()).toMatchObject({ waiting: 0, inFlight: 0 });
  });
});

describe.each(OTHER_LIBRARIES)("the first connection on $name", (library) => {
  it("connects a client not connected yet on the first call", async () => {
    const client = library.make(redisUrl());
    const backend = redis(client, { prefix: randomPrefix(`lib-first-${library.name}`) });
    try {
      const ticket = await backend.semaphore("first", { limit: 1 }).admit({ timeoutMs: 5_000 });
      await ticket.release("success");
    } finally {
      await backend.close();
      await closeAny(client);
    }
  });

  it("fails calls closed at once when the first connection is refused", async () => {
    const client = library.make(`redis://127.0.0.1:${await freePort()}`);
    const backend = redis(client, { prefix: randomPrefix(`lib-refused-${library.name}`) });
    try {
      const sem = backend.semaphore("first", { limit: 1 });
      const error = await within(rejectionOf(sem.admit()), 3_000, "admit() on a refused connection");
      expect(isFloodgateError(error, "BACKEND_UNAVAILABLE")).toBe(true);
      expect(sem.snapshot()).toMatchObject({ waiting: 0, inFlight: 0 });
    } finally {
      await backend.close();
      dropAny(client);
    }
  });
});

describe.each(LIBRARIES)("a Cluster whose first connection is refused, on $name", (library) => {
  it("fails calls closed at once, again and again", async () => {
    const client = library.makeCluster!([{ host: "127.0.0.1", port: await freePort() }]);
    const backend = redis(client, { prefix: randomPrefix(`lib-cluster-refused-${library.name}`) });
    try {
      const sem = backend.semaphore("first", { limit: 1 });
      for (let i = 0; i < 3; i++) {
        const error = await within(rejectionOf(sem.admit()), 1_500, `admit() ${i + 1} on a refused Cluster`);
        expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
      }
      expect(sem.snapshot()).toMatchObject({ waiting: 0, inFlight: 0 });
    } finally {
      await backend.close();
      dropAny(client);
    }
  });
});

describe("recognising the client", () => {
  it("refuses an object of no client library it knows with InvalidOptionsError", () => {
    for (const client of [{}, { status: "ready" }, { sendCommand() {} }, null]) {
      expect(() => redis(client as unknown as RedisClient)).toThrow(InvalidOptionsError);
    }
  });

  it("refuses a subscriber of another library than the client's", async () => {
    const [ioredis, nodeRedis] = LIBRARIES;
    const client = ioredis!.make(redisUrl());
    const subscriber = nodeRedis!.make(redisUrl());
    try {
      expect(() => redis(client, { subscriber })).toThrow(/subscriber must be a client of the same library/);
      expect(() => redis(subscriber, { subscriber: client })).toThrow(InvalidOptionsError);
    } finally {
      dropAny(client);
      dropAny(subscriber);
    }
  });
});
