import { Gate } from "floodgate";
import { redis, stageKey } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterEach, beforeAll, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { Child, closeClient, connectedClient, randomPrefix, sleep, until, within } from "../redis/helpers.js";
import { SLACK_MS } from "./harness.js";

const LEASE_MS = 1_000;
const POLL_MS = 200;
const CALLER = "gate-caller.ts";

/**
 * A fused gate's holders and waiters in processes of their own, killed or frozen: the permit of
 * a dead holder comes back with its lease and not before; a dead waiter's place in the gate's
 * line ends; a frozen holder learns its lease was lost and its late release frees nothing.
 */
describe("a fused gate's process killed or frozen", () => {
  let url: string;
  const clients: Redis[] = [];
  const closers: (() => Promise<void>)[] = [];
  const children: Child[] = [];

  beforeAll(() => {
    url = redisUrl();
  });

  afterEach(async () => {
    for (const child of children) child.process.kill("SIGCONT");
    await Promise.all(children.splice(0).map((child) => child.kill()));
    await Promise.all(closers.splice(0).map((close) => within(close(), 5_000, "backend.close()")));
    await Promise.all(clients.splice(0).map(closeClient));
  });

  /** This process's gate: the fixture's stages on their own connection. */
  async function gate(prefix: string): Promise<Gate> {
    const [client, subscriber] = await Promise.all([connectedClient(url), connectedClient(url)]);
    clients.push(client, subscriber);
    const b = redis(client, { prefix, subscriber, pollMs: POLL_MS });
    closers.push(() => b.close());
    const g = new Gate([
      b.tokenBucket("rate", { capacity: 100, refillPerSecond: 100 }),
      b.semaphore("sem", { limit: 1, leaseMs: LEASE_MS }),
      b.aimd("adaptive", { initial: 4, max: 4, leaseMs: LEASE_MS }),
    ]);
    expect(g.fused).toBe(true);
    return g;
  }

  function caller(prefix: string, wait = false): Child {
    const env: Record<string, string> = {
      REDIS_URL: url,
      PREFIX: prefix,
      LEASE_MS: String(LEASE_MS),
      POLL_MS: String(POLL_MS),
    };
    if (wait) env.WAIT = "1";
    const child = new Child(CALLER, env);
    children.push(child);
    return child;
  }

  it("SIGKILL of a holder: its permit comes back when its lease runs out, not before", async () => {
    const prefix = randomPrefix("faults-gate-kill");
    const holder = caller(prefix);
    await holder.message("acquired", 15_000);
    const mine = await gate(prefix);
    const raw = await connectedClient(url);
    clients.push(raw);
    const holders = stageKey(prefix, "sem", "holders");
    await sleep(LEASE_MS * 0.4);
    const waiting = mine.admit({ timeoutMs: LEASE_MS + 5_000 });
    waiting.catch(() => {});
    const [, score] = await raw.zrange(holders, 0, 0, "WITHSCORES");
    const [seconds, micros] = await raw.time();
    const left = Number(score) - (Number(seconds) * 1000 + Math.floor(Number(micros) / 1000));
    await holder.kill();
    const killedAt = performance.now();
    const ticket = await waiting;
    const took = performance.now() - killedAt;
    // The lease it held had `left` ms to run when it was killed: the permit waits that long.
    expect(took).toBeGreaterThanOrEqual(left - SLACK_MS);
    expect(took).toBeLessThanOrEqual(LEASE_MS + POLL_MS * 2 + SLACK_MS);
    expect(await raw.zcard(holders)).toBe(1);
    await ticket.release("success");
    expect(await raw.zcard(holders)).toBe(0);
  });

  it("SIGKILL of the first waiter in line: the line moves on once its place ends", async () => {
    const prefix = randomPrefix("faults-gate-waiter");
    const mine = await gate(prefix);
    const held = await mine.admit();
    const waiter = caller(prefix, true);
    await waiter.message("waiting", 15_000);
    const raw = await connectedClient(url);
    clients.push(raw);
    const line = stageKey(prefix, "gate:gate|rate|sem|adaptive", "line");
    await until(async () => (await raw.zcard(line)) === 1, {
      timeoutMs: 5_000,
      message: "the child did not line up",
    });
    // Behind the child in line, then the child dies, then the permit is freed.
    const next = mine.admit({ timeoutMs: 10_000 });
    next.catch(() => {});
    await until(async () => (await raw.zcard(line)) === 2, {
      timeoutMs: 5_000,
      message: "this call did not line up",
    });
    await waiter.kill();
    const killedAt = performance.now();
    await held.release("success");
    const ticket = await next;
    const took = performance.now() - killedAt;
    // A place not asked for again lasts 3 polls after the last ask; a poll later, the next asks.
    expect(took).toBeLessThanOrEqual(POLL_MS * 5 + SLACK_MS);
    expect(await raw.zcard(line)).toBe(0);
    await ticket.release("success");
  });

  it("SIGSTOP of a holder past its lease: its ticket's signal aborts with LEASE_LOST and its late release frees nothing", async () => {
    const prefix = randomPrefix("faults-gate-stop");
    const holder = caller(prefix);
    await holder.message("acquired", 15_000);
    const mine = await gate(prefix);
    const raw = await connectedClient(url);
    clients.push(raw);
    holder.process.kill("SIGSTOP");
    const ticket = await mine.admit({ timeoutMs: LEASE_MS * 3 + 5_000 });
    holder.process.kill("SIGCONT");
    const lost = await holder.message("lost", 5_000);
    expect(lost.code).toBe("LEASE_LOST");
    await holder.message("released", 5_000);
    // This process's permit is still held: the late release freed nothing of it.
    expect(await raw.zcard(stageKey(prefix, "sem", "holders"))).toBe(1);
    expect(await mine.tryAdmit()).toBe(undefined);
    await ticket.release("success");
  });
});
