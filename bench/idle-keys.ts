/**
 * Memory per idle key: a token bucket with 1M keys each taken from once, and an interval gate with
 * 1M hosts each called once; heap per key, then after the keys went idle and the sweep evicted
 * them. Runs in a child process with `--expose-gc`, so collections are forced and the heap holds
 * nothing of the other benchmarks.
 */
import { once } from "node:events";
import { type BenchArgs, type Benchmark, median, si, spread, table, verdict } from "./lib.js";
import { forkScript } from "./worker.js";

interface Stats {
  stage: string;
  baseline: number;
  loaded: number;
  evicted: number;
  keysLoaded: number;
  keysAfter: number;
  fillMs: number;
}

export const idleKeys: Benchmark = {
  name: "idle-keys",
  title: "memory per idle key, 1M keys, and after eviction",
  redis: false,
  async run(args: BenchArgs) {
    const n = args.keys ?? (args.quick ? 100_000 : 1_000_000);
    const count = args.rounds ?? (args.quick ? 1 : 5);
    const child = forkScript(new URL("./idle-keys-child.ts", import.meta.url), [String(n), String(count)], {
      execArgv: ["--expose-gc"],
      stdio: ["ignore", "pipe", "inherit", "ipc"],
    });
    let out = "";
    child.stdout!.setEncoding("utf8").on("data", (chunk: string) => {
      out += chunk;
    });
    const [code] = (await once(child, "exit")) as [number | null];
    if (code !== 0) throw new Error(`idle-keys child exited with ${code}`);
    const stats = out
      .trim()
      .split("\n")
      .map((l) => JSON.parse(l) as Stats);
    const rows: string[][] = [];
    const notes: string[] = [];
    for (const stage of ["tokenBucket", "intervalGate"]) {
      const s = stats.filter((x) => x.stage === stage);
      const perKey = s.map((x) => (x.loaded - x.baseline) / x.keysLoaded);
      const residual = s.map((x) => x.evicted - x.baseline);
      const left = Math.max(...s.map((x) => x.keysAfter));
      const [bpk, bpkRange] = spread(perKey, (v) => v.toFixed(0));
      const [res, resRange] = spread(residual, (v) => `${(v / 1024).toFixed(0)} KiB`);
      rows.push([
        stage,
        si(n),
        `${bpk} B`,
        `${bpkRange} B`,
        String(left),
        res,
        resRange,
        `${median(s.map((x) => x.fillMs)).toFixed(0)} ms`,
      ]);
      const growth = median(s.map((x) => x.loaded - x.baseline));
      const rest = median(residual);
      notes.push(
        `${stage}: back to baseline after eviction (no key left; median heap left ≤ 1% of what the keys took) ` +
          `${verdict(left === 0 && rest <= growth / 100, `${left} keys left, ${((100 * rest) / growth).toFixed(2)}% left`)}.`,
      );
    }
    table(
      `Memory per idle key, ${si(n)} keys, and after eviction (heap after forced GC, median of ${count} rounds)`,
      [
        "stage",
        "keys",
        "bytes/key (median)",
        "min – max",
        "keys left after sweep",
        "heap vs baseline after sweep",
        "min – max",
        "fill time",
      ],
      rows,
      [
        ...notes,
        "Key strings are allocated before the baseline, so bytes/key is what the stage itself keeps per key " +
          "(its Map entry and state). Keys go idle on a FakeClock; the stage's own sweep timer evicts them.",
      ],
    );
  },
};
