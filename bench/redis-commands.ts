/**
 * Redis round trips per admission, read from INFO commandstats: the script calls (EVALSHA/EVAL,
 * not the commands inside the scripts) plus the other top-level commands a library sends
 * (redis-semaphore releases with ZREM). Also counted on the client side, every command sent on
 * the library's connections. Uncontended, then 8 callers on 2 permits holding each permit for
 * 5 ms and for 50 ms: a polling loop shows as round trips that grow with the hold.
 */
import { redis } from "floodgate/redis";
import { Redis } from "ioredis";
import { Semaphore } from "redis-semaphore";
import { type BenchArgs, type Benchmark, median, rounds, sleep, spread, table, verdict } from "./lib.js";
import { commandStats, connect, freshPrefix } from "./redis-clients.js";

const SCRIPT_CALLS = ["evalsha", "eval", "evalsha_ro", "eval_ro"];

/** Count every command `client` sends from now on. */
function countSends(client: Redis): { n: number } {
  const counter = { n: 0 };
  const send = client.sendCommand.bind(client);
  client.sendCommand = ((...a: Parameters<Redis["sendCommand"]>) => {
    counter.n++;
    return send(...a);
  }) as Redis["sendCommand"];
  return counter;
}

interface Scenario {
  label: string;
  callers: number;
  limit: number;
  holdMs: number;
  total: number;
}

interface Lib {
  name: string;
  /** Top-level commands that are this library's round trips in commandstats. */
  commands: string[];
  /** Build a semaphore; returns acquire-then-release-after-hold and a close. */
  make(
    url: string,
    s: Scenario,
  ): Promise<{ admit: () => Promise<() => Promise<void>>; sent: () => number; close: () => Promise<void> }>;
}

const libs: Lib[] = [
  {
    name: "floodgate redis semaphore",
    commands: SCRIPT_CALLS,
    async make(url, s) {
      const client = await connect(url);
      const sub = new Redis(url, { maxRetriesPerRequest: 1 });
      sub.on("error", () => {});
      const a = countSends(client);
      const b = countSends(sub);
      const backend = redis(client, { prefix: freshPrefix("calls"), subscriber: sub });
      const sem = backend.semaphore("calls", { limit: s.limit });
      return {
        admit: async () => {
          const t = await sem.admit();
          return () => t.release("success");
        },
        sent: () => a.n + b.n,
        close: async () => {
          await backend.close();
          client.disconnect();
          sub.disconnect();
        },
      };
    },
  },
  {
    name: "redis-semaphore (10 ms poll)",
    commands: [...SCRIPT_CALLS, "zrem"],
    async make(url, s) {
      const client = await connect(url);
      const a = countSends(client);
      const key = `${freshPrefix("rs")}calls`;
      return {
        admit: async () => {
          const sem = new Semaphore(client, key, s.limit, { acquireTimeout: 60_000 });
          await sem.acquire();
          return () => sem.release();
        },
        sent: () => a.n,
        close: async () => {
          client.disconnect();
        },
      };
    },
  },
];

/** Commands that are neither a library's round trips nor run inside its scripts. */
const HOUSEKEEPING = ["info", "subscribe", "unsubscribe", "ping", "client|setname", "select", "hello"];

interface Measured {
  /** Round trips per admission (the library's top-level commands, from commandstats). */
  roundTrips: number;
  /** Every command the library's connections sent, per admission (client side). */
  sent: number;
  /** Commands run inside scripts per admission. */
  inner: number;
  /** Microseconds Redis spent executing the library's top-level commands, per admission. */
  usec: number;
}

