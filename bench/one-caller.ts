/**
 * Where one caller's call goes, part by part: `gate.run` of an empty task at one caller, through
 * a gate of the semaphore alone and through the four-stage fused gate #14 counts. Each script
 * call is stamped as it leaves the client (`sendCommand`, before it is written) and as its reply
 * settles there. So a call splits into this process's time before its admission is sent, the
 * admission's round trip, this process's time from that reply to the release's sending (the
 * tickets, the task, the release made), the release's round trip, and what is left after its
 * reply; Redis's own time for the two script calls, read from INFO commandstats for each block
 * of calls, splits the round trips into Redis and the rest (the socket, the kernel, the reply
 * read). The two gates take turns in blocks, so that the machine's drift falls on both.
 */
import { Gate, type Stage } from "floodgate";
import { type RedisBackend, redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { type BenchArgs, type Benchmark, median, table, times } from "./lib.js";
import { commandStats, connect, freshPrefix } from "./redis-clients.js";
import { GATES } from "./redis-throughput.js";

/** The parts of one call, in µs (see the file's comment). */
const PARTS = [
  "before the admission is sent",
  "the admission's round trip",
  "from its reply to the release sent",
  "the release's round trip",
  "after the release's reply",
  "the whole call (p50)",
  "of the round trips, inside Redis",
] as const;

/** One contender: a gate on its own client, whose script calls are stamped. */
interface Contender {
  name: string;
  client: Redis;
  backend: RedisBackend;
  gate: Gate;
  /** Each script call of the call under way: when it was sent and when its reply came (ms). */
  calls: { sent: number; replied: number }[];
  /** Per call: its parts but Redis's own (µs), and its whole time (µs, last). */
  rows: number[][];
  /** Per block: Redis's own µs a call, its script calls' in all. */
  redis: number[];
}

/** A contender named `name`: a gate of `stages` on a client of its own, its script calls stamped. */
async function contender(
  url: string,
  name: string,
  stages: (b: RedisBackend) => Stage[],
): Promise<Contender> {
  const client = await connect(url);
  const backend = redis(client, { prefix: freshPrefix("one") });
  const c: Contender = {
    name,
    client,
    backend,
    gate: new Gate(stages(backend)),
    calls: [],
    rows: [],
    redis: [],
  };
  const send = client.sendCommand.bind(client);
  client.sendCommand = ((command: { name: string; promise: Promise<unknown> }, ...rest: unknown[]) => {
    // (Stamped before it is written: the write, a system call, is part of the round trip.)
    const stamp = { sent: performance.now(), replied: Number.NaN };
    const out = (send as (...a: unknown[]) => Promise<unknown>)(command, ...rest);
    if (command.name === "evalsha" || command.name === "eval") {
      c.calls.push(stamp);
      command.promise.then(
        () => {
          stamp.replied = performance.now();
        },
        () => {},
      );
    }
    return out;
  }) as typeof client.sendCommand;
  return c;
}

/** `n` calls of `c`'s gate at one caller, each split into its parts; Redis's time from its stats. */
async function block(c: Contender, n: number): Promise<void> {
  const task = () => undefined;
  const options = { host: "api.example" };
  await c.client.config("RESETSTAT");
  let runs = 0;
  for (let i = 0; i < n; i++) {
    c.calls.length = 0;
    const start = performance.now();
    await c.gate.run(task, options);
    const end = performance.now();
    runs++;
    const [a, r] = c.calls;
    // (A call that took other than one script call each way, a renewal say, is left out.)
    if (c.calls.length !== 2 || !(a!.replied <= r!.sent) || !(r!.replied <= end)) continue;
    const parts = [a!.sent - start, a!.replied - a!.sent, r!.sent - a!.replied, r!.replied - r!.sent];
    parts.push(end - r!.replied, end - start);
    c.rows.push(parts.map((ms) => ms * 1000));
  }
  const stats = await commandStats(c.client);
  const scripts = stats.get("evalsha");
  if (scripts) c.redis.push(scripts.usec / runs);
}

export const oneCaller: Benchmark = {
  name: "one-caller",
  title: "one caller's call, part by part: a gate of the semaphore alone and the four-stage fused gate",
  redis: true,
  async run(args: BenchArgs) {
    const url = await args.redisUrl();
    const perBlock = args.quick ? 100 : 500;
    const blocks = args.rounds ?? (args.quick ? 1 : 6);
    const contenders = [
      await contender(url, "semaphore alone", GATES["semaphore alone"]!),
      await contender(url, "4-stage fused gate", GATES["4: + AIMD"]!),
    ];
    try {
      // (Warm: the scripts loaded, the code compiled.)
      for (const c of contenders)
        for (let i = 0; i < 50; i++) await c.gate.run(() => undefined, { host: "api.example" });
      for (let b = 0; b < blocks; b++) {
        for (const c of b % 2 === 0 ? contenders : [...contenders].reverse()) await block(c, perBlock);
      }
      const figures = contenders.map((c) => {
        const col = (i: number) => median(c.rows.map((r) => r[i]!));
        return [0, 1, 2, 3, 4, 5].map(col).concat(median(c.redis));
      });
      const [sem, gate] = figures as [number[], number[]];
      const us = (v: number) => v.toFixed(0);
      const d = (i: number) => gate[i]! - sem[i]!;
      table(
        `One caller's call, part by part, µs (median of ${contenders[0]!.rows.length} and ${contenders[1]!.rows.length} calls)`,
        ["part", "semaphore alone", "4-stage fused gate", "difference"],
        PARTS.map((part, i) => [part, us(sem[i]!), us(gate[i]!), us(d(i))]),
        [
          `The whole call through the fused gate: ${times(gate[5]! / sem[5]!)} the semaphore alone's (#14's target at one caller: 1.3×).`,
          `Of the difference, ${us(d(6))} µs is inside Redis, ${us(d(1) + d(3) - d(6))} µs the rest of the round trips (the socket, the kernel, the reply read), and ${us(d(0) + d(2) + d(4))} µs this process.`,
          "Each part is a median of its own, so the parts need not add up to the whole. A round trip is from the script call's leaving the client (before it is written) to its reply's settling there. Inside Redis is INFO commandstats' time of the script calls, a call's two in all, per block of calls (median of the blocks).",
        ],
      );
    } finally {
      for (const c of contenders) {
        await c.gate.close();
        await c.backend.close();
        c.client.disconnect();
      }
    }
  },
};
