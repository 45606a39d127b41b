/**
 * Where one caller's call goes, part by part: `gate.run` of an empty task at one caller, through
 * a gate of the semaphore alone and through the four-stage fused gate #14 counts. Each script
 * call is stamped as it leaves the client (`sendCommand`, before it is written) and as its reply
 * settles there. So a call splits into this process's time before its admission is sent, the
 * admission's round trip, this process's time from that reply to the release's sending (the
 * tickets, the task, the release made), the release's round trip, and what is left after its
 * reply; Redis's own time for the two script calls, read from INFO commandstats for each block
 * of calls, splits the round trips into Redis and the rest (the socket, the kernel, the reply
 * read). The contenders take turns in blocks, so that the machine's drift falls on all of them;
 * the hand-written four-stage floor (bench/gate-floor.ts) shows what a minimal client and script
 * cost the same way.
 */
import { Gate, type Stage } from "floodgate";
import { type RedisBackend, redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { floorGate } from "./gate-floor.js";
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

/** One contender: a call's admission and release on a client of its own, whose script calls are stamped. */
interface Contender {
  name: string;
  client: Redis;
  /** One call: admitted, an empty task, released. */
  call: () => Promise<unknown>;
  close: () => Promise<void>;
  /** Each script call of the call under way: when it was sent and when its reply came (ms). */
  calls: { sent: number; replied: number }[];
  /** Per call: its parts but Redis's own (µs), and its whole time (µs, last). */
  rows: number[][];
  /** Per block: Redis's own µs a call, its script calls' in all. */
  redis: number[];
}

/** A contender named `name`, made by `make` on a client of its own, its script calls stamped. */
async function contender(
  url: string,
  name: string,
  make: (client: Redis) => Pick<Contender, "call" | "close">,
): Promise<Contender> {
  const client = await connect(url);
  const c: Contender = { name, client, ...make(client), calls: [], rows: [], redis: [] };
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

/** A contender's call through a gate of `stages`: `gate.run` of an empty task to one host. */
function gateOf(stages: (b: RedisBackend) => Stage[]): (client: Redis) => Pick<Contender, "call" | "close"> {
  return (client) => {
    const backend = redis(client, { prefix: freshPrefix("one") });
    const gate = new Gate(stages(backend));
    const task = () => undefined;
    const options = { host: "api.example" };
    return {
      call: () => gate.run(task, options),
      close: async () => {
        await gate.close();
        await backend.close();
      },
    };
  };
}

/** `n` calls of `c` at one caller, each split into its parts; Redis's time from its stats. */
async function block(c: Contender, n: number): Promise<void> {
  await c.client.config("RESETSTAT");
  let runs = 0;
  for (let i = 0; i < n; i++) {
    c.calls.length = 0;
    const start = performance.now();
    await c.call();
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
  title:
    "one caller's call, part by part: a gate of the semaphore alone, the four-stage fused gate and a hand-written floor",
  redis: true,
  async run(args: BenchArgs) {
    const url = await args.redisUrl();
    const perBlock = args.quick ? 100 : 500;
    const blocks = args.rounds ?? (args.quick ? 1 : 6);
    const contenders = [
      await contender(url, "semaphore alone", gateOf(GATES["semaphore alone"]!)),
      await contender(url, "4-stage fused gate", gateOf(GATES["4: + AIMD"]!)),
      await contender(url, "floor: 4 stages, hand-written", (client) => ({
        call: floorGate(client, freshPrefix("one-floor"), 4),
        close: async () => {},
      })),
    ];
    try {
      // (Warm: the scripts loaded, the code compiled.)
      for (const c of contenders) for (let i = 0; i < 50; i++) await c.call();
      for (let b = 0; b < blocks; b++) {
        for (const c of b % 2 === 0 ? contenders : [...contenders].reverse()) await block(c, perBlock);
      }
      const figures = contenders.map((c) => {
        const col = (i: number) => median(c.rows.map((r) => r[i]!));
        return [0, 1, 2, 3, 4, 5].map(col).concat(median(c.redis));
      });
      const [sem, gate, floor] = figures as [number[], number[], number[]];
      const us = (v: number) => v.toFixed(0);
      const d = (i: number) => gate[i]! - sem[i]!;
      table(
        `One caller's call, part by part, µs (median of ${contenders.map((c) => c.rows.length).join(", ")} calls)`,
        ["part", "semaphore alone", "4-stage fused gate", "difference", "floor: 4 stages, hand-written"],
        PARTS.map((part, i) => [part, us(sem[i]!), us(gate[i]!), us(d(i)), us(floor[i]!)]),
        [
          `The whole call through the fused gate: ${times(gate[5]! / sem[5]!)} the semaphore alone's (#14's target at one caller: 1.3×); the floor's: ${times(floor[5]! / sem[5]!)}.`,
          `Of the difference, ${us(d(6))} µs is inside Redis, ${us(d(1) + d(3) - d(6))} µs the rest of the round trips (the socket, the kernel, the reply read), and ${us(d(0) + d(2) + d(4))} µs this process.`,
          "The floor (bench/gate-floor.ts) is one hand-written script for the four stages' uncontended admission and one for their release, a promise a call and nothing else: no lines, leases kept, fencing, tickets or renewal. What no fused gate can beat here.",
          "Each part is a median of its own, so the parts need not add up to the whole. A round trip is from the script call's leaving the client (before it is written) to its reply's settling there. Inside Redis is INFO commandstats' time of the script calls, a call's two in all, per block of calls (median of the blocks).",
        ],
      );
    } finally {
      for (const c of contenders) {
        await c.close();
        c.client.disconnect();
      }
    }
  },
};
