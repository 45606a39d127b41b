/**
 * Redis throughput from one process, at 1 and 64 callers, each contender on a connection of its
 * own: semaphore acquire + release (floodgate vs redis-semaphore, floor PING ÷ 2 since an
 * admission is two round trips), token bucket take (floodgate vs rate-limiter-flexible's
 * RateLimiterRedis, floor PING), and a Gate of 1 to 5 Redis stages (none binding) against one
 * holding the semaphore alone, with the script calls each admission costs.
 */
import { Gate, type Stage } from "floodgate";
import { type RedisBackend, redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { pino } from "pino";
import { RateLimiterRedis } from "rate-limiter-flexible";
import { Semaphore } from "redis-semaphore";
import { floorGate } from "./gate-floor.js";
import {
  type BenchArgs,
  type Benchmark,
  type Contender,
  median,
  ms,
  pairedRatio,
  pct,
  percentile,
  rounds,
  si,
  spread,
  table,
  times,
  verdict,
} from "./lib.js";
import { closedLoop, commandStats, connect, freshPrefix } from "./redis-clients.js";

const MAX = 2 ** 31 - 1;

/** A contender that also keeps each round's p50 and p99 latency and CPU per operation. */
export interface Timed extends Contender {
  p50: number[];
  p99: number[];
  /** CPU µs per operation: of redis-server (INFO cpu) and of this process. */
  redisCpu: number[];
  clientCpu: number[];
  /** Microseconds Redis spent running scripts (EVALSHA/EVAL in INFO commandstats), per operation. */
  scriptUsec: number[];
  /** Script calls (EVALSHA/EVAL) per operation. */
  scriptCalls: number[];
}

const SCRIPT_CALLS = ["evalsha", "eval"];

/** Microseconds of script time, and script calls, in INFO commandstats so far. */
async function scriptStats(client: Redis): Promise<{ usec: number; calls: number }> {
  const stats = await commandStats(client);
  let usec = 0;
  let calls = 0;
  for (const name of SCRIPT_CALLS) {
    usec += stats.get(name)?.usec ?? 0;
    calls += stats.get(name)?.calls ?? 0;
  }
  return { usec, calls };
}

type Op = () => Promise<unknown>;

/** `make` builds a fresh contender for a round: its operation, and what to close afterwards. */
export function timed(
  name: string,
  seconds: number,
  callers: number,
  info: Redis,
  make: () => Op | [Op, () => Promise<void>],
): Timed {
  const t: Timed = {
    name,
    p50: [],
    p99: [],
    redisCpu: [],
    clientCpu: [],
    scriptUsec: [],
    scriptCalls: [],
    async run(round) {
      const made = make();
      const [op, close] = Array.isArray(made) ? made : [made, undefined];
      const script0 = await scriptStats(info);
      const cpu0 = await serverCpu(info);
      const own0 = process.cpuUsage();
      const r = await closedLoop(callers, seconds, op);
      const own = process.cpuUsage(own0);
      const cpu1 = await serverCpu(info);
      const script1 = await scriptStats(info);
      await close?.();
      if (round >= 0) {
        const n = r.latencies.length;
        t.p50.push(percentile(r.latencies, 50));
        t.p99.push(percentile(r.latencies, 99));
        t.redisCpu.push(((cpu1 - cpu0) * 1e6) / n);
        t.clientCpu.push((own.user + own.system) / n);
        t.scriptUsec.push((script1.usec - script0.usec) / n);
        t.scriptCalls.push((script1.calls - script0.calls) / n);
      }
      return r.rate;
    },
  };
  return t;
}

/** Seconds of CPU redis-server has used. */
async function serverCpu(client: Redis): Promise<number> {
  const info = await client.info("cpu");
  const field = (name: string) => Number(new RegExp(`${name}:([\\d.]+)`).exec(info)?.[1] ?? 0);
  return field("used_cpu_user") + field("used_cpu_sys");
}

interface Clients {
  ping: Redis;
  floodgate: Redis;
  peer: Redis;
  all: Redis[];
}

async function clients(url: string): Promise<Clients> {
  const [ping, floodgate, peer] = await Promise.all([connect(url), connect(url), connect(url)]);
  return { ping, floodgate, peer, all: [ping, floodgate, peer] };
}

function seconds(args: BenchArgs): number {
  return args.seconds ?? (args.quick ? 0.15 : 2);
}

/**
 * Run `body` at 1 and at 64 callers, on fresh clients of the benchmark's Redis (closed after),
 * with the seconds per figure and the rounds the command line asks for.
 */
async function byCallers(
  args: BenchArgs,
  body: (c: Clients, callers: number, seconds: number, rounds: number) => Promise<void>,
): Promise<void> {
  const c = await clients(await args.redisUrl());
  const s = seconds(args);
  const count = args.rounds ?? (args.quick ? 1 : 5);
  try {
    for (const callers of [1, 64]) await body(c, callers, s, count);
  } finally {
    for (const x of c.all) x.disconnect();
  }
}

/** A table of `list`: rates against `peer` and `floor` (÷ `floorDivisor`), latencies, CPU. */
export function report(
  title: string,
  list: Timed[],
  figures: Map<string, number[]>,
  peer: string,
  floor: string,
  floorDivisor: number,
  notes: string[],
): void {
  const peerF = figures.get(peer)!;
  const floorF = figures.get(floor)!.map((v) => v / floorDivisor);
  const rows = list.map((c) => {
    const f = c.name === floor ? floorF : figures.get(c.name)!;
    const [med, range] = spread(f, si);
    return [
      c.name === floor && floorDivisor !== 1 ? `${c.name} ÷ ${floorDivisor}` : c.name,
      `${med}/s`,
      range,
      times(pairedRatio(f, peerF)),
      pct(pairedRatio(f, floorF)),
      ms(median(c.p50), 3),
      ms(median(c.p99), 3),
      median(c.redisCpu).toFixed(1),
      median(c.clientCpu).toFixed(1),
    ];
  });
  table(
    title,
    [
      "contender",
      "ops/s (median)",
      "min – max",
      `vs ${peer}`,
      "of floor",
      "p50 latency",
      "p99 latency",
      "redis-server CPU µs/op",
      "client CPU µs/op",
    ],
    rows,
    [
      ...notes,
      "CPU per operation: redis-server's (INFO cpu) and this process's, over the same window; both share " +
        "the machine's cores, so together they bound the rate.",
    ],
  );
}

export const redisSemaphore: Benchmark = {
  name: "redis-semaphore",
  title: "Redis semaphore acquire + release, 1 and 64 callers",
  redis: true,
  run(args: BenchArgs) {
    return byCallers(args, async (c, callers, s, count) => {
      const list: Timed[] = [
        timed("ioredis PING (floor)", s, callers, c.ping, () => () => c.ping.ping()),
        timed("floodgate redis semaphore", s, callers, c.ping, () => {
          const backend = redis(c.floodgate, { prefix: freshPrefix("sem") });
          const sem = backend.semaphore("tp", { limit: 1_000_000 });
          return [
            async () => {
              const t = await sem.admit();
              await t.release("success");
            },
            () => backend.close(),
          ];
        }),
        timed("redis-semaphore", s, callers, c.ping, () => {
          const key = `${freshPrefix("rs")}tp`;
          return async () => {
            const sem = new Semaphore(c.peer, key, 1_000_000);
            await sem.acquire();
            await sem.release();
          };
        }),
      ];
      const figures = await rounds(list, count);
      const fg = pairedRatio(
        figures.get("floodgate redis semaphore")!,
        figures.get("ioredis PING (floor)")!.map((v) => v / 2),
      );
      const vsPeer = pairedRatio(figures.get("floodgate redis semaphore")!, figures.get("redis-semaphore")!);
      const notes =
        callers === 64
          ? [
              `Target ≥ 90% of PING ÷ 2 at 64 callers: ${verdict(fg >= 0.9, pct(fg))}; ` +
                `vs redis-semaphore ${times(vsPeer)} (about 2× expected).`,
            ]
          : [`At 1 caller: ${pct(fg)} of PING ÷ 2, ${times(vsPeer)} redis-semaphore (no target).`];
      report(
        `Redis semaphore acquire + release, ${callers} caller${callers === 1 ? "" : "s"}, ${s} s per figure (median of ${count} rounds)`,
        list,
        figures,
        "redis-semaphore",
        "ioredis PING (floor)",
        2,
        notes,
      );
    });
  },
};

export const redisTokenBucket: Benchmark = {
  name: "redis-bucket",
  title: "Redis token bucket take, 1 and 64 callers",
  redis: true,
  run(args: BenchArgs) {
    return byCallers(args, async (c, callers, s, count) => {
      const list: Timed[] = [
        timed("ioredis PING (floor)", s, callers, c.ping, () => () => c.ping.ping()),
        timed("floodgate redis tokenBucket", s, callers, c.ping, () => {
          const backend = redis(c.floodgate, { prefix: freshPrefix("tb") });
          const bucket = backend.tokenBucket("tp", { capacity: MAX, refillPerSecond: 1e9 });
          return [
            async () => {
              const t = await bucket.admit();
              await t.release("success");
            },
            () => backend.close(),
          ];
        }),
        timed("rate-limiter-flexible RateLimiterRedis", s, callers, c.ping, () => {
          const limiter = new RateLimiterRedis({
            storeClient: c.peer,
            keyPrefix: freshPrefix("rlf"),
            points: MAX,
            duration: 60,
          });
          return () => limiter.consume("default", 1);
        }),
      ];
      const figures = await rounds(list, count);
      const fg = pairedRatio(
        figures.get("floodgate redis tokenBucket")!,
        figures.get("ioredis PING (floor)")!,
      );
      const script = (name: string) => median(list.find((x) => x.name === name)!.scriptUsec).toFixed(1);
      const notes = [
        `Target ≥ 0.9× PING: ${verdict(fg >= 0.9, times(fg))}.`,
        `Script time inside Redis per take (INFO commandstats, EVALSHA): floodgate ${script("floodgate redis tokenBucket")} µs, ` +
          `rate-limiter-flexible ${script("rate-limiter-flexible RateLimiterRedis")} µs; part of the redis-server CPU column.`,
      ];
      report(
        `Redis token bucket take, ${callers} caller${callers === 1 ? "" : "s"}, ${s} s per figure (median of ${count} rounds)`,
        list,
        figures,
        "rate-limiter-flexible RateLimiterRedis",
        "ioredis PING (floor)",
        1,
        notes,
      );
    });
  },
};

/**
 * The stages of a gate of `n` Redis stages as #14 counts them, none binding: see `redisGate` (and
 * `gate-cuts`, which takes the four stages apart).
 */
export const GATES: Record<string, (b: RedisBackend) => Stage[]> = {
  "semaphore alone": (b) => [b.semaphore("sem", { limit: 1_000_000 })],
  "1: bucket": (b) => [b.tokenBucket("rate", { capacity: MAX, refillPerSecond: 1e9 })],
  "2: + interval gate": (b) => [...GATES["1: bucket"]!(b), b.intervalGate("hosts", { minIntervalMs: 0 })],
  "3: + semaphore": (b) => [...GATES["2: + interval gate"]!(b), b.semaphore("sem", { limit: 1_000_000 })],
  "4: + AIMD": (b) => [
    ...GATES["3: + semaphore"]!(b),
    b.aimd("aimd", { initial: 1_000_000, min: 1, max: 1_000_000 }),
  ],
  "5: rpm + tpm buckets, interval gate, semaphore, AIMD": (b) => [
    b.tokenBucket("rpm", { capacity: MAX, refillPerSecond: 1e9 }),
    ...GATES["4: + AIMD"]!(b),
  ],
};

/**
 * The logger of the gates taken stage by stage: they keep #14's order (the buckets and the
 * interval gate before the permit stages), which the stage-order rule warns of, on purpose.
 * Silent, as a gate without a logger is but for that warning.
 */
const quiet = pino({ level: "silent" });

/**
 * A Gate contender's operation for `timed`: a fresh backend on `client`, a Gate of `stages`
 * (fused or not), `gate.run` of an empty task to one host; and what closes it.
 */
export function gateRun(
  client: Redis,
  stages: (b: RedisBackend) => Stage[],
  fuse: boolean,
): [Op, () => Promise<void>] {
  const backend = redis(client, { prefix: freshPrefix("gate") });
  const gate = new Gate(stages(backend), { fuse, logger: quiet });
  const task = () => undefined;
  return [() => gate.run(task, { host: "api.example" }), () => backend.close()];
}

/** The floors' names in the table (bench/gate-floor.ts). */
const FLOOR = { 1: "floor: semaphore, hand-written", 4: "floor: 4 stages, hand-written" } as const;

export const redisGate: Benchmark = {
  name: "redis-gate",
  title: "a Gate of 1 to 5 Redis stages, 1 and 64 callers",
  redis: true,
  run(args: BenchArgs) {
    return byCallers(args, async (c, callers, s, count) => {
      const list: Timed[] = [
        timed("ioredis PING (floor)", s, callers, c.ping, () => () => c.ping.ping()),
        // Each gate of two or more stages twice: taken one stage after another (as before the
        // fused gate), and fused.
        ...Object.entries(GATES).flatMap(([name, stages]) =>
          [false, true]
            .filter((fuse) => fuse || /^[2-5]:/.test(name))
            .map((fuse) =>
              timed(
                fuse || !/^[2-5]:/.test(name) ? name : `${name.split(":")[0]}: chained`,
                s,
                callers,
                c.ping,
                () => gateRun(c.floodgate, stages, fuse),
              ),
            ),
        ),
        // What no fused gate can beat here (bench/gate-floor.ts): only the commands, one flat reply.
        ...([1, 4] as const).map((n) =>
          timed(FLOOR[n], s, callers, c.ping, () => floorGate(c.floodgate, freshPrefix("floor"), n)),
        ),
      ];
      const figures = await rounds(list, count);
      const ratio = (name: string) => pairedRatio(figures.get(name)!, figures.get("semaphore alone")!);
      // A p50 against the semaphore alone's as every other ratio here is taken: the median of
      // each round's ratio, so the drift of a noisy machine between rounds does not decide it.
      const p50Of = (name: string) => list.find((x) => x.name === name)!.p50;
      const p50Ratio = (name: string) => pairedRatio(p50Of(name), p50Of("semaphore alone"));
      const calls = list
        .filter((x) => x.name !== "ioredis PING (floor)")
        .map(
          (x) =>
            `${x.name.startsWith("floor") ? x.name.split(",")[0] : x.name.split(":")[0]} ${median(x.scriptCalls).toFixed(2)}`,
        )
        .join(", ");
      const four = "4: + AIMD";
      const floorNote =
        "Floors (bench/gate-floor.ts): one hand-written script per turn of admissions and one per turn of " +
        "releases doing only the commands an uncontended admission of those stages needs (no lines, reaping, " +
        "fencing checks, quarantine, lanes, grants or renewal), one flat reply, one promise per call: what no " +
        `fused gate can beat on this machine. The 4-stage floor against the semaphore alone: ` +
        (callers === 1
          ? `p50 ${p50Ratio(FLOOR[4]).toFixed(2)}×.`
          : `${times(ratio(FLOOR[4]))} the calls per second.`);
      const notes =
        callers === 1
          ? [
              `Target (#14) at 1 caller: p50 of a 4-stage gate ≤ 1.3× the semaphore alone's: ` +
                `${verdict(p50Ratio(four) <= 1.3, `${p50Ratio(four).toFixed(2)}×, the median of each round's ratio`)}.`,
              floorNote,
              `Script calls per admission (admit and release): ${calls}.`,
            ]
          : [
              `Target (#14) at 64 callers: a 4-stage gate ≥ 0.8× the calls per second of the semaphore alone: ` +
                `${verdict(ratio(four) >= 0.8, times(ratio(four)))}.`,
              floorNote,
              `Script calls per admission (admit and release): ${calls}.`,
            ];
      report(
        `A Gate of Redis stages (none binding), gate.run of an empty task, ${callers} caller${callers === 1 ? "" : "s"}, ${s} s per figure (median of ${count} rounds)`,
        list,
        figures,
        "semaphore alone",
        "ioredis PING (floor)",
        1,
        notes,
      );
    });
  },
};
