/**
 * Cost per admission as waiters grow: with N callers already queued, the steady-state cost of one
 * more admission (grant the head, queue one at the tail), and of an abort from the middle of the
 * line. A flat column means no O(n) step anywhere on the path.
 */
import { memory, type Ticket } from "floodgate";
import {
  type BenchArgs,
  type Benchmark,
  type Contender,
  median,
  rounds,
  si,
  spread,
  table,
  times,
  verdict,
} from "./lib.js";
import { fullGate } from "./memory-gate.js";

const ignore = () => {};
/** One reason for every abort: `abort()` with none builds a DOMException and its stack each time. */
const REASON = new Error("bench abort");

/** A stage-like thing to queue on. */
interface Line {
  admit(options?: { signal?: AbortSignal }): Promise<Ticket>;
  close(): Promise<void>;
}

/** Binding at 1 permit: a bare semaphore, or a full five-stage gate whose semaphore binds. */
function line(kind: "semaphore" | "gate"): Line {
  return kind === "semaphore" ? memory().semaphore("line", { limit: 1 }) : fullGate(1);
}

/** ns per admission: hold the permit, queue `depth` waiters, then `k` times grant the head and queue one more. */
async function grantAtDepth(kind: "semaphore" | "gate", depth: number, k: number): Promise<number> {
  const l = line(kind);
  let held = await l.admit();
  const queue: (Promise<Ticket> | undefined)[] = [];
  for (let i = 0; i < depth; i++) queue.push(l.admit());
  let head = 0;
  const started = performance.now();
  for (let i = 0; i < k; i++) {
    void held.release("success");
    held = await queue[head]!;
    queue[head++] = undefined; // a granted caller is gone from the line; keep nothing of it
    queue.push(l.admit());
  }
  const elapsed = performance.now() - started;
  for (let i = head; i < queue.length; i++) queue[i]!.catch(ignore);
  await l.close();
  return (elapsed * 1e6) / k;
}

/** ns per abort: `depth` waiters with signals; `k` times abort a random one and queue another. */
async function abortAtDepth(depth: number, k: number): Promise<number> {
  const l = line("semaphore");
  const held = await l.admit();
  const controllers: AbortController[] = [];
  const add = () => {
    const c = new AbortController();
    l.admit({ signal: c.signal }).catch(ignore);
    return c;
  };
  for (let i = 0; i < depth; i++) controllers.push(add());
  let seed = 12345;
  const started = performance.now();
  for (let i = 0; i < k; i++) {
    seed = (seed * 1103515245 + 12345) & 0x7fffffff;
    const at = seed % depth;
    controllers[at]!.abort(REASON);
    controllers[at] = add();
  }
  const elapsed = performance.now() - started;
  await held.release("success");
  await l.close();
  return (elapsed * 1e6) / k;
}

/** The same loop with no stage: what Node's AbortController, listener and abort cost alone. */
async function abortFloor(depth: number, k: number): Promise<number> {
  const controllers: AbortController[] = [];
  const add = () => {
    const c = new AbortController();
    c.signal.addEventListener("abort", ignore, { once: true });
    return c;
  };
  for (let i = 0; i < depth; i++) controllers.push(add());
  let seed = 12345;
  const started = performance.now();
  for (let i = 0; i < k; i++) {
    seed = (seed * 1103515245 + 12345) & 0x7fffffff;
    const at = seed % depth;
    controllers[at]!.abort(REASON);
    controllers[at] = add();
  }
  return ((performance.now() - started) * 1e6) / k;
}

export const waiters: Benchmark = {
  name: "waiters",
  title: "cost per admission as waiters grow (1 → 100k queued)",
  redis: false,
  async run(args: BenchArgs) {
    const depths = args.quick ? [1, 100, 1_000] : [1, 10, 100, 1_000, 10_000, 100_000];
    const k = args.tasks ?? (args.quick ? 3_000 : 50_000);
    const count = args.rounds ?? (args.quick ? 1 : 5);
    const ops = [
      { op: "semaphore: grant head + queue one", run: (d: number) => grantAtDepth("semaphore", d, k) },
      { op: "semaphore: abort one from the middle + queue one", run: (d: number) => abortAtDepth(d, k) },
      { op: "floor: AbortController + listener + abort, no stage", run: (d: number) => abortFloor(d, k) },
      { op: "Gate, 5 stages: grant head + queue one", run: (d: number) => grantAtDepth("gate", d, k) },
    ];
    const contenders: Contender[] = ops.flatMap((o) =>
      depths.map((d) => ({ name: `${o.op}@${d}`, run: () => o.run(d) })),
    );
    const figures = await rounds(contenders, count);
    const rows: string[][] = [];
    const notes: string[] = [];
    for (const o of ops) {
      const cost = depths.map((d) => median(figures.get(`${o.op}@${d}`)!));
      // Growth per tenfold more waiters between neighbouring depths: an O(n) step shows as ~10×.
      let worst = 0;
      for (let i = 1; i < depths.length; i++) {
        const decades = Math.log10(depths[i]! / depths[i - 1]!);
        worst = Math.max(worst, (cost[i]! / cost[i - 1]!) ** (1 / decades));
      }
      depths.forEach((d, i) => {
        const f = figures.get(`${o.op}@${d}`)!;
        const [med, range] = spread(f, (v) => v.toFixed(0));
        const step = i === 0 ? "—" : times(cost[i]! / cost[i - 1]!);
        rows.push([o.op, si(d), `${med} ns`, `${range} ns`, times(cost[i]! / cost[0]!), step]);
      });
      notes.push(
        `${o.op}: flat, no O(n) step (≤ 2× per tenfold more queued) ${verdict(worst <= 2, `worst ${times(worst)} per tenfold`)}.`,
      );
    }
    table(
      `Cost per admission as waiters grow, ${si(k)} admissions per depth (median of ${count} rounds)`,
      [
        "operation",
        "queued",
        "ns/admission (median)",
        "min – max",
        `vs ${depths[0]} queued`,
        "vs previous depth",
      ],
      rows,
      [
        ...notes,
        "Per-admission work is O(1) (linked FIFO, O(1) unlink); what rises with depth is garbage collection, " +
          "as queued callers outlive young-generation collections and a larger heap is traced.",
      ],
    );
  },
};
