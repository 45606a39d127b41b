/**
 * Run by idle-keys.ts in a process of its own with `--expose-gc`: fill a stage with N keys seen
 * once, measure the heap, let the keys go idle on a FakeClock so the sweep evicts them, measure
 * again. Prints one JSON line per round.
 */
import { memory } from "floodgate";
import { FakeClock } from "floodgate/testing";

const [keysArg, roundsArg] = process.argv.slice(2);
const n = Number(keysArg);
const count = Number(roundsArg);
const gc = (globalThis as { gc?: () => void }).gc;
if (!gc) throw new Error("run with --expose-gc");

function heap(): number {
  for (let i = 0; i < 3; i++) gc!();
  return process.memoryUsage().heapUsed;
}

interface Stats {
  stage: string;
  baseline: number;
  loaded: number;
  evicted: number;
  keysLoaded: number;
  keysAfter: number;
  fillMs: number;
}

async function bucket(names: readonly string[]): Promise<Stats> {
  const clock = new FakeClock();
  const backend = memory({ clock });
  const baseline = heap();
  const b = backend.tokenBucket("keys", { keyed: true, capacity: 10, refillPerSecond: 10 });
  const t0 = performance.now();
  for (const key of names) {
    const ticket = await b.tryAdmit({ key });
    await ticket!.release("success");
  }
  const fillMs = performance.now() - t0;
  const loaded = heap();
  const keysLoaded = b.keyCount;
  await clock.advance(5_000); // refilled, so idle; the sweep runs every second
  const evicted = heap();
  const stats = {
    stage: "tokenBucket",
    baseline,
    loaded,
    evicted,
    keysLoaded,
    keysAfter: b.keyCount,
    fillMs,
  };
  await backend.close();
  return stats;
}

async function intervalGate(names: readonly string[]): Promise<Stats> {
  const clock = new FakeClock();
  const backend = memory({ clock });
  const baseline = heap();
  const g = backend.intervalGate("hosts", { minIntervalMs: 100 });
  const t0 = performance.now();
  for (const host of names) {
    const ticket = await g.tryAdmit({ host });
    await ticket!.release("success");
  }
  const fillMs = performance.now() - t0;
  const loaded = heap();
  const keysLoaded = g.hostCount;
  await clock.advance(5_000);
  const evicted = heap();
  const stats = {
    stage: "intervalGate",
    baseline,
    loaded,
    evicted,
    keysLoaded,
    keysAfter: g.hostCount,
    fillMs,
  };
  await backend.close();
  return stats;
}

// The key strings exist before the baseline, so the figure is what the stage itself keeps.
const names = Array.from({ length: n }, (_, i) => `supplier-${i}`);
for (let r = 0; r < count; r++) {
  console.log(JSON.stringify(await bucket(names)));
  console.log(JSON.stringify(await intervalGate(names)));
}
