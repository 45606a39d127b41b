import { type LeaseTicket, redis, stageKey } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterEach, beforeAll, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { Child, closeClient, connectedClient, randomPrefix, sleep, within } from "../redis/helpers.js";
import { describeError, SLACK_MS, serverNow, spread } from "./harness.js";

type Backend = ReturnType<typeof redis>;

const LEASE_MS = 1_000;
const HOLDER = "holder.ts";

/**
 * Holders in processes of their own, killed or frozen: what the rest of the fleet sees, timed.
 * These are the figures behind the README's guarantees (printed), with generous bounds asserted.
 */
describe("a holder process killed or frozen", () => {
  let url: string;
  const clients: Redis[] = [];
  const backends: Backend[] = [];
  const children: Child[] = [];

  beforeAll(() => {
    url = redisUrl();
  });

  afterEach(async () => {
    for (const child of children) child.process.kill("SIGCONT");
    await Promise.all(children.splice(0).map((child) => child.kill()));
    await Promise.all(backends.splice(0).map((b) => within(b.close(), 5_000, "backend.close()")));
    await Promise.all(clients.splice(0).map(closeClient));
  });

  async function connect(): Promise<Redis> {
    const client = await connectedClient(url);
    clients.push(client);
    return client;
  }

  async function semaphore(prefix: string) {
    const [client, subscriber] = await Promise.all([connect(), connect()]);
    const b = redis(client, { prefix, subscriber });
    backends.push(b);
    return b.semaphore("sem", { limit: 1, leaseMs: LEASE_MS });
  }

  function holder(prefix: string): Child {
    const child = new Child(HOLDER, { REDIS_URL: url, PREFIX: prefix, LEASE_MS: String(LEASE_MS) });
    children.push(child);
    return child;
  }

  it("SIGKILL: the permit comes back when the dead holder's lease runs out, not before, and within leaseMs", async () => {
    const rounds = 3;
    const prefixes = Array.from({ length: rounds }, (_, i) => randomPrefix(`faults-kill-${i}`));
    const holders = prefixes.map(holder);
    const sems = await Promise.all(prefixes.map(semaphore));
    const raw = await connect();
    await Promise.all(holders.map((h) => h.message("acquired", 15_000)));

    const waited: number[] = [];
    const afterExpiry: number[] = [];
    for (let i = 0; i < rounds; i++) {
      const [h, sem, prefix] = [holders[i]!, sems[i]!, prefixes[i]!];
      // Kill at a different point of the renewal cycle each round.
      await sleep(LEASE_MS * (0.3 + 0.3 * i));
      const waiting = sem.admit({ timeoutMs: LEASE_MS + 5_000 });
      waiting.catch(() => {});
      const leaseId = String((await h.message("acquired", 1_000)).leaseId);
      const readAt = performance.now();
      const [expiry, now] = await Promise.all([
        raw.zscore(stageKey(prefix, "sem", "holders"), leaseId),
        serverNow(raw),
      ]);
      const left = Number(expiry) - now;
      await h.kill();
      const killedAt = performance.now();
      const ticket = (await waiting) as LeaseTicket;
      const grantedAt = performance.now();
      const took = grantedAt - killedAt;
      waited.push(took);
      afterExpiry.push(grantedAt - readAt - left);
      // Not before the lease ran out (it was still live when read), and within a lease (plus slack).
      expect(took).toBeGreaterThanOrEqual(left - (killedAt - readAt) - 5);
      expect(took).toBeLessThan(Math.max(0, left) + SLACK_MS);
      expect(took).toBeLessThan(LEASE_MS + SLACK_MS);
      await ticket.release("success");
    }
    console.log(
      `SIGKILL of a holder (leaseMs ${LEASE_MS}): permit back after ${spread(waited)}, ` +
        `i.e. ${spread(afterExpiry)} after its lease ran out`,
    );
  });

  it("SIGSTOP past the lease, then SIGCONT: the holder learns at its first renewal, and its late release frees nothing", async () => {
    const prefix = randomPrefix("faults-freeze");
    const h = holder(prefix);
    const sem = await semaphore(prefix);
    const third = await semaphore(prefix);
    const raw = await connect();
    const acquired = await h.message("acquired", 15_000);
    await sleep(LEASE_MS * 0.5);

    const waiting = sem.admit({ timeoutMs: LEASE_MS + 5_000 });
    waiting.catch(() => {});
    h.process.kill("SIGSTOP");
    const stoppedAt = Date.now();
    const current = (await waiting) as LeaseTicket;
    const grantedAt = Date.now();
    expect(current.fence).toBeGreaterThan(Number(acquired.fence));
    // Frozen well past its lease: the next holder has the permit.
    await sleep(500);
    h.process.kill("SIGCONT");
    const resumedAt = Date.now();
    const lost = await h.message("lost", 5_000);
    await h.message("released", 5_000);
    const learnedMs = Number(lost.at) - resumedAt;
    expect(lost.code).toBe("LEASE_LOST");
    // It learns at its first renewal after it resumes: one round trip, plus slack.
    expect(learnedMs).toBeLessThan(SLACK_MS);

    // It never took the permit back, and its late release freed nothing.
    const holders = stageKey(prefix, "sem", "holders");
    expect(await raw.zrange(holders, 0, -1)).toEqual([current.leaseId]);
    expect(await raw.hget(stageKey(prefix, "sem", "meta"), "used")).toBe("1");
    expect(await third.tryAdmit()).toBeUndefined();
    expect(current.signal.aborted, describeError(current.signal.reason)).toBe(false);
    await current.release("success");

    console.log(
      `SIGSTOP of a holder (leaseMs ${LEASE_MS}): next holder granted ${grantedAt - stoppedAt} ms after the ` +
        `freeze; the frozen holder, resumed ${resumedAt - grantedAt} ms after that, learned its lease was lost ` +
        `${learnedMs} ms after resuming (overlap with the next holder ${Number(lost.at) - grantedAt} ms, ` +
        `all but ${learnedMs} ms of it while frozen)`,
    );
  });
});