/** One library in one scenario. */
async function measure(url: string, stats: Redis, lib: Lib, s: Scenario): Promise<Measured> {
  const m = await lib.make(url, s);
  // Warm-up, not counted: one admission per caller at once, so scripts are loaded and a waiter
  // has subscribed for grants, as in a worker that has been running.
  await Promise.all(
    Array.from({ length: s.callers }, async () => {
      const release = await m.admit();
      await new Promise((r) => setImmediate(r));
      await release();
    }),
  );
  const sent0 = m.sent();
  const before = await commandStats(stats);
  let left = s.total;
  await Promise.all(
    Array.from({ length: s.callers }, async () => {
      while (left-- > 0) {
        const release = await m.admit();
        if (s.holdMs > 0) await sleep(s.holdMs);
        else await new Promise((r) => setImmediate(r));
        await release();
      }
    }),
  );
  const after = await commandStats(stats);
  const sent = m.sent() - sent0;
  await m.close();
  let roundTrips = 0;
  let inner = 0;
  let usec = 0;
  for (const [name, a] of after) {
    const b = before.get(name) ?? { calls: 0, usec: 0 };
    if (lib.commands.includes(name)) {
      roundTrips += a.calls - b.calls;
      usec += a.usec - b.usec;
    } else if (!HOUSEKEEPING.includes(name)) inner += a.calls - b.calls;
  }
  return {
    roundTrips: roundTrips / s.total,
    sent: sent / s.total,
    inner: inner / s.total,
    usec: usec / s.total,
  };
}

export const redisCommands: Benchmark = {
  name: "redis-commands",
  title: "Redis commands per admission (INFO commandstats)",
  redis: true,
  async run(args: BenchArgs) {
    const url = await args.redisUrl();
    const stats = await connect(url);
    const count = args.rounds ?? (args.quick ? 1 : 5);
    const n = args.tasks ?? (args.quick ? 40 : 400);
    const scenarios: Scenario[] = [
      { label: "uncontended (1 caller, limit 1000)", callers: 1, limit: 1000, holdMs: 0, total: n },
      { label: "8 callers on 2 permits, 5 ms hold", callers: 8, limit: 2, holdMs: 5, total: n },
      {
        label: "8 callers on 2 permits, 50 ms hold",
        callers: 8,
        limit: 2,
        holdMs: 50,
        total: Math.max(8, Math.round(n / 4)),
      },
    ];
    const extra = new Map<string, Measured[]>();
    const contenders = scenarios.flatMap((s) =>
      libs.map((lib) => ({
        name: `${lib.name}|${s.label}`,
        async run() {
          const m = await measure(url, stats, lib, s);
          const key = `${lib.name}|${s.label}`;
          extra.set(key, [...(extra.get(key) ?? []), m]);
          return m.roundTrips;
        },
      })),
    );
    try {
      const figures = await rounds(contenders, count, { warmup: false });
      const rows: string[][] = [];
      const notes: string[] = [];
      for (const s of scenarios) {
        for (const lib of libs) {
          const key = `${lib.name}|${s.label}`;
          const f = figures.get(key)!;
          const [med, range] = spread(f, (v) => v.toFixed(2));
          const x = extra.get(key)!;
          rows.push([
            s.label,
            lib.name,
            lib.commands.includes("zrem") ? "EVALSHA + EVAL + ZREM" : "EVALSHA + EVAL",
            med,
            range,
            median(x.map((m) => m.sent)).toFixed(2),
            median(x.map((m) => m.inner)).toFixed(1),
            median(x.map((m) => m.usec)).toFixed(1),
          ]);
          if (lib.name.startsWith("floodgate")) {
            notes.push(
              `floodgate, ${s.label}: ≤ 2 round trips ${verdict(median(f) <= 2, median(f).toFixed(2))}.`,
            );
          }
        }
      }
      table(
        `Redis round trips per admission (acquire + release), ${n} admissions per figure (median of ${count} rounds)`,
        [
          "scenario",
          "library",
          "counted",
          "round trips/admission",
          "min – max",
          "all commands sent/admission",
          "commands inside scripts/admission",
          "Redis µs/admission",
        ],
        rows,
        [
          ...notes,
          "A warm-up of one admission per caller (script load, subscription) is left out of each figure. floodgate's wake-ups come over a " +
            "pub/sub connection that subscribes once; its SUBSCRIBE is in the sent column. Redis µs is " +
            "commandstats' execution time of the counted commands (a script's time includes what it runs).",
        ],
      );
    } finally {
      stats.disconnect();
    }
  },
};
