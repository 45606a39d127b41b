/**
 * A Gate of Redis stages with Redis in another zone: every chunk between this process and Redis
 * held for a delay each way by a proxy in a child process (bench/delay-proxy.ts), so a round trip
 * costs what a network would add. The semaphore alone, and the four- and five-stage gates of
 * `redis-gate` fused and taken one stage after another, at 1 and 64 callers: what fusing saves a
 * call when each round trip is dear (#14's reason for being).
 */
import { once } from "node:events";
import type { Redis } from "ioredis";
import { type BenchArgs, type Benchmark, median, ms, rounds } from "./lib.js";
import { connect } from "./redis-clients.js";
import { GATES, gateRun, report, type Timed, timed } from "./redis-throughput.js";
import { forkScript } from "./worker.js";

/** The delay each way, ms: a round trip about twice this (Node's timers, 1 ms apart at best). */
const DELAY_MS = 1;

/** The gates of `redis-gate` this compares, each fused and taken in turn. */
const COMPARED = ["4: + AIMD", "5: rpm + tpm buckets, interval gate, semaphore, AIMD"];

export const redisAway: Benchmark = {
  name: "redis-away",
  title: `a Gate of Redis stages with Redis ${DELAY_MS} ms away each way, fused and taken in turn`,
  redis: true,
  async run(args: BenchArgs) {
    const url = await args.redisUrl();
    const proxy = forkScript(new URL("./delay-proxy.ts", import.meta.url), [url, String(DELAY_MS)], {
      stdio: ["ignore", "inherit", "inherit", "ipc"],
    });
    const clients: Redis[] = [];
    try {
      const [message] = (await once(proxy, "message")) as [{ port: number }];
      const away = new URL(url);
      away.hostname = "127.0.0.1";
      away.port = String(message.port);
      // Redis's own figures are read straight from it; the contenders go through the proxy.
      const info = await connect(url);
      const [ping, floodgate] = await Promise.all([connect(away.href), connect(away.href)]);
      clients.push(info, ping, floodgate);
      // (The quick form only checks that it runs: CI's time is short.)
      const s = args.seconds ?? (args.quick ? 0.2 : 2);
      const count = args.rounds ?? (args.quick ? 1 : 5);
      for (const callers of [1, 64]) {
        const gate = (name: string, fuse: boolean) =>
          timed(fuse ? name : `${name.split(":")[0]}: taken in turn`, s, callers, info, () =>
            gateRun(floodgate, GATES[name]!, fuse),
          );
        const list: Timed[] = [
          timed("ioredis PING (floor)", s, callers, info, () => () => ping.ping()),
          gate("semaphore alone", true),
          ...COMPARED.flatMap((name) => [gate(name, false), gate(name, true)]),
        ];
        const figures = await rounds(list, count);
        const p50 = (name: string) => median(list.find((x) => x.name === name)!.p50);
        const saved = COMPARED.map((name) => {
          const n = name.split(":")[0]!;
          return `${n} stages ${ms(p50(`${n}: taken in turn`) - p50(name), 2)}`;
        }).join(", ");
        report(
          `A Gate of Redis stages, Redis ${DELAY_MS} ms away each way (PING p50 ${ms(p50("ioredis PING (floor)"), 2)}), ` +
            `gate.run of an empty task, ${callers} caller${callers === 1 ? "" : "s"}, ${s} s per figure (median of ${count} rounds)`,
          list,
          figures,
          "semaphore alone",
          "ioredis PING (floor)",
          1,
          [
            `What fusing saves a call at the median, against the same stages taken in turn: ${saved}.`,
            "Every chunk each way is held by a proxy in a child process (bench/delay-proxy.ts): Redis's CPU " +
              "is read from Redis itself, this process's CPU leaves the proxy's out.",
          ],
        );
      }
    } finally {
      for (const c of clients) c.disconnect();
      proxy.disconnect();
      if (proxy.exitCode === null) await once(proxy, "exit");
    }
  },
};
