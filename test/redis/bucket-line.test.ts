import type { Clock, ClockTimer, Ticket, TokenBucketOptions } from "floodgate";
import { redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { ownRedis, useClients } from "./clients.js";
import { randomPrefix, watchScripts } from "./helpers.js";

/** This file counts the script calls Redis runs: on a server of its own. */
const redisUrl = ownRedis();

/**
 * One Redis token bucket shared by several processes (backends on their own connections, on one
 * fake clock that is also the scripts' clock): a caller whose tokens are not there reserves them
 * in its take, so the key's callers go in the order Redis saw them ask, wherever they run.
 */
describe("one line per key across processes (Redis token bucket)", () => {
  const { clients, connect } = useClients(redisUrl);

  async function fleet(n: number, options: TokenBucketOptions) {
    const clock = new FakeClock();
    const prefix = randomPrefix("bucket-line");
    const buckets = [];
    for (let i = 0; i < n; i++) {
      const client = await connect();
      buckets.push(redis(client, { prefix, clock, time: "clock" }).tokenBucket("line", options));
    }
    return { clock, buckets, admin: clients[0]!, key: `${prefix}{line}:b:` };
  }

  it("serves callers in the order they asked, whichever process they ask from", async () => {
    const { clock, buckets } = await fleet(3, { capacity: 1, refillPerSecond: 1 });
    const [a, b, c] = buckets as [(typeof buckets)[0], (typeof buckets)[0], (typeof buckets)[0]];
    await a.admit(); // the one token: everyone below waits
    const granted: [string, number][] = [];
    const asks: [string, typeof a][] = [
      ["b1", b],
      ["a1", a],
      ["c1", c],
      ["b2", b],
      ["a2", a],
      ["c2", c],
    ];
    const waits = [];
    for (const [name, stage] of asks) {
      const before = stage.snapshot().waiting;
      waits.push(stage.admit().then(() => granted.push([name, clock.now()])));
      // Each asks once the one before has its place.
      await clock.flush();
      expect(stage.snapshot().waiting, name).toBe(before + 1);
    }
    await clock.advance(6000);
    await Promise.all(waits);
    expect(granted).toEqual([
      ["b1", 1000],
      ["a1", 2000],
      ["c1", 3000],
      ["b2", 4000],
      ["a2", 5000],
      ["c2", 6000],
    ]);
  });

  it("costs one script call per admission, however long the wait: nobody asks again", async () => {
    const { clock, buckets, admin, key } = await fleet(2, { capacity: 2, refillPerSecond: 10 });
    await buckets[0]!.admit({ cost: 2 });
    const counter = await watchScripts(await connect(), key);
    const waits: Promise<Ticket>[] = [];
    for (let i = 0; i < 20; i++) {
      waits.push(buckets[i % 2]!.admit());
      await clock.flush();
    }
    await clock.advance(2000);
    await Promise.all(waits);
    await counter.shown(admin, 20);
    counter.stop();
    expect(counter.seen.length).toBe(20);
  });

  it("gives an aborted caller's tokens back: its process's next moves up, and the next to ask gets them", async () => {
    const { clock, buckets } = await fleet(2, { capacity: 1, refillPerSecond: 1 });
    const [a, b] = buckets as [(typeof buckets)[0], (typeof buckets)[0]];
    await a.admit();
    const controller = new AbortController();
    const at: Record<string, number> = {};
    const x = a.admit({ signal: controller.signal }).catch((e: unknown) => e); // due 1000
    await clock.flush();
    const y = b.admit().then(() => (at.y = clock.now())); // due 2000
    await clock.flush();
    const z = a.admit().then(() => (at.z = clock.now())); // due 3000
    await clock.flush();
    await clock.advance(500);
    controller.abort();
    await clock.flush();
    expect(await x).toBe(controller.signal.reason);
    // z, behind the aborted x in its own process, takes x's place; y, in another, keeps its own.
    await clock.advance(1500);
    await Promise.all([y, z]);
    expect(at).toEqual({ y: 2000, z: 1000 });
    // z's own place, the key's latest, went back: the next to ask waits one token, not two.
    const next = b.admit().then(() => clock.now());
    await clock.advance(1000);
    expect(await next).toBe(3000);
  });

  it("gives the last reservation back when a stage closes, while it is the key's latest", async () => {
    const { clock, buckets } = await fleet(2, { capacity: 1, refillPerSecond: 1 });
    const [a, b] = buckets as [(typeof buckets)[0], (typeof buckets)[0]];
    await a.admit();
    const closing = [a.admit(), a.admit(), a.admit()].map((p) => p.catch((e: unknown) => e));
    await clock.flush();
    expect(a.snapshot().waiting).toBe(3);
    await a.close();
    await clock.flush();
    for (const p of closing) expect(((await p) as Error).name).toBe("ClosedError");
    // The first two places go unused (refunding them would open gaps in the line); the third,
    // the latest, came back.
    const next = b.admit().then(() => clock.now());
    await clock.advance(3000);
    expect(await next).toBe(3000);
  });

  it("refuses at once, reserving nothing, a wait longer than timeoutMs", async () => {
    const { clock, buckets } = await fleet(2, { capacity: 1, refillPerSecond: 1 });
    await buckets[0]!.admit();
    const error = await buckets[1]!.admit({ timeoutMs: 500 }).catch((e: unknown) => e);
    expect((error as Error).name).toBe("AdmitTimeoutError");
    const next = buckets[0]!.admit().then(() => clock.now());
    await clock.advance(1000);
    expect(await next).toBe(1000);
  });

  it.each([1, 2, 3, 4])(
    "holds the cap over random asks, aborts, timeouts, refunds and settles from three processes (seed %i)",
    async (seed) => {
      const capacity = 5;
      const rate = 10;
      const { clock, buckets } = await fleet(3, { capacity, refillPerSecond: rate });
      let state = seed * 7919;
      const random = () => {
        state = (Math.imul(state, 1664525) + 1013904223) >>> 0;
        return state / 2 ** 32;
      };
      const int = (lo: number, hi: number) => lo + Math.floor(random() * (hi - lo + 1));
      /** Calls that went out: when, and what they cost in the end (0 when refunded). */
      const sent: { at: number; cost: number }[] = [];
      const held: { ticket: Ticket; sent: { at: number; cost: number } }[] = [];
      const aborts: AbortController[] = [];
      const ends: Promise<unknown>[] = [];
      for (let step = 0; step < 300; step++) {
        const bucket = buckets[int(0, 2)]!;
        const r = random();
        if (r < 0.45) {
          const controller = new AbortController();
          aborts.push(controller);
          const timeoutMs = random() < 0.3 ? int(0, 2000) : undefined;
          ends.push(
            bucket.admit({ cost: int(1, capacity), signal: controller.signal, timeoutMs }).then(
              (ticket) => {
                const out = { at: clock.now(), cost: ticket.cost };
                sent.push(out);
                held.push({ ticket, sent: out });
              },
              () => undefined,
            ),
          );
        } else if (r < 0.55) {
          aborts.splice(int(0, aborts.length - 1), 1)[0]?.abort();
        } else if (r < 0.65 && held.length > 0) {
          // Not sent after all: a refund (only the key's latest grant gets its tokens back).
          const h = held.splice(int(0, held.length - 1), 1)[0]!;
          const gone = h.sent.at === clock.now() && random() < 0.5;
          if (gone) {
            await h.ticket.refund();
            h.sent.cost = 0;
          } else {
            await h.ticket.release("success");
          }
        } else if (r < 0.75 && held.length > 0) {
          // Cost less than reserved: settled before release, as a caller that meters its call.
          const h = held.splice(int(0, held.length - 1), 1)[0]!;
          const actual = int(0, h.ticket.cost);
          await h.ticket.settle(actual);
          h.sent.cost = actual;
          await h.ticket.release("success");
        } else {
          await clock.advance(int(0, 400));
        }
        await clock.flush();
      }
      for (const c of aborts) c.abort();
      await clock.advance(60_000);
      await Promise.all(ends);
      for (const b of buckets) expect(b.snapshot().waiting).toBe(0);
      // Replay the calls that went out through a bucket of the same shape, full at the start.
      sent.sort((x, y) => x.at - y.at);
      let level = capacity;
      let at = 0;
      for (const s of sent) {
        level = Math.min(capacity, level + ((s.at - at) * rate) / 1000) - s.cost;
        at = s.at;
        expect(level, `at ${s.at}`).toBeGreaterThanOrEqual(-1e-6);
      }
      expect(sent.length).toBeGreaterThan(25);
    },
  );

  it("holds the cap when a process with callers reserved is frozen past their time: they ask again", async () => {
    const clock = new FakeClock();
    const prefix = randomPrefix("bucket-freeze");
    const frozen = new FreezableClock(clock);
    const options = { capacity: 3, refillPerSecond: 10 };
    const make = async (c: Clock) => {
      const client = await connect();
      return redis(client, { prefix, clock: c, time: "clock" }).tokenBucket("freeze", options);
    };
    const a = await make(frozen);
    const b = await make(clock);
    const sent: { at: number; who: string }[] = [];
    const calls: Promise<unknown>[] = [];
    for (let i = 0; i < 12; i++) {
      const [who, stage] = i % 2 === 0 ? ["a", a] : ["b", b];
      calls.push(stage.admit().then(() => sent.push({ at: clock.now(), who })));
      await clock.flush();
    }
    frozen.freeze();
    await clock.advance(1500);
    frozen.thaw();
    await clock.advance(3000);
    await Promise.all(calls);
    expect(sent).toHaveLength(12);
    // Every call went out within the bucket's shape, replayed from full.
    sent.sort((x, y) => x.at - y.at);
    let level = options.capacity;
    let at = 0;
    for (const s of sent) {
      level = Math.min(options.capacity, level + ((s.at - at) * options.refillPerSecond) / 1000) - 1;
      at = s.at;
      expect(level, `${s.who} at ${s.at}`).toBeGreaterThanOrEqual(-1e-6);
    }
    // The frozen process's callers whose time passed went after the thaw, no more at once than
    // the bucket holds.
    const afterThaw = sent.filter((s) => s.who === "a" && s.at >= 1500);
    expect(afterThaw.length).toBeGreaterThan(options.capacity);
    expect(afterThaw.filter((s) => s.at === 1500).length).toBeLessThanOrEqual(options.capacity);
  });
  it("lets a caller woken up to 20 ms late keep its place, and sends one woken later to the end of the line", async () => {
    const clock = new FakeClock();
    const prefix = randomPrefix("bucket-late");
    const frozen = new FreezableClock(clock);
    const client = await connect();
    const bucket = redis(client, { prefix, clock: frozen, time: "clock" }).tokenBucket("late", {
      capacity: 1,
      refillPerSecond: 10,
    });
    await bucket.admit();
    const at: number[] = [];
    const x = bucket.admit().then(() => at.push(clock.now())); // due 100
    await clock.flush();
    frozen.freeze();
    await clock.advance(115);
    frozen.thaw(); // 15 ms late: within the 20 ms a busy machine's timer may be late
    await x;
    const y = bucket.admit().then(() => at.push(clock.now())); // due 200
    await clock.flush();
    frozen.freeze();
    await clock.advance(125); // to 240: 40 ms late
    frozen.thaw();
    await clock.advance(200);
    await y;
    // y asked again at 240, after its own place (its tokens charged): 0.4 tokens there, 60 ms more.
    expect(at).toEqual([115, 300]);
  });
});

/**
 * A clock whose timers can be held, as a frozen process's are: while frozen, timers that fall due
 * wait, and on thaw they all run, late.
 */
class FreezableClock implements Clock {
  #frozen = false;
  #held: (() => void)[] = [];
  constructor(readonly inner: FakeClock) {}
  now(): number {
    return this.inner.now();
  }
  setTimeout(callback: () => void, ms: number): ClockTimer {
    const timer = { cancelled: false, handle: undefined as ClockTimer };
    timer.handle = this.inner.setTimeout(() => {
      const run = () => {
        if (!timer.cancelled) callback();
      };
      if (this.#frozen) this.#held.push(run);
      else run();
    }, ms);
    return timer;
  }
  clearTimeout(timer: ClockTimer): void {
    const t = timer as { cancelled: boolean; handle: ClockTimer };
    t.cancelled = true;
    this.inner.clearTimeout(t.handle);
  }
  track(work: Promise<unknown>): void {
    this.inner.track(work);
  }
  freeze(): void {
    this.#frozen = true;
  }
  thaw(): void {
    this.#frozen = false;
    for (const run of this.#held.splice(0)) run();
  }
}
