/**
 * The Redis backend on each client library it takes, in the same run: semaphore admissions per
 * second (acquire + release) from one process at 1 and 64 callers, and the handoff from a release
 * here to the grant in another process at limit 1 (p50 and p99), each library against its peers.
 */
import { once } from "node:events";
import { type RedisBackend, type RedisClient, redis } from "floodgate/redis";
import { Redis } from "ioredis";
import { Redis as Valkey } from "iovalkey";
import { createClient } from "redis";
import { createClient as createClient5 } from "redis5";
import { inbox, nowMs } from "./handoff.js";
import {
  type BenchArgs,
  type Benchmark,
  type Contender,
  median,
  ms,
  percentile,
  rounds,
  si,
  sleep,
  sorted,
  spread,
  table,
} from "./lib.js";
import { closedLoop, freshPrefix } from "./redis-clients.js";
import { forkScript } from "./worker.js";

/** A connected client of one library, configured as docs/redis.md asks, and how to close it. */
export interface Opened {
  client: RedisClient;
  close(): void;
}

/** Each library floodgate takes, by the name its rows carry. */
export const LIBRARIES: Record<string, (url: string) => Promise<Opened>> = {
  "ioredis 5": async (url) => {
    const client = new Redis(url, { enableOfflineQueue: false });
    client.on("error", () => {});
    await once(client, "ready");
    return { client, close: () => client.disconnect() };
  },
  "node-redis 6": async (url) => {
    const client = createClient({ url, disableOfflineQueue: true });
    client.on("error", () => {});
    await client.connect();
    return { client, close: () => client.destroy() };
  },
  "node-redis 5": async (url) => {
    const client = createClient5({ url, disableOfflineQueue: true });
    client.on("error", () => {});
    await client.connect();
    return { client, close: () => client.destroy() };
  },
  iovalkey: async (url) => {
    const client = new Valkey(url, { enableOfflineQueue: false });
    client.on("error", () => {});
    await once(client, "ready");
    return { client, close: () => client.disconnect() };
  },
};

/** A stage name for a library's rows: `node-redis-6`. */
const slug = (name: string) => name.replace(/\W+/g, "-");

export const clientLibraries: Benchmark = {
  name: "redis-client-libraries",
  title: "Redis backend on ioredis, node-redis 6 and 5, iovalkey: admissions/s and handoff",
  redis: true,
  async run(args: BenchArgs) {
    const url = await args.redisUrl();
    const count = args.rounds ?? (args.quick ? 1 : 5);
    const seconds = args.seconds ?? (args.quick ? 0.5 : 3);
    const h = args.handoffs ?? (args.quick ? 20 : 200);
    const prefix = freshPrefix("libraries");
    const names = Object.keys(LIBRARIES);
    const opened = new Map<string, Opened>();
    const backends = new Map<string, RedisBackend>();
    for (const name of names) {
      const o = await LIBRARIES[name]!(url);
      opened.set(name, o);
      backends.set(name, redis(o.client, { prefix }));
    }
    const child = forkScript(new URL("./client-libraries-child.ts", import.meta.url), [url, prefix], {
      stdio: ["ignore", "inherit", "inherit", "ipc"],
    });
    const next = inbox(child, "client-libraries child");
    let seed = 42;
    const jitter = () => {
      seed = (seed * 1103515245 + 12345) & 0x7fffffff;
      return 5 + (seed % 1000) / 100; // 5–15 ms after the waiter queued
    };

    /** Admissions per second on `name` at `callers`, each library on a stage of its own. */
    const throughput = (name: string, callers: number): Contender => {
      const sem = backends.get(name)!.semaphore(`tp-${callers}-${slug(name)}`, { limit: 1_000_000 });
      return {
        name: `${name} ×${callers}`,
        async run(round) {
          const r = await closedLoop(callers, round < 0 ? Math.min(seconds, 0.5) : seconds, async () =>
            (await sem.admit()).release("success"),
          );
          return r.rate;
        },
      };
    };

    const p99s = new Map<string, number[]>();
    /** Handoff release here → grant in the child, both on `name`; the round's figure is its p50. */
    const handoff = (name: string): Contender => {
      const stage = `handoff-${slug(name)}`;
      const sem = backends.get(name)!.semaphore(stage, { limit: 1 });
      return {
        name: `${name} handoff`,
        async run(round) {
          const lat: number[] = [];
          for (let i = 0; i < (round < 0 ? Math.min(h, 10) : h); i++) {
            const held = await sem.admit();
            child.send({ kind: "wait", lib: name, stage });
            await next("queued");
            await sleep(jitter());
            const releasedAt = nowMs();
            await held.release("success");
            lat.push((await next("granted")).at! - releasedAt);
          }
          const s = sorted(lat);
          if (round >= 0) p99s.set(name, [...(p99s.get(name) ?? []), percentile(s, 99)]);
          return percentile(s, 50);
        },
      };
    };

    try {
      await next("ready");
      const contenders = names.flatMap((name) => [throughput(name, 1), throughput(name, 64), handoff(name)]);
      const figures = await rounds(contenders, count);
      const rows = names.map((name) => {
        const one = figures.get(`${name} ×1`)!;
        const many = figures.get(`${name} ×64`)!;
        const [p50, p50r] = spread(figures.get(`${name} handoff`)!, (v) => ms(v));
        return [
          name,
          `${si(median(one))}/s`,
          `${si(median(many))}/s`,
          p50,
          p50r,
          ms(median(p99s.get(name)!)),
        ];
      });
      table(
        `Redis backend per client library: semaphore acquire + release, ${seconds} s per figure; handoff at limit 1, ${h} per round (median of ${count} rounds)`,
        ["client", "admissions ×1", "admissions ×64", "handoff p50", "p50 min – max", "handoff p99"],
        rows,
        [
          "Each library on a connection of its own to the same redis-server, with the same stages; the handoff's waiter runs in another process on the same library.",
        ],
      );
    } finally {
      child.send({ kind: "exit" });
      await once(child, "exit");
      for (const [name, backend] of backends) {
        await backend.close();
        opened.get(name)!.close();
      }
    }
  },
};
