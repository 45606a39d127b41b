import type { Ticket } from "floodgate";
import { type RedisBackendOptions, redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { describe, expect, it } from "vitest";
import { commandName, type ScriptName } from "../../src/redis/scripts.js";
import { ownRedis, useClients } from "./clients.js";
import { connectedClient, evalCalls, randomPrefix, until } from "./helpers.js";

/**
 * Let `client`'s next command for `script` run at once, but hold its reply back from the caller
 * until `hand()`: `ran` once Redis has answered it.
 */
function holdReply(client: Redis, script: ScriptName): { readonly ran: boolean; hand(): void } {
  const command = commandName(script);
  const commands = client as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
  const send = commands[command]!.bind(client);
  let sent: Promise<unknown> | undefined;
  let ran = false;
  let give: ((value: unknown) => void) | undefined;
  let fail: ((error: unknown) => void) | undefined;
  commands[command] = (...args: unknown[]) => {
    commands[command] = send;
    sent = send(...args);
    sent.then(
      () => {
        ran = true;
      },
      () => {},
    );
    return new Promise((resolve, reject) => {
      give = resolve;
      fail = reject;
    });
  };
  return {
    get ran() {
      return ran;
    },
    hand() {
      if (sent === undefined) throw new Error(`no ${script} command was held`);
      sent.then(give, fail);
    },
  };
}

/** This file counts the script calls Redis runs: on a server of its own. */
const redisUrl = ownRedis();

/**
 * Two backends on two connections stand for two processes: the waiting line lives in Redis, so
 * arrival order holds across them, and a release grants only the waiter at the head.
 */
describe("waiting across processes", () => {
  const { clients, connect } = useClients(redisUrl);

  async function fleet(n: number, prefix: string, options: RedisBackendOptions = {}) {
    const backends = [];
    for (let i = 0; i < n; i++) {
      const client = await connect();
      // A long poll: every wake-up below comes from the releases, not from polling.
      backends.push(redis(client, { prefix, pollMs: 60_000, ...options }));
    }
    return backends;
  }

  it("grants in arrival order across processes, so a newcomer cannot jump the line", async () => {
    const prefix = randomPrefix("fifo");
    const [a, b, c] = await fleet(3, prefix);
    const semA = a!.semaphore("line", { limit: 1 });
    const semB = b!.semaphore("line", { limit: 1 });
    const semC = c!.semaphore("line", { limit: 1 });
    const held = await semA.admit();
    const order: string[] = [];
    const waitB = semB.admit().then((t) => {
      order.push("b");
      return t;
    });
    await until(async () => (await clients[0]!.zcard(`${prefix}{line}:queue`)) === 1, {
      timeoutMs: 5000,
      message: "b did not line up",
    });
    const waitC = semC.admit().then((t) => {
      order.push("c");
      return t;
    });
    await until(async () => (await clients[0]!.zcard(`${prefix}{line}:queue`)) === 2, {
      timeoutMs: 5000,
      message: "c did not line up",
    });
    // Both processes listen for their grants: a waiter whose process does not listen yet keeps
    // its place but is passed over by a release (a permit never goes where no one can take it).
    await until(async () => (await clients[0]!.pubsub("CHANNELS", `${prefix}{line}:wake:*`)).length === 2, {
      timeoutMs: 5000,
      message: "b's and c's processes did not subscribe",
    });
    // A newcomer in the releasing process asks while b and c wait: it must not overtake them.
    expect(await semA.tryAdmit()).toBeUndefined();
    await held.release("success");
    // Whichever is granted first shows in `order`; awaiting b alone would hang, not fail, if c were.
    await until(() => order.length > 0, { timeoutMs: 5000, message: "nobody was granted" });
    expect(order).toEqual(["b"]);
    await (await waitB).release("success");
    await until(() => order.length > 1, { timeoutMs: 5000, message: "c was never granted" });
    expect(order).toEqual(["b", "c"]);
    await (await waitC).release("success");
  });

  it("costs one Redis call per release, not one per waiter, and grants in line order", async () => {
    const prefix = randomPrefix("calls");
    // No sign-of-life calls while waiters wait: every script call counted below is the release's.
    const [a, ...others] = await fleet(6, prefix, { livenessMs: 600_000 });
    const admin = clients[0]!;
    const queue = `${prefix}{calls}:queue`;
    const sems = others.map((b) => b.semaphore("calls", { limit: 1 }));
    const holder = a!.semaphore("calls", { limit: 1 });
    const held = await holder.admit();

    // Each process waits once first, so that it listens for wake-ups before anything is counted:
    // a waiter that lines up before its process listens asks Redis again once it does.
    const warm = sems.map((s) => s.admit().then((t) => t.release("success")));
    await until(
      async () => (await admin.pubsub("CHANNELS", `${prefix}{calls}:wake:*`)).length === sems.length,
      {
        timeoutMs: 10_000,
        message: "the processes did not subscribe",
      },
    );
    await held.release("success");
    await Promise.all(warm);
    const again = await holder.admit();

    // 40 waiters from 5 processes, lined up one at a time, so their order in Redis is known.
    const order: number[] = [];
    const waits: Promise<Ticket>[] = [];
    for (let i = 0; i < 40; i++) {
      waits.push(
        sems[i % sems.length]!.admit().then((t) => {
          order.push(i);
          return t;
        }),
      );
      await until(async () => (await admin.zcard(queue)) === i + 1, {
        timeoutMs: 10_000,
        message: `waiter ${i} did not line up`,
      });
    }
    // Each waiter releases as soon as it is granted, but the first, which is counted.
    const rest = waits.slice(1).map((w) => w.then((t) => t.release("success")));

    const before = await evalCalls(admin);
    await again.release("success");
    await until(() => order.length > 0, { timeoutMs: 10_000, message: "no waiter was granted" });
    const after = await evalCalls(admin);
    // The release grants the head in the same script: one round trip, whatever the line.
    expect(after - before).toBe(1);
    expect(order).toEqual([0]);
    await (await waits[0]!).release("success");
    // The rest are granted one by one in their order in Redis, across the five processes.
    await Promise.all(rest);
    expect(order).toEqual(Array.from({ length: 40 }, (_, i) => i));
    expect(await admin.zcard(queue)).toBe(0);
  });

  it("covers a lost subscription with the slow poll", async () => {
    const prefix = randomPrefix("lost-sub");
    const holderClient = await connectedClient(redisUrl());
    const waiterClient = await connectedClient(redisUrl());
    // The waiter's pub/sub connection; it will be killed, and must not come back.
    const subscriber = await connectedClient(redisUrl(), {
      retryStrategy: () => null,
      autoResubscribe: false,
    });
    clients.push(holderClient, waiterClient, subscriber);
    const subscriberId = await subscriber.client("ID");
    const holder = redis(holderClient, { prefix }).semaphore("poll", { limit: 1 });
    const waiter = redis(waiterClient, { prefix, pollMs: 200, subscriber }).semaphore("poll", { limit: 1 });
    const held = await holder.admit();
    const pending = waiter.admit();
    await until(async () => (await holderClient.pubsub("CHANNELS", `${prefix}{poll}:wake:*`)).length === 1, {
      timeoutMs: 5000,
      message: "the waiter never subscribed",
    });
    // Kill this one connection only: other tests share the server.
    await holderClient.client("KILL", "ID", String(subscriberId));
    await held.release("success"); // the wake-up message goes nowhere
    let granted = false;
    void pending.then(() => {
      granted = true;
    });
    await until(() => granted, { timeoutMs: 5000, message: "the poll never picked the permit up" });
    await (await pending).release("success");
  });

  it("takes a waiter that left while its request was out out of the line", async () => {
    const prefix = randomPrefix("left");
    const [a, b] = await fleet(2, prefix);
    const semA = a!.semaphore("left", { limit: 1 });
    const semB = b!.semaphore("left", { limit: 1 });
    const held = await semA.admit();
    const controller = new AbortController();
    const gone = semB.admit({ signal: controller.signal });
    controller.abort(); // while its acquire is still on its way to Redis
    await expect(gone).rejects.toBe(controller.signal.reason);
    const next = semB.admit();
    await until(async () => (await clients[0]!.zcard(`${prefix}{left}:queue`)) === 1, {
      timeoutMs: 5000,
      message: "the gone waiter was never taken out of the line",
    });
    await held.release("success");
    await (await next).release("success"); // no stale head holds it up (the poll is a minute)
  });

  // A waiter that leaves while its acquire is out gives its place back at once, after that
  // acquire on the same connection, not once the acquire's reply is read: a release in between
  // would grant the place of a caller that is gone, and this process's next try, which can be
  // read before that reply, would be refused while the permit sits with nobody.
  it("gives back the place of a waiter that left while its acquire was out before that acquire's reply is read", async () => {
    const prefix = randomPrefix("left-held");
    const [a, b] = await fleet(2, prefix);
    const semA = a!.semaphore("left", { limit: 1 });
    const semB = b!.semaphore("left", { limit: 1 });
    const queue = `${prefix}{left}:queue`;
    const holders = `${prefix}{left}:holders`;
    const held = await semA.admit();
    // B's client runs its first acquire at once but holds its reply back until told.
    const reply = holdReply(clients[1]!, "semaphore-acquire");
    const controller = new AbortController();
    const gone = semB.admit({ signal: controller.signal });
    await until(() => reply.ran, { timeoutMs: 5000, message: "B's acquire never ran" });
    expect(await clients[0]!.zcard(queue)).toBe(1); // in line in Redis; the process has not heard
    controller.abort();
    await expect(gone).rejects.toBe(controller.signal.reason);
    await held.release("success");
    // B's next try comes after its give-back on the same connection: the permit is free for it.
    const next = await semB.tryAdmit();
    expect(next, "a permit sat with a waiter that had left").toBeDefined();
    // The held reply, read now, gives back nothing more: the permit stays with the new holder.
    reply.hand();
    await until(async () => (await clients[0]!.zcard(queue)) === 0, {
      timeoutMs: 5000,
      message: "the gone waiter stayed in the line",
    });
    expect(await clients[0]!.zcard(holders)).toBe(1);
    expect(await semA.tryAdmit()).toBeUndefined();
    await next!.release("success");
    expect(await clients[0]!.zcard(holders)).toBe(0);
  });

  // The same for a token bucket with classes: a caller that leaves while its ask is out leaves
  // its class's line at once, after that ask on the same connection. Were it still in line, the
  // tokens a refund brings back would be granted to it, a caller that is gone, and this
  // process's next try refused until the ask's reply is read.
  it("takes a caller of a bucket with classes that left while its ask was out out of line before that ask's reply is read", async () => {
    const prefix = randomPrefix("left-classes");
    // (A call not answered within commandTimeoutMs is failed, and the caller leaves then: far
    // later than the wait below.)
    const [a, b] = await fleet(2, prefix, { commandTimeoutMs: 60_000 });
    // One token, and no refill to speak of: only a refund brings one back.
    const options = { capacity: 1, refillPerSecond: 0.001, classes: { only: { share: 1 } } };
    const bucketA = a!.tokenBucket("tb", options);
    const bucketB = b!.tokenBucket("tb", options);
    const queue = `${prefix}{tb}:cq:default`;
    const taken = await bucketA.admit({ class: "only" });
    // B's client runs its first ask at once but holds its reply back until told.
    const reply = holdReply(clients[1]!, "token-bucket-classes");
    const controller = new AbortController();
    const gone = bucketB.admit({ class: "only", signal: controller.signal });
    await until(() => reply.ran, { timeoutMs: 5000, message: "B's ask never ran" });
    expect(await clients[0]!.zcard(queue)).toBe(1); // in line in Redis; the process has not heard
    controller.abort();
    await expect(gone).rejects.toBe(controller.signal.reason);
    // Its leave goes at once, though the ask's reply is still held back.
    await until(async () => (await clients[0]!.zcard(queue)) === 0, {
      timeoutMs: 5000,
      message: "the gone caller stayed in its class's line until its ask's reply was read",
    });
    // A's refund brings the token back to the bucket, not to the gone caller.
    await taken.refund();
    const next = await bucketB.tryAdmit({ class: "only" });
    expect(next, "a token went to a caller that had left").toBeDefined();
    // The held reply, read now, gives back nothing more: the token stays with the new ticket.
    reply.hand();
    await until(async () => (await clients[0]!.zcard(queue)) === 0, {
      timeoutMs: 5000,
      message: "the held ask's reply put the gone caller back in line",
    });
    expect(await bucketA.tryAdmit({ class: "only" })).toBeUndefined();
  });
});
