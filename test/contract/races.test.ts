import type { Ticket } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { backends, useBackend } from "./backends.js";

/** A deterministic random source, so a failure can be replayed. */
function mulberry32(seed: number) {
  let a = seed;
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** An AbortSignal that counts the abort listeners added and not removed. */
function countedController() {
  const controller = new AbortController();
  const signal = controller.signal;
  let live = 0;
  const add = signal.addEventListener.bind(signal);
  const remove = signal.removeEventListener.bind(signal);
  signal.addEventListener = ((type: string, listener: never, options?: never) => {
    if (type === "abort") live++;
    add(type, listener, options);
  }) as typeof signal.addEventListener;
  signal.removeEventListener = ((type: string, listener: never, options?: never) => {
    if (type === "abort") live--;
    remove(type, listener, options);
  }) as typeof signal.removeEventListener;
  return { controller, live: () => (signal.aborted ? 0 : live) };
}

// Ten thousand on memory and single-node Redis; fewer on the other Redis runs, which add no new path.
const RACES: Record<string, number> = { memory: 10_000, redis: 10_000 };

describe.each(backends)("abort and grant races on $name", (backend) => {
  useBackend(backend);
  const total = RACES[backend.name] ?? 2_000;

  it(`keeps exact counts through ${total} admissions racing aborts, timeouts and releases`, async () => {
    const clock = new FakeClock();
    const random = mulberry32(42);
    const sem = backend.make(clock).semaphore("races", { limit: 3 });
    const counters: (() => number)[] = [];
    let granted = 0;
    let refused = 0;
    let held = 0;
    let peak = 0;
    const pending: Promise<void>[] = [];
    for (let i = 0; i < total; i++) {
      const { controller, live } = countedController();
      counters.push(live);
      const r = random();
      const timeoutMs = r < 0.2 ? Math.floor(random() * 30) : undefined;
      const holdMs = Math.floor(random() * 20);
      pending.push(
        sem.admit({ signal: controller.signal, ...(timeoutMs === undefined ? {} : { timeoutMs }) }).then(
          (ticket: Ticket) => {
            granted++;
            held++;
            peak = Math.max(peak, held);
            clock.setTimeout(() => {
              held--;
              void ticket.release(random() < 0.5 ? "success" : "ignored");
            }, holdMs);
          },
          () => {
            refused++;
          },
        ),
      );
      // Abort some callers at once, some later (while waiting or just as they are granted).
      if (r > 0.9) controller.abort();
      else if (r > 0.7) clock.setTimeout(() => controller.abort(), Math.floor(random() * 25));
      if (i % 50 === 49) await clock.advance(Math.floor(random() * 10));
    }
    // Every call ends, granted or refused, as time passes. (On Redis a grant's message comes in
    // real time: one that comes after an advance has let the I/O it waits for settle is taken at
    // the next, as the waiter's own poll would take it; a call that never ends fails here.)
    let open = pending.length;
    for (const p of pending) void p.then(() => open--);
    await clock.advance(100_000);
    for (let step = 0; open > 0 && step < 600; step++) await clock.advance(1_000);
    expect(open, "calls that neither were admitted nor failed").toBe(0);
    await Promise.all(pending);
    await clock.advance(100);
    expect(granted + refused).toBe(total);
    expect(peak).toBeLessThanOrEqual(3);
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    expect(counters.reduce((n, live) => n + live(), 0)).toBe(0);
    // Nothing leaked: the whole limit can be taken at once.
    const all = await sem.tryAdmit({ cost: 3 });
    expect(all).toBeDefined();
    await all!.release("success");
    // Ten thousand Redis round trips and more: on a busy two-core machine, well past the default.
  }, 90_000);

  it("lets the waiters behind a cancelled head through", async () => {
    const clock = new FakeClock();
    const sem = backend.make(clock).semaphore("head", { limit: 2 });
    const held = await sem.admit({ cost: 2 });
    const controller = new AbortController();
    const head = sem.admit({ cost: 2, signal: controller.signal });
    head.catch(() => {});
    const behind = [sem.admit(), sem.admit()];
    await clock.flush();
    controller.abort();
    await held.release("success");
    const tickets = await Promise.all(behind);
    expect(tickets).toHaveLength(2);
    for (const t of tickets) await t.release("success");
  });
});
