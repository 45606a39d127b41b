import { stageKey } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterEach, beforeAll, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { Child, closeClient, connectedClient, randomPrefix } from "../redis/helpers.js";

const CALLER = "drain-worker.ts";
const LIMIT = 4;

/**
 * A worker on Redis told SIGTERM in the middle of its load: it drains (drainOnSignals) and exits,
 * with every call that fits in the grace finished, none cut before the grace ran out, and no lease
 * left in Redis for the fleet to wait out.
 */
describe("a Redis worker drained on SIGTERM", () => {
  let url: string;
  const clients: Redis[] = [];
  const children: Child[] = [];

  beforeAll(() => {
    url = redisUrl();
  });

  afterEach(async () => {
    await Promise.all(children.splice(0).map((child) => child.kill()));
    await Promise.all(clients.splice(0).map(closeClient));
  });

  function worker(prefix: string, serviceMs: number, graceMs: number): Child {
    const child = new Child(CALLER, {
      REDIS_URL: url,
      PREFIX: prefix,
      LIMIT: String(LIMIT),
      CALLERS: String(LIMIT * 2),
      SERVICE_MS: String(serviceMs),
      GRACE_MS: String(graceMs),
    });
    children.push(child);
    return child;
  }

  async function drained(child: Child, prefix: string) {
    await child.message("busy", 15_000);
    child.process.kill("SIGTERM");
    const result = await child.message("drained", 15_000);
    expect(await child.exit(10_000)).toBe(0);
    const raw = await connectedClient(url);
    clients.push(raw);
    // No lease left: the next worker of the fleet gets the permits at once.
    expect(await raw.zcard(stageKey(prefix, "sem", "holders"))).toBe(0);
    const calls = child.messages.filter((m) => m.type === "call");
    return { result, calls };
  }

  it("lets the calls in flight finish within the grace, and leaves no lease", async () => {
    const prefix = randomPrefix("faults-drain-finish");
    const { result, calls } = await drained(worker(prefix, 300, 5_000), prefix);
    expect(result).toMatchObject({ completed: LIMIT, aborted: 0, rejected: LIMIT });
    expect(calls.filter((c) => c.ok === true)).toHaveLength(LIMIT);
    expect(calls.filter((c) => c.ok === false)).toHaveLength(0);
  });

  it("cuts the calls that outlive the grace, not one before it, and releases their leases", async () => {
    const prefix = randomPrefix("faults-drain-cut");
    const graceMs = 800;
    const { result, calls } = await drained(worker(prefix, 60_000, graceMs), prefix);
    expect(result).toMatchObject({ completed: 0, aborted: LIMIT, rejected: LIMIT });
    const cut = calls.filter((c) => c.ok === false);
    expect(cut).toHaveLength(LIMIT);
    // Cut at the end of the grace, on the worker's clock (timers fire at or after their time).
    for (const c of cut) expect(c.cutAfterMs as number).toBeGreaterThanOrEqual(graceMs - 1);
  });
});
