import diagnostics_channel from "node:diagnostics_channel";
import { Gate } from "floodgate";
import { type RedisBackend, redis, stageKey } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterEach, describe, expect, it } from "vitest";
import { RedisProxy } from "../faults/proxy.js";
import { ownRedis, useClients } from "./clients.js";
import {
  aclGuardsChannels,
  closeClient,
  connectedClient,
  randomPrefix,
  rejectionOf,
  until,
  within,
} from "./helpers.js";

/** This file changes an ACL user's rights and cuts connections (CLIENT KILL ID): on a server of its own. */
const redisUrl = ownRedis();

/**
 * A semaphore's waiters across a lost pub/sub connection. floodgate's own connection subscribes
 * again after a reconnect; when Redis refuses that at first (here an ACL that denies SUBSCRIBE for
 * a while), it asks again until it is let, so its waiters hear their wake-ups again rather than
 * poll until the connection is next lost. Once heard again, each waiter of the process asks again:
 * a grant sent while nobody listened was lost. The process polls once a minute here, so only a
 * wake-up or that ask can admit its waiter in time.
 */
describe("a semaphore's waiters across a lost pub/sub connection", () => {
  const { connect } = useClients(redisUrl);

  /** The connections named `name`: each one's id and its subscriptions (CLIENT LIST). */
  async function connections(admin: Redis, name: string): Promise<{ id: string; sub: number }[]> {
    return String(await admin.call("CLIENT", "LIST"))
      .split("\n")
      .filter((l) => l.includes(` name=${name} `))
      .map((l) => ({ id: /\bid=(\d+)/.exec(l)![1]!, sub: Number(/\bsub=(\d+)/.exec(l)![1]) }));
  }

  /** The pub/sub connection named `name`, once it has subscribed. */
  function subscribed(admin: Redis, name: string): Promise<{ id: string; sub: number }> {
    return until(async () => (await connections(admin, name)).find((c) => c.sub > 0), {
      timeoutMs: 10_000,
      message: `${name}'s pub/sub connection did not subscribe`,
    });
  }

  /** Wait until `name`'s pub/sub connection has subscribed and one caller waits in `line`; that connection. */
  async function waitingIn(admin: Redis, name: string, line: string): Promise<{ id: string; sub: number }> {
    const listening = await subscribed(admin, name);
    await until(async () => (await admin.zcard(line)) === 1, {
      timeoutMs: 5_000,
      message: `the waiter did not take its place in line (${line})`,
    });
    return listening;
  }

  it("a waiter passed over while its pub/sub connection was away asks again once it is heard again", async () => {
    const prefix = randomPrefix("resubscribe-cut");
    const name = `fg-${prefix.split(":")[2]}-waiting`;
    const admin = await connect();
    const holding = redis(await connect(), { prefix, pollMs: 60_000 });
    const waiting = redis(await connect({ connectionName: name, retryStrategy: () => 50 }), {
      prefix,
      pollMs: 60_000,
    });
    const holder = await holding.semaphore("sem", { limit: 1 }).admit();
    const next = waiting.semaphore("sem", { limit: 1 }).admit({ timeoutMs: 20_000 });
    const listening = await waitingIn(admin, name, stageKey(prefix, "sem", "queue"));
    // The release runs while nobody listens for the waiter: its grant, or its wake-up, is lost.
    await admin.call("CLIENT", "KILL", "ID", listening.id);
    await holder.release("success");
    const ticket = await within(next, 5_000, "the waiter's admission once its pub/sub connection was back");
    await ticket.release("success");
    await Promise.all([holding.close(), waiting.close()]);
  });

  it("a class bucket's waiter granted while its pub/sub connection was away asks again once it is heard again", async () => {
    const prefix = randomPrefix("resubscribe-classes");
    const name = `fg-${prefix.split(":")[2]}-waiting`;
    const admin = await connect();
    // (A grant may be taken late for as long as the rest of the bucket would take to refill: the
    // holder takes both tokens, the waiter asks for one.)
    const options = { capacity: 2, refillPerSecond: 0.001, classes: { bulk: { share: 1 } } };
    const holding = redis(await connect(), { prefix, pollMs: 60_000 });
    const waiting = redis(await connect({ connectionName: name, retryStrategy: () => 50 }), {
      prefix,
      pollMs: 60_000,
    });
    const holder = await holding.tokenBucket("tb", options).admit({ class: "bulk", cost: 2 });
    const next = waiting.tokenBucket("tb", options).admit({ class: "bulk", timeoutMs: 20_000 });
    const listening = await waitingIn(admin, name, stageKey(prefix, "tb", "cq:default"));
    // The refund grants the token to the waiter while nobody listens for it: the grant is lost.
    await admin.call("CLIENT", "KILL", "ID", listening.id);
    await holder.refund();
    const ticket = await within(next, 5_000, "the waiter's admission once its pub/sub connection was back");
    await ticket.release("success");
    await Promise.all([holding.close(), waiting.close()]);
  });

  it("a connection refused when it subscribes again asks again until it is let, and its waiter is woken", async () => {
    const prefix = randomPrefix("resubscribe");
    const user = `fg-${prefix.split(":")[2]}`;
    const name = `${user}-waiting`;
    const admin = await connect();
    const channels = (await aclGuardsChannels(admin)) ? ["&*"] : [];
    await admin.call("ACL", "SETUSER", user, "on", ">pw", "~*", ...channels, "+@all");
    try {
      const holding = redis(await connect(), { prefix, pollMs: 60_000 });
      const client = await connect({
        username: user,
        password: "pw",
        connectionName: name,
        retryStrategy: () => 50,
      });
      const waiting = redis(client, { prefix, pollMs: 60_000 });
      const holder = await holding.semaphore("sem", { limit: 1 }).admit();
      const next = waiting.semaphore("sem", { limit: 1 }).admit({ timeoutMs: 20_000 });
      const listening = await waitingIn(admin, name, stageKey(prefix, "sem", "queue"));

      // SUBSCRIBE denied, the pub/sub connection cut: it comes back and is refused.
      await admin.call("ACL", "SETUSER", user, "-subscribe");
      await admin.call("CLIENT", "KILL", "ID", listening.id);
      await until(async () => JSON.stringify(await admin.call("ACL", "LOG", "10")).includes('"subscribe"'), {
        timeoutMs: 10_000,
        message: "the pub/sub connection did not ask to subscribe again, refused",
      });

      // Let again: it subscribes by itself, and the release's wake-up reaches the waiter.
      await admin.call("ACL", "SETUSER", user, "+subscribe");
      const again = await subscribed(admin, name);
      expect(again.id, "a new connection").not.toBe(listening.id);
      await holder.release("success");
      const ticket = await within(next, 5_000, "the waiter's admission once it was subscribed again");
      await ticket.release("success");
      await Promise.all([holding.close(), waiting.close()]);
    } finally {
      await admin.call("ACL", "DELUSER", user);
    }
  });

  /**
   * A pub/sub connection that subscribes again by itself (an ioredis client passed as `subscriber`,
   * `autoResubscribe` on) says `ready` before its SUBSCRIBE reaches Redis; a grant published in
   * between is lost. Its waiters ask again once Redis has answered the backend's own SUBSCRIBE,
   * not at `ready`: here that SUBSCRIBE is held back (a proxy in front of the pub/sub connection)
   * while the holder releases, so an ask made at `ready` would come before the grant, which
   * nobody hears, and the waiter would sleep until its poll (a minute).
   */
  for (const shape of ["semaphore", "fused gate"] as const) {
    it(`a ${shape}'s waiter asks again once its resubscribing pub/sub connection is subscribed, not at ready`, async () => {
      const prefix = randomPrefix(`resubscribe-held-${shape.replace(" ", "-")}`);
      const name = `fg-${prefix.split(":")[2]}-sub`;
      const admin = await connect();
      const proxy = new RedisProxy(Number(new URL(redisUrl()).port));
      await proxy.start();
      try {
        const subscriber = await connectedClient(proxy.url, {
          connectionName: name,
          retryStrategy: () => 50,
          maxRetriesPerRequest: null,
        });
        const stagesOf = (b: RedisBackend) =>
          shape === "fused gate"
            ? new Gate([
                b.tokenBucket("rate", { capacity: 100, refillPerSecond: 100 }),
                b.semaphore("sem", { limit: 1 }),
              ])
            : b.semaphore("sem", { limit: 1 });
        const holding = redis(await connect(), { prefix, pollMs: 60_000 });
        const waiting = redis(await connect(), { prefix, subscriber, pollMs: 60_000 });
        const holder = await stagesOf(holding).admit();
        const next = stagesOf(waiting).admit({ timeoutMs: 20_000 });
        const line =
          shape === "fused gate"
            ? stageKey(prefix, "gate:gate|rate|sem", "line")
            : stageKey(prefix, "sem", "queue");
        const listening = await waitingIn(admin, name, line);
        // Cut, it comes back and says ready; its SUBSCRIBE is held back, and the grant is lost.
        proxy.holdFrom("subscribe");
        await admin.call("CLIENT", "KILL", "ID", listening.id);
        await until(() => proxy.heldBytes > 0, {
          timeoutMs: 10_000,
          message: "the pub/sub connection did not come back to subscribe again",
        });
        await holder.release("success");
        proxy.release();
        const ticket = await within(next, 5_000, "the waiter's admission once its connection was subscribed");
        await ticket.release("success");
        await Promise.all([holding.close(), waiting.close()]);
        await closeClient(subscriber);
      } finally {
        await proxy.stop();
      }
    });
  }

  /**
   * The asks a process makes because its channel was heard again are its own choice, not its
   * callers': with its command connection away then (here behind a proxy that resets every
   * connection, while its pub/sub connection, straight to Redis, comes back), they fail nothing
   * for up to a poll, asking again shortly; past that, the caller fails closed as its own ask
   * would have.
   */
  const proxies: RedisProxy[] = [];
  const owned: Redis[] = [];
  afterEach(async () => {
    await Promise.all(owned.splice(0).map(closeClient));
    await Promise.all(proxies.splice(0).map((p) => p.stop()));
  });

  /** Wait until `what` has published a backend error (a script call failed: Redis away). */
  async function failedAsk(what: () => Promise<unknown>, message: string): Promise<void> {
    const failed: unknown[] = [];
    const onFailed = (error: unknown) => failed.push(error);
    diagnostics_channel.subscribe("floodgate:backend-error", onFailed);
    try {
      await what();
      await until(() => failed.length > 0, { timeoutMs: 5_000, message });
    } finally {
      diagnostics_channel.unsubscribe("floodgate:backend-error", onFailed);
    }
  }

  /**
   * Once a waiter's next ask is held in its proxy's black hole (`message` should it never come),
   * Redis away: that ask fails, and the waiter still waits.
   */
  async function heldAskFails(
    w: { proxy: RedisProxy; state: { settled: boolean } },
    message: string,
  ): Promise<void> {
    await until(() => w.proxy.heldBytes > 0, { timeoutMs: 5_000, message });
    await failedAsk(async () => {
      w.proxy.refuse();
      w.proxy.cut();
    }, "the waiter's ask did not fail");
    expect(w.state.settled, "the waiter, its ask failed, still waiting").toBe(false);
  }

  for (const shape of ["semaphore", "fused gate", "class bucket"] as const) {
    const kind = `a ${shape}'s`;

    /**
     * A waiter of `kind` asking (its holder's stages, and `free` to free what it holds), its
     * commands through a proxy (`proxy`), its pub/sub connection straight to Redis or, given
     * `pubsub`, through that proxy; `settled` once its admission is, `line` where it waits.
     */
    async function behindProxy(pollMs: number, commandTimeoutMs: number, pubsub?: RedisProxy) {
      const prefix = randomPrefix(`resubscribe-away-${shape.replace(" ", "-")}`);
      const name = `fg-${prefix.split(":")[2]}-sub`;
      const admin = await connect();
      const proxy = new RedisProxy(Number(new URL(redisUrl()).port));
      proxies.push(proxy);
      await proxy.start();
      const main = await connectedClient(proxy.url, { retryStrategy: () => 50 });
      owned.push(main);
      // (ioredis subscribes this one again by itself; the backend does too, and it is heard again
      // once Redis has answered.)
      const pubsubOptions = { connectionName: name, retryStrategy: () => 50, maxRetriesPerRequest: null };
      const subscriber = pubsub
        ? await connectedClient(pubsub.url, pubsubOptions)
        : await connect(pubsubOptions);
      if (pubsub) owned.push(subscriber);
      const waiting = redis(main, { prefix, subscriber, pollMs, commandTimeoutMs });
      const holding = redis(await connect(), { prefix, pollMs });
      // (The class bucket's holder takes both its tokens, and gives them back with a refund.)
      const classes = { capacity: 2, refillPerSecond: 0.001, classes: { bulk: { share: 1 } } };
      const stagesOf = (b: RedisBackend) =>
        shape === "fused gate"
          ? new Gate([
              b.tokenBucket("rate", { capacity: 100, refillPerSecond: 100 }),
              b.semaphore("sem", { limit: 1, leaseMs: 10_000 }),
            ])
          : shape === "semaphore"
            ? b.semaphore("sem", { limit: 1, leaseMs: 10_000 })
            : b.tokenBucket("tb", classes);
      const bucket = shape === "class bucket";
      const held = await stagesOf(holding).admit(bucket ? { class: "bulk", cost: 2 } : {});
      const free = () => (bucket ? held.refund() : held.release("success"));
      const state = { settled: false };
      const next = stagesOf(waiting).admit({ timeoutMs: 20_000, ...(bucket ? { class: "bulk" } : {}) });
      next.then(
        () => (state.settled = true),
        () => (state.settled = true),
      );
      const line = {
        semaphore: stageKey(prefix, "sem", "queue"),
        "fused gate": stageKey(prefix, "gate:gate|rate|sem", "line"),
        "class bucket": stageKey(prefix, "tb", "cq:default"),
      }[shape];
      return { admin, name, proxy, main, subscriber, line, next, state, free, holding, waiting };
    }

    /** As `behindProxy`, its pub/sub connection straight to Redis, once it waits in line (`listening`). */
    async function inLineBehindProxy(pollMs: number, commandTimeoutMs: number) {
      const w = await behindProxy(pollMs, commandTimeoutMs);
      return { ...w, listening: await waitingIn(w.admin, w.name, w.line) };
    }

    /** As `inLineBehindProxy`, then: its commands' connection away; its pub/sub connection cut and back. */
    async function waiterAway(healed: boolean) {
      // (A poll of 3 s: a heal comes well within it, however busy the machine.)
      const w = await inLineBehindProxy(3_000, 500);
      // The commands' connection away: reset, and every new one reset too.
      w.proxy.refuse();
      w.proxy.cut();
      await until(() => w.main.status !== "ready", { timeoutMs: 5_000, message: "the cut went unseen" });
      // Its pub/sub connection cut and back: heard again, the waiter asks, and Redis is away.
      await failedAsk(
        () => w.admin.call("CLIENT", "KILL", "ID", w.listening.id),
        "the waiter did not ask again once its process was heard again",
      );
      if (healed) {
        expect(w.state.settled, "the waiter, its ask failed at once, still waiting").toBe(false);
        await w.proxy.heal();
      }
      return w;
    }

    it(`${kind} waiter whose ask on being heard again finds Redis away, back within a poll, still waits and is admitted`, async () => {
      const { next, free, holding, waiting } = await waiterAway(true);
      await free();
      const ticket = await within(next, 10_000, "the waiter's admission");
      await ticket.release("success");
      await Promise.all([holding.close(), waiting.close()]);
    });

    it(`${kind} waiter whose ask on being heard again finds Redis away for longer than a poll fails closed`, async () => {
      const { next, free, holding, waiting } = await waiterAway(false);
      const error = await within(rejectionOf(next), 10_000, "the waiter's failure");
      expect(String((error as Error).name)).toBe("BackendUnavailableError");
      await free();
      await Promise.all([holding.close(), waiting.close()]);
    });

    /**
     * Heard again while its ask is out (here held in a black hole), the waiter asks again once that
     * ask is answered; that ask is as much its process's choice, and Redis away then fails nothing.
     */
    it(`${kind} waiter heard again while its ask is out asks again when it is answered, and Redis away then fails nothing`, async () => {
      // (A poll of 10 s: the waiter's own ask never comes within the test.)
      const w = await inLineBehindProxy(10_000, 5_000);
      // Its commands held; heard again, it asks, and that ask is held.
      w.proxy.blackHole();
      await w.admin.call("CLIENT", "KILL", "ID", w.listening.id);
      await until(() => w.proxy.heldBytes > 0, { timeoutMs: 5_000, message: "the waiter did not ask again" });
      // Heard again once more while that ask is out: the backend's SUBSCRIBE on the new connection
      // is answered before one the test sends after it, and the waiter was told on that answer.
      const again = await subscribed(w.admin, w.name);
      expect(again.id, "a new connection").not.toBe(w.listening.id);
      await w.admin.call("CLIENT", "KILL", "ID", again.id);
      const third = await until(
        async () => (await connections(w.admin, w.name)).find((c) => c.sub > 0 && c.id !== again.id),
        { timeoutMs: 10_000, message: "the pub/sub connection did not subscribe again" },
      );
      expect(third.id).not.toBe(w.listening.id);
      await w.subscriber.subscribe(`${w.name}:probe`);
      // The held ask reaches Redis and its answer comes back; the ask after it falls into the
      // silence, and the connection is reset: Redis away.
      await w.proxy.healForOneReply();
      await heldAskFails(w, "the waiter did not ask again once its ask was answered");
      await w.free();
      await w.proxy.heal();
      const ticket = await within(w.next, 10_000, "the waiter's admission");
      await ticket.release("success");
      await Promise.all([w.holding.close(), w.waiting.close()]);
    });

    /**
     * A waiter that has taken its place in line asks once more as soon as its process listens (a
     * wake-up sent before that was lost): an ask of its process's choosing, as one on being heard
     * again, so Redis away then fails nothing for up to a poll.
     */
    it(`${kind} waiter's ask once its process listens finds Redis away, back within a poll, still waits and is admitted`, async () => {
      const port = Number(new URL(redisUrl()).port);
      const pubsub = new RedisProxy(port);
      proxies.push(pubsub);
      await pubsub.start();
      // The process's first SUBSCRIBE held back: the waiter takes its place in line, unheard.
      pubsub.holdFrom("subscribe");
      const w = await behindProxy(3_000, 500, pubsub);
      await until(async () => pubsub.heldBytes > 0 && (await w.admin.zcard(w.line)) === 1, {
        timeoutMs: 10_000,
        message: "the waiter did not take its place in line and subscribe",
      });
      // Its commands held; subscribed, it asks once more, and that ask fails: Redis away.
      w.proxy.blackHole();
      pubsub.release();
      await heldAskFails(w, "the waiter did not ask once more once it listened");
      await w.proxy.heal();
      await w.free();
      const ticket = await within(w.next, 10_000, "the waiter's admission");
      await ticket.release("success");
      await Promise.all([w.holding.close(), w.waiting.close()]);
    });
  }
});
