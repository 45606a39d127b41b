import { Gate } from "floodgate";
import { type RedisBackend, redis, stageKey } from "floodgate/redis";
import type { Redis } from "ioredis";
import { describe, expect, it } from "vitest";
import { ownRedis, useClients } from "./clients.js";
import { randomPrefix, rejectionOf, until, within } from "./helpers.js";

/** This file cuts connections of its own (CLIENT KILL ID): on a server of its own. */
const redisUrl = ownRedis();

/**
 * A fused Redis gate's waiters when one of their process's connections is cut: a waiter whose
 * grant or wake-up was lost with its pub/sub connection asks again once it is heard again, and a
 * caller that gave up while its command connection was away leaves the gate's lines once it is
 * back. Each process polls once a minute here, so only those can admit the next call in time.
 */
describe("a fused Redis gate across a cut connection", () => {
  const { connect } = useClients(redisUrl);
  const POLL_MS = 60_000;

  /**
   * A process of the fleet: its own client (named `name`, reconnecting every 50 ms) and backend;
   * with `given`, a pub/sub client of its own too, which ioredis subscribes again by itself
   * (`autoResubscribe`, with the retries per request docs/redis.md asks of it).
   */
  async function member(
    prefix: string,
    name: string,
    given = false,
  ): Promise<{ client: Redis; backend: RedisBackend }> {
    const client = await connect({ connectionName: name, retryStrategy: () => 50 });
    const subscriber = given
      ? await connect({ connectionName: name, retryStrategy: () => 50, maxRetriesPerRequest: null })
      : undefined;
    return { client, backend: redis(client, { prefix, pollMs: POLL_MS, subscriber }) };
  }

  /** The gate every process builds: a bucket that never binds and a semaphore of one permit. */
  function gateOf(backend: RedisBackend): Gate {
    return new Gate(
      [
        backend.tokenBucket("rate", { capacity: 1_000, refillPerSecond: 1_000 }),
        backend.semaphore("sem", { limit: 1, leaseMs: 30_000 }),
      ],
      { name: "cut" },
    );
  }

  /** Cut the connection named `name` that listens (`pubsub`) or the one that sends commands. */
  async function cut(admin: Redis, name: string, pubsub: boolean): Promise<void> {
    const lines = String(await admin.call("CLIENT", "LIST"))
      .split("\n")
      .filter((l) => l.includes(` name=${name} `) && / flags=\S*P/.test(l) === pubsub);
    expect(lines, `${name}'s ${pubsub ? "pub/sub" : "command"} connection`).toHaveLength(1);
    await admin.call("CLIENT", "KILL", "ID", /\bid=(\d+)/.exec(lines[0]!)![1]!);
  }

  /** Wait until a caller of `name`'s process waits in the gate's line with its steps kept. */
  async function waitingInLine(admin: Redis, prefix: string): Promise<void> {
    const gateKey = (part: string) => stageKey(prefix, "gate:cut|rate|sem", part);
    await until(
      async () => (await admin.zcard(gateKey("line"))) === 1 && (await admin.hlen(gateKey("held"))) >= 1,
      {
        timeoutMs: 5_000,
        message: "the waiter did not take its place in the gate's line with its steps kept",
      },
    );
  }

  for (const given of [false, true]) {
    it(`a waiter passed over while its pub/sub connection was away asks again once it is heard again (${given ? "a subscriber of its own" : "floodgate's"})`, async () => {
      const prefix = randomPrefix("fused-cut-sub");
      const admin = await connect();
      const holding = await member(prefix, `${prefix}holding`);
      const waiting = await member(prefix, `${prefix}waiting`, given);
      const holder = await gateOf(holding.backend).admit();
      const next = gateOf(waiting.backend).admit({ timeoutMs: 20_000 });
      await waitingInLine(admin, prefix);
      // The release runs while nobody listens for the waiter: it is passed over (its place kept
      // for its next try), and the permit stays free with nobody told.
      await cut(admin, `${prefix}waiting`, true);
      await holder.release("success");
      const ticket = await within(next, 5_000, "the waiter's admission once its pub/sub connection was back");
      await ticket.release("success");
      await Promise.all([holding.backend.close(), waiting.backend.close()]);
    });
  }

  it("a caller that gave up while its connection was away leaves the gate's line once it is back", async () => {
    const prefix = randomPrefix("fused-cut-cmd");
    const admin = await connect();
    const holding = await member(prefix, `${prefix}holding`);
    const waiting = await member(prefix, `${prefix}waiting`);
    const holder = await gateOf(holding.backend).admit();
    const gaveUp = new AbortController();
    const leaving = rejectionOf(gateOf(waiting.backend).admit({ timeoutMs: 20_000, signal: gaveUp.signal }));
    await waitingInLine(admin, prefix);
    await cut(admin, `${prefix}waiting`, false);
    await until(() => waiting.client.status !== "ready", {
      timeoutMs: 5_000,
      message: "the cut went unseen",
    });
    gaveUp.abort(new Error("gave up"));
    expect(String(await leaving)).toContain("gave up");
    // Its leave could not go while the connection was away: it goes once it is back, so the
    // caller holds nobody up (its place would otherwise last 3 × pollMs without asking).
    await until(async () => (await admin.zcard(stageKey(prefix, "gate:cut|rate|sem", "line"))) === 0, {
      timeoutMs: 5_000,
      message: "the caller that gave up stayed in the gate's line",
    });
    await holder.release("success");
    const ticket = await gateOf(holding.backend).tryAdmit();
    expect(ticket, "the permit, free for the next call").toBeDefined();
    await ticket!.release("success");
    await Promise.all([holding.backend.close(), waiting.backend.close()]);
  });
});
