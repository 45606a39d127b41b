import { once } from "node:events";
import { redis } from "floodgate/redis";
import { Redis } from "ioredis";
import { afterEach, describe, expect, it } from "vitest";
import { type Provider, startProvider } from "../../examples/provider.js";
import { redisUrl } from "../contract/backends.js";
import { Child, closeClient, connectedClient, randomPrefix, sleep, until } from "./helpers.js";

const WORKERS = 6;
const CALLERS = 3;
const REQUESTS = 6;
const LIMIT = 4;

describe("a fleet of processes sharing a Redis semaphore", () => {
  const children: Child[] = [];
  let provider: Provider | undefined;
  let raw: Redis | undefined;

  afterEach(async () => {
    await Promise.all(children.splice(0).map((child) => child.kill()));
    await provider?.close();
    provider = undefined;
    await closeClient(raw);
    raw = undefined;
  });

  it("keeps a provider capped at the limit across processes, with no 429 and every request done", async () => {
    const url = redisUrl();
    const prefix = randomPrefix("fleet");
    provider = await startProvider({ cap: LIMIT, serviceMs: 20 });
    for (let worker = 0; worker < WORKERS; worker++) {
      children.push(
        new Child("worker.ts", {
          REDIS_URL: url,
          PREFIX: prefix,
          PROVIDER_URL: provider.url,
          LIMIT: String(LIMIT),
          CALLERS: String(CALLERS),
          REQUESTS: String(REQUESTS),
          WORKER: String(worker),
        }),
      );
    }
    await Promise.all(children.map((child) => child.message("ready", 15_000)));
    for (const child of children) child.send({ type: "go" });

    const results = await Promise.all(children.map((child) => child.message("done", 25_000)));
    const codes = await Promise.all(children.map((child) => child.exit(5_000)));
    expect(codes).toEqual(Array(WORKERS).fill(0));

    const total = WORKERS * CALLERS * REQUESTS;
    const sum = (field: string) => results.reduce((n, r) => n + Number(r[field]), 0);
    expect({ ok: sum("ok"), rejected: sum("rejected"), failed: sum("failed") }).toEqual({
      ok: total,
      rejected: 0,
      failed: 0,
    });
    const stats = provider.stats();
    console.log(
      `fleet: ${WORKERS} processes × ${CALLERS} callers, limit ${LIMIT}: provider peak ${stats.peak}, ` +
        `${stats.completed}/${total} completed, 429s ${stats.rejected429}`,
    );
    expect(stats.rejected429).toBe(0);
    expect(stats.completed).toBe(total);
    expect(stats.peak).toBeLessThanOrEqual(LIMIT);
    // The callers did contend: more than one request was in flight at some point.
    expect(stats.peak).toBeGreaterThan(1);

    // Every permit came back: nothing is held in Redis once the workers are gone.
    raw = await connectedClient(url);
    expect(await raw.zcard(`${prefix}{provider}:holders`)).toBe(0);
  }, 40_000);
});

describe("wake-ups between processes", () => {
  const clients: Redis[] = [];

  afterEach(async () => {
    await Promise.all(clients.splice(0).map((client) => closeClient(client)));
  });

  /** A fail-fast client as an application would make it: connecting at once, or on `connect()`. */
  async function appClient(url: string, lazyConnect: boolean): Promise<Redis> {
    const client = new Redis(url, { maxRetriesPerRequest: 0, enableOfflineQueue: false, lazyConnect });
    clients.push(client);
    client.on("error", () => {});
    if (lazyConnect) await client.connect();
    else if (client.status !== "ready") await once(client, "ready");
    return client;
  }

  it.each([{ lazyConnect: false }, { lazyConnect: true }])(
    "wakes a waiter in another process by pub/sub, with the default subscriber (lazyConnect: $lazyConnect)",
    async ({ lazyConnect }) => {
      const url = redisUrl();
      const prefix = randomPrefix("wake");
      // Two processes, each with a client that has no offline queue (as the README recommends) and
      // the default pub/sub connection (the client's duplicate). The poll is slow and the lease
      // long, so only a wake-up message can hand the permit over quickly.
      const [a, b, raw] = await Promise.all([
        appClient(url, lazyConnect),
        appClient(url, lazyConnect),
        connectedClient(url),
      ]);
      clients.push(raw);
      const options = { prefix, pollMs: 10_000, random: () => 0 };
      const holderSide = redis(a, options);
      const waiterSide = redis(b, options);
      try {
        const holder = holderSide.semaphore("sem", { limit: 1, leaseMs: 30_000 });
        const waiter = waiterSide.semaphore("sem", { limit: 1, leaseMs: 30_000 });
        const held = await holder.admit();
        let grantedAt = 0;
        const next = waiter.admit({ timeoutMs: 4_000 }).then((ticket) => {
          grantedAt = performance.now();
          return ticket;
        });
        next.catch(() => {});
        await until(async () => (await raw.zcard(`${prefix}{sem}:queue`)) === 1, {
          timeoutMs: 3_000,
          message: "the waiter never queued in Redis",
        });
        // Give the waiter's side a moment to subscribe (a working one does so within milliseconds).
        const deadline = performance.now() + 1_500;
        while (performance.now() < deadline && (await raw.pubsub("CHANNELS", `${prefix}*`)).length === 0) {
          await sleep(25);
        }

        const releasedAt = performance.now();
        await held.release("success");
        const ticket = await next;
        expect(grantedAt - releasedAt).toBeLessThan(1_500);
        await ticket.release("success");
      } finally {
        await Promise.all([holderSide.close(), waiterSide.close()]);
      }
    },
  );
});
