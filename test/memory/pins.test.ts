import {
  AdmitTimeoutError,
  type Clock,
  ClosedError,
  Gate,
  InvalidOptionsError,
  memory,
  ShedError,
  type Ticket,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { meant } from "../../src/validate.js";
import { recorder } from "../recorder.js";
import { thrown } from "../thrown.js";

/**
 * Behaviour of the memory stages that the other suites leave loose: what `admitNow` refuses,
 * the exact log records, when idle keys and hosts are forgotten, timers left after `close()`,
 * and the counters that tell a refund, a cost of 0 or a slow call apart.
 */

/** Whether `p` has settled after pending promises have run. */
async function settled(clock: FakeClock, p: Promise<unknown>): Promise<boolean> {
  let done = false;
  p.then(
    () => {
      done = true;
    },
    () => {
      done = true;
    },
  );
  await clock.flush();
  return done;
}

describe("permit stages: admitNow", () => {
  it("refuses a negative, fractional or too large cost and takes nothing", () => {
    const clock = new FakeClock();
    const sem = memory({ clock }).semaphore("sem", { limit: 2 });
    expect(sem.admitNow({}, -1)).toBeUndefined();
    expect(sem.admitNow({}, 0.5)).toBeUndefined();
    expect(sem.admitNow({}, 3)).toBeUndefined();
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, admitted: 0 });
    // Nothing was taken: the whole limit is still there.
    expect(sem.admitNow({}, 2)).toBeDefined();
  });

  it("admits a cost of 0 and a cost of exactly the limit", () => {
    const sem = memory({ clock: new FakeClock() }).semaphore("sem", { limit: 2 });
    const zero = sem.admitNow({}, 0);
    expect(zero?.cost).toBe(0);
    const all = sem.admitNow({}, 2);
    expect(all?.cost).toBe(2);
    expect(sem.snapshot()).toMatchObject({ inFlight: 2, admitted: 2 });
    expect(sem.admitNow({}, 1)).toBeUndefined();
  });

  it("refuses when closed or aborted, and when the call would wait", async () => {
    const clock = new FakeClock();
    const sem = memory({ clock }).semaphore("sem", { limit: 1 });
    const ac = new AbortController();
    ac.abort();
    expect(sem.admitNow({ signal: ac.signal }, 1)).toBeUndefined();
    const held = sem.admitNow({}, 1)!;
    expect(sem.admitNow({}, 1)).toBeUndefined();
    await held.release();
    await sem.close();
    expect(sem.admitNow({}, 1)).toBeUndefined();
    expect(sem.snapshot()).toMatchObject({ inFlight: 0, admitted: 1 });
  });

  it("refuses on an AIMD limiter a cost above min, though the current limit has room", () => {
    const aimd = memory({ clock: new FakeClock() }).aimd("aimd", { initial: 5, min: 2, max: 10 });
    expect(aimd.admitNow({}, 3)).toBeUndefined();
    expect(aimd.snapshot().inFlight).toBe(0);
    expect(aimd.admitNow({}, 2)?.cost).toBe(2);
  });
  it("admits a cost of 0 at once past callers in line, by every entry", async () => {
    const clock = new FakeClock();
    const sem = memory({ clock }).semaphore("sem", { limit: 2 });
    await sem.admit({ cost: 1 });
    const big = sem.admit({ cost: 2 });
    expect(await settled(clock, big)).toBe(false);
    expect(sem.admitNow({}, 1)).toBeUndefined(); // a permit is free, but someone is in line
    expect(await sem.tryAdmit()).toBeUndefined();
    expect(sem.admitNow({}, 0)?.cost).toBe(0);
    expect((await sem.tryAdmit({ cost: 0 }))?.cost).toBe(0);
    expect(await settled(clock, sem.admit({ cost: 0 }))).toBe(true);
    expect(await sem.run(() => "now", { cost: 0 })).toBe("now");
    expect(sem.snapshot()).toMatchObject({ waiting: 1, admitted: 5 });
  });
});

describe("permit stages: the records a logger gets", () => {
  it("logs every grant of an unkeyed stage with the key '' (at once, after a wait, in run)", async () => {
    const clock = new FakeClock();
    const { logger, entries } = recorder();
    const sem = memory({ clock, logger }).semaphore("sem", { limit: 1 });
    const first = await sem.admit();
    const second = sem.admit();
    const ran = sem.run(() => "ran");
    await clock.advance(5);
    await first.release();
    await (await second).release();
    expect(await ran).toBe("ran");
    const grants = entries.filter((e) => e.msg === "granted");
    expect(grants.map((e) => [e.key, e.cost, e.waitedMs])).toEqual([
      ["", 1, 0],
      ["", 1, 5],
      ["", 1, 5],
    ]);
    expect(sem.snapshot().permitWaitMs).toBe(10);
  });

  it("logs a waiter's timeout with its key, cost and timeoutMs", async () => {
    const clock = new FakeClock();
    const { logger, entries } = recorder(false);
    const sem = memory({ clock, logger }).semaphore("sem", { limit: 2 });
    await sem.admit();
    const late = sem.admit({ cost: 2, timeoutMs: 10 });
    const failed = late.catch((e: unknown) => e);
    await clock.advance(10);
    expect(await failed).toBeInstanceOf(AdmitTimeoutError);
    expect(entries).toEqual([
      {
        stage: "sem",
        kind: "semaphore",
        backend: "memory",
        key: "",
        cost: 2,
        timeoutMs: 10,
        level: "warn",
        msg: "admission timed out",
      },
    ]);
  });
});

describe("queue", () => {
  it("says it is a queue", () => {
    const q = memory({ clock: new FakeClock() }).queue("jobs", { maxSize: 1 });
    expect(q.kind).toBe("queue");
    expect(q.snapshot().kind).toBe("queue");
  });

  it("sheds with a message naming the queue and its size, and logs the depth", async () => {
    const { logger, entries } = recorder(false);
    const q = memory({ clock: new FakeClock(), logger }).queue("jobs", { maxSize: 2, whenFull: "shed" });
    await q.admit({ cost: 2 });
    const error = await q.admit().catch((e: unknown) => e);
    expect(error).toBeInstanceOf(ShedError);
    expect((error as ShedError).message).toBe('queue "jobs": full (maxSize 2), job shed');
    expect((error as ShedError).stage).toBe("jobs");
    expect(entries).toEqual([
      {
        stage: "jobs",
        kind: "queue",
        backend: "memory",
        depth: 2,
        maxSize: 2,
        level: "warn",
        msg: "queue full, shed",
      },
    ]);
    expect(q.snapshot()).toMatchObject({ shed: 1, queueDepth: 2 });
  });
});

describe("AIMD limiter", () => {
  it("says it is an AIMD limiter", () => {
    const aimd = memory({ clock: new FakeClock() }).aimd("aimd", { initial: 2, max: 4 });
    expect(aimd.kind).toBe("aimd");
    expect(aimd.snapshot().kind).toBe("aimd");
  });

  it("learns nothing from a refund", async () => {
    const aimd = memory({ clock: new FakeClock() }).aimd("aimd", { initial: 2, max: 10 });
    const a = await aimd.admit();
    const b = await aimd.admit();
    await a.refund();
    await b.refund();
    expect(aimd.snapshot().limit).toBe(2);
    // A success at the same load does raise it.
    const c = await aimd.admit();
    await aimd.admit();
    await c.release("success");
    expect(aimd.snapshot().limit).toBe(3);
  });

  it("learns nothing from a call admitted at cost 0", async () => {
    const aimd = memory({ clock: new FakeClock() }).aimd("aimd", { initial: 4, max: 10, backoffRatio: 0.5 });
    const zero = await aimd.admit({ cost: 0 });
    await zero.release("dropped");
    expect(aimd.snapshot().limit).toBe(4);
    const one = await aimd.admit();
    await one.release("dropped");
    expect(aimd.snapshot().limit).toBe(2);
  });

  it("counts a call as slow only when it ran longer than slowCallMs", async () => {
    const clock = new FakeClock();
    const aimd = memory({ clock }).aimd("aimd", { initial: 4, max: 10, slowCallMs: 100, backoffRatio: 0.5 });
    const onTime = await aimd.admit();
    await clock.advance(100);
    await onTime.release("success");
    expect(aimd.snapshot().limit).toBe(4); // 1 of 4 in flight: no increase, and not slow
    const slow = await aimd.admit();
    await clock.advance(101);
    await slow.release("success");
    expect(aimd.snapshot().limit).toBe(2);
  });

  it("reads the clock once to admit and once to release without slowCallMs (for `snapshot().flow`)", async () => {
    const fake = new FakeClock();
    let reads = 0;
    const clock: Clock = {
      now: () => {
        reads++;
        return fake.now();
      },
      setTimeout: (cb, ms) => fake.setTimeout(cb, ms),
      clearTimeout: (t) => fake.clearTimeout(t),
    };
    const aimd = memory({ clock }).aimd("aimd", { initial: 2, max: 4 });
    reads = 0; // the stage's flow starts at the time it is built
    const t = await aimd.admit();
    await t.release("dropped");
    const u = await aimd.admit();
    await u.release("success");
    expect(reads).toBe(4);
  });

  it("logs a cut at warn and a raise at debug, with from, to, outcome and slow", async () => {
    const clock = new FakeClock();
    const { logger, entries } = recorder();
    const aimd = memory({ clock, logger }).aimd("aimd", {
      initial: 4,
      max: 5,
      backoffRatio: 0.5,
      slowCallMs: 50,
    });
    const limitLogs = () =>
      entries.filter((e) => e.msg === "limit changed").map(({ stage, kind, backend, ...rest }) => rest);
    // One of four in flight, fast: no change, no log.
    await (await aimd.admit()).release("success");
    expect(limitLogs()).toEqual([]);
    // Two of four in flight: a raise.
    const a = await aimd.admit();
    const b = await aimd.admit();
    await a.release("success");
    await b.release("ignored");
    // A slow success: a cut.
    const slow = await aimd.admit();
    await clock.advance(51);
    await slow.release("success");
    expect(limitLogs()).toEqual([
      { from: 4, to: 5, outcome: "success", slow: false, level: "debug", msg: "limit changed" },
      { from: 5, to: 2, outcome: "success", slow: true, level: "warn", msg: "limit changed" },
    ]);
  });
});

describe("memory() backend", () => {
  it("names the backend in its own option errors", () => {
    const message = 'memory: unknown option "bogus"; memory takes clock, logger, random';
    expect(() => memory({ bogus: 1 } as never)).toThrow(new InvalidOptionsError(undefined, "bogus", message));
    try {
      memory({ bogus: 1 } as never);
    } catch (error) {
      expect((error as Error).message).toBe(message);
    }
  });

  it("names the option an unknown one most likely meant, and the options taken there", () => {
    const b = memory();
    const cases: [() => unknown, string, string][] = [
      [
        () => b.semaphore("a", { limt: 2 } as never),
        "limt",
        'semaphore "a": unknown option "limt" (did you mean "limit"?); semaphore takes clock, logger, onBackendError, localShare, limit, leaseMs, classes, defaultClass, reclaim',
      ],
      [
        () => b.tokenBucket("b", { capacity: 1, refillPerSecond: 1, penalty: { factr: 0.5 } } as never),
        "penalty.factr",
        'tokenBucket "b": unknown option "penalty.factr" (did you mean "penalty.factor"?); penalty takes factor, recoveryMs, minFactor',
      ],
      // Case alone, then two letters at most; nothing close: no guess.
      [
        () => new Gate([], { FUSE: false } as never),
        "FUSE",
        'gate: unknown option "FUSE" (did you mean "fuse"?)',
      ],
      [() => b.aimd("x", { intial: 2, max: 4 } as never), "intial", '(did you mean "initial"?)'],
      [() => b.queue("q", { maxSize: 1, whenFul: "shed" } as never), "whenFul", '(did you mean "whenFull"?)'],
      [
        () => b.semaphore("c", { limit: 1, bogus: 1 } as never),
        "bogus",
        'semaphore "c": unknown option "bogus"; semaphore takes',
      ],
    ];
    for (const [build, field, text] of cases) {
      let error: unknown;
      try {
        build();
      } catch (e) {
        error = e;
      }
      expect(error, field).toBeInstanceOf(InvalidOptionsError);
      expect(error).toMatchObject({ field });
      expect((error as Error).message).toContain(text);
    }
    // Two options as close as each other: neither is guessed.
    expect(meant("ab", ["abc", "abd"])).toBeUndefined();
    expect(meant("abx", ["abc", "abd"])).toBeUndefined();
    expect(meant("limt", ["limit", "clock", "leaseMs"])).toBe("limit");
    expect(meant("timeout", ["timeoutMs", "key"])).toBe("timeoutMs");
    expect(meant("zzzzzz", ["limit", "leaseMs"])).toBeUndefined();
    // Cut short: the only option it begins, from four letters on.
    expect(meant("refillPerSec", ["capacity", "refillPerSecond"])).toBe("refillPerSecond");
    expect(meant("refillP", ["refillPerSecond", "refillPeriod"])).toBeUndefined();
    expect(meant("cap", ["capacity"])).toBeUndefined();
  });

  it("names each stage's kind when asked again with other options", () => {
    const b = memory({ clock: new FakeClock() });
    b.semaphore("s", { limit: 1 });
    b.tokenBucket("t", { capacity: 1, refillPerSecond: 1 });
    b.queue("q", { maxSize: 1 });
    b.intervalGate("i", { minIntervalMs: 1 });
    b.aimd("a", { initial: 1, max: 2 });
    const again: [string, () => unknown][] = [
      ['semaphore "s"', () => b.semaphore("s", { limit: 2 })],
      ['tokenBucket "t"', () => b.tokenBucket("t", { capacity: 2, refillPerSecond: 1 })],
      ['queue "q"', () => b.queue("q", { maxSize: 2 })],
      ['intervalGate "i"', () => b.intervalGate("i", { minIntervalMs: 2 })],
      ['aimd "a"', () => b.aimd("a", { initial: 1, max: 3 })],
    ];
    for (const [where, build] of again) {
      const error = thrown(build);
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect((error as Error).message.startsWith(`${where}: already built with other options`)).toBe(true);
    }
  });

  it("keeps a stage's own logger rather than the backend's", async () => {
    const own = recorder(false);
    const shared = recorder(false);
    const b = memory({ clock: new FakeClock(), logger: shared.logger });
    const q = b.queue("own", { maxSize: 1, whenFull: "shed", logger: own.logger });
    const p = b.queue("shared", { maxSize: 1, whenFull: "shed" });
    for (const stage of [q, p]) {
      await stage.admit();
      await stage.admit().catch(() => {});
    }
    expect(own.entries.map((e) => e.stage)).toEqual(["own"]);
    expect(shared.entries.map((e) => e.stage)).toEqual(["shared"]);
  });
});

describe("token bucket", () => {
  it("forgets a full key after capacity / refillPerSecond, not later", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("tb", { keyed: true, capacity: 4, refillPerSecond: 2 });
    await bucket.admit({ key: "a", cost: 4 });
    await clock.advance(1999);
    expect(bucket.keyCount).toBe(1);
    await clock.advance(1);
    expect(bucket.keyCount).toBe(0);
  });

  it("admits a cost of 0 at once, without making a key, even past waiters", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("tb", { keyed: true, capacity: 1, refillPerSecond: 1 });
    expect((await bucket.admit({ key: "z", cost: 0 })).cost).toBe(0);
    expect((await bucket.tryAdmit({ key: "z", cost: 0 }))?.cost).toBe(0);
    expect(bucket.admitNow({ key: "z" }, 0)?.cost).toBe(0);
    expect(bucket.keyCount).toBe(0);
    await bucket.admit({ key: "a" });
    const waiting = bucket.admit({ key: "a" });
    expect(await settled(clock, waiting)).toBe(false);
    expect(await settled(clock, bucket.admit({ key: "a", cost: 0 }))).toBe(true);
    expect((await bucket.tryAdmit({ key: "a", cost: 0 }))?.cost).toBe(0);
    expect(bucket.tokens("a")).toBe(0);
    expect(bucket.snapshot()).toMatchObject({ waiting: 1, admitted: 6 });
  });

  it("admitNow refuses a negative cost and admits exactly the capacity", () => {
    const bucket = memory({ clock: new FakeClock() }).tokenBucket("tb", { capacity: 3, refillPerSecond: 1 });
    expect(bucket.admitNow({}, -1)).toBeUndefined();
    expect(bucket.admitNow({}, 1.5)).toBeUndefined();
    expect(bucket.admitNow({}, 4)).toBeUndefined();
    expect(bucket.tokens()).toBe(3);
    expect(bucket.admitNow({}, 3)?.cost).toBe(3);
    expect(bucket.tokens()).toBe(0);
    expect(bucket.admitNow({}, 1)).toBeUndefined();
  });

  it("admitNow refuses when closed, aborted, keyless on a keyed bucket, or behind waiters", async () => {
    const clock = new FakeClock();
    const keyed = memory({ clock }).tokenBucket("k", { keyed: true, capacity: 2, refillPerSecond: 1 });
    expect(keyed.admitNow({}, 1)).toBeUndefined();
    const ac = new AbortController();
    ac.abort();
    expect(keyed.admitNow({ key: "a", signal: ac.signal }, 1)).toBeUndefined();
    expect(keyed.tokens("a")).toBe(2);
    await keyed.admit({ key: "a", cost: 2 });
    const waiting = keyed.admit({ key: "a", cost: 2 });
    await clock.advance(1000); // one token back, the waiter needs two
    expect(keyed.admitNow({ key: "a" }, 1)).toBeUndefined();
    expect(keyed.tokens("a")).toBe(1);
    await keyed.close();
    await expect(waiting).rejects.toBeInstanceOf(ClosedError);
    expect(keyed.admitNow({ key: "b" }, 1)).toBeUndefined();
  });

  it("refuses at once, behind callers in line, a wait longer than timeoutMs, saying how long", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("tb", { capacity: 1, refillPerSecond: 1 });
    await bucket.admit();
    const first = bucket.admit();
    const late = bucket.admit({ timeoutMs: 500 }).catch((e: unknown) => e);
    expect(await settled(clock, late)).toBe(true);
    const error = await late;
    expect(error).toBeInstanceOf(AdmitTimeoutError);
    expect((error as AdmitTimeoutError).retryAfterMs).toBe(2000);
    expect(bucket.snapshot()).toMatchObject({ waiting: 1, timedOut: 1 });
    await clock.advance(1000);
    expect(await settled(clock, first)).toBe(true);
  });

  it("counts the line as a settle, a penalty or a refund has left it, not as it was", async () => {
    const clock = new FakeClock();
    const make = (name: string, initialTokens = 2) =>
      memory({ clock }).tokenBucket(name, {
        capacity: 2,
        refillPerSecond: 1,
        initialTokens,
        penalty: { factor: 0.5, recoveryMs: 1_000_000 },
      });
    /** How long a call of cost 1 would wait behind the line now. */
    const retryAfter = async (bucket: ReturnType<typeof make>) =>
      ((await bucket.admit({ timeoutMs: 0 }).catch((e: unknown) => e)) as AdmitTimeoutError).retryAfterMs;

    // A settle that charges 2 more moves the line's end 2 s later.
    const settling = make("settle");
    const held = await settling.admit({ cost: 2 });
    void settling.admit(); // goes at 1000
    expect(await retryAfter(settling)).toBe(2000);
    await held.settle(4);
    expect(await retryAfter(settling)).toBe(4000);

    // Half the rate from a drop on: the line takes about twice as long.
    const slowed = make("penalty");
    const dropped = await slowed.admit({ cost: 2 });
    void slowed.admit();
    expect(await retryAfter(slowed)).toBe(2000);
    await dropped.release("dropped");
    expect(await retryAfter(slowed)).toBeGreaterThan(3900);

    // A refund of the latest grant brings the waiter behind it, and the line's end, 1 s sooner.
    const refunding = make("refund", 1);
    const latest = await refunding.admit({ cost: 1 });
    void refunding.admit({ cost: 2 }); // goes at 2000
    expect(await retryAfter(refunding)).toBe(3000);
    await latest.refund();
    expect(await retryAfter(refunding)).toBe(2000);

    // A waiter that leaves from the middle of the line takes its place with it.
    const leaving = make("leave", 0);
    const controller = new AbortController();
    void leaving.admit({ signal: controller.signal }).catch(() => undefined); // at 1000
    void leaving.admit(); // at 2000, then 1000 once the first has left
    expect(await retryAfter(leaving)).toBe(3000);
    controller.abort();
    await clock.flush();
    expect(await retryAfter(leaving)).toBe(2000);
    // One who joins after is counted too.
    void leaving.admit(); // at 2000
    expect(await retryAfter(leaving)).toBe(3000);

    // Once the line has emptied, what was kept of its end is not reused: a call taken since
    // (while nobody waited) is counted.
    const emptied = make("emptied", 0);
    void emptied.admit(); // at 1000
    expect(await retryAfter(emptied)).toBe(2000);
    await clock.advance(2000); // the waiter has gone; 1 token back since
    await emptied.admit(); // takes it, nobody waiting
    void emptied.admit(); // at 3000
    expect(await retryAfter(emptied)).toBe(2000);
  });

  it("refuses at once what it cannot grant in time, and logs it", async () => {
    const clock = new FakeClock();
    const { logger, entries } = recorder(false);
    const bucket = memory({ clock, logger }).tokenBucket("tb", { capacity: 2, refillPerSecond: 1 });
    await bucket.admit({ cost: 2 });
    const error = await bucket.admit({ timeoutMs: 300 }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(AdmitTimeoutError);
    expect((error as AdmitTimeoutError).retryAfterMs).toBe(1000);
    expect(entries).toEqual([
      {
        stage: "tb",
        kind: "tokenBucket",
        backend: "memory",
        timeoutMs: 300,
        retryAfterMs: 1000,
        level: "warn",
        msg: "admission timed out",
      },
    ]);
    expect(bucket.snapshot().timedOut).toBe(1);
  });

  it("applies the penalty factor it is given, and logs it", async () => {
    const clock = new FakeClock();
    const { logger, entries } = recorder(false);
    const bucket = memory({ clock, logger }).tokenBucket("tb", {
      keyed: true,
      capacity: 100,
      refillPerSecond: 10,
      penalty: { factor: 0.2, recoveryMs: 1_000_000 },
    });
    const t = await bucket.admit({ key: "k", cost: 100 });
    await t.release("dropped");
    expect(entries).toEqual([
      {
        stage: "tb",
        kind: "tokenBucket",
        backend: "memory",
        key: "k",
        rateFactor: 0.2,
        level: "warn",
        msg: "key penalised after drop",
      },
    ]);
    await clock.advance(1000);
    // About 2 tokens per second right after the drop, not 5 (the default factor 0.5).
    expect(bucket.tokens("k")).toBeGreaterThan(1.9);
    expect(bucket.tokens("k")).toBeLessThan(2.1);
  });

  it("settling at the cost admitted changes nothing, not even the keys kept", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("tb", { keyed: true, capacity: 2, refillPerSecond: 1 });
    const zero = await bucket.admit({ key: "z", cost: 0 });
    await zero.settle(0);
    expect(bucket.keyCount).toBe(0);
    const t = await bucket.admit({ key: "a", cost: 1 });
    await clock.advance(5000); // full again: swept
    expect(bucket.keyCount).toBe(0);
    await t.settle(1);
    expect(bucket.keyCount).toBe(0);
    expect(t.cost).toBe(1);
  });

  it("a give-back by settle grants a waiter at once", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("tb", { capacity: 10, refillPerSecond: 1 });
    const big = await bucket.admit({ cost: 10 });
    const next = bucket.admit({ cost: 5 });
    expect(await settled(clock, next)).toBe(false);
    await big.settle(5);
    expect(await settled(clock, next)).toBe(true);
    expect(bucket.tokens()).toBe(0);
  });

  it("a settle that gives nothing back wakes nobody early", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("tb", { capacity: 4, refillPerSecond: 1 });
    const first = await bucket.admit({ cost: 2 });
    await bucket.admit({ cost: 2 }); // now the latest grant: `first` cannot give back
    const next = bucket.admit({ cost: 3 });
    await first.settle(0);
    expect(await settled(clock, next)).toBe(false);
    await clock.advance(2999);
    expect(await settled(clock, next)).toBe(false);
    await clock.advance(1);
    expect(await settled(clock, next)).toBe(true);
  });

  it("leaves no timer behind once closed", async () => {
    const clock = new FakeClock();
    const bucket = memory({ clock }).tokenBucket("tb", { capacity: 1, refillPerSecond: 1 });
    await bucket.admit();
    const waiting = bucket.admit().catch((e: unknown) => e);
    await clock.flush();
    await bucket.close();
    expect(await waiting).toBeInstanceOf(ClosedError);
    expect(clock.pendingTimers).toBe(0);
  });
});

describe("interval gate", () => {
  it("forgets a host after minIntervalMs + jitterMs, not sooner", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock, random: () => 0 }).intervalGate("ig", {
      minIntervalMs: 1500,
      jitterMs: 1000,
    });
    await gate.admit({ host: "h" });
    await clock.advance(2499);
    expect(gate.hostCount).toBe(1);
    await clock.advance(1);
    expect(gate.hostCount).toBe(0);
  });

  it("forgets a host whose slot comes exactly at the sweep, not one sweep later", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 1000 });
    await gate.admit({ host: "h" });
    await clock.advance(1000);
    expect(gate.hostCount).toBe(0);
  });

  it("forgets a host whose pause ends exactly at the sweep", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 100 });
    await gate.pause("h", 1000);
    await clock.advance(999);
    expect(gate.hostCount).toBe(1);
    expect(gate.delayFor("h")).toBe(1);
    await clock.advance(1);
    expect(gate.hostCount).toBe(0);
  });

  it("keeps a host whose next slot is still ahead at a sweep", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 800 });
    await gate.pause("h", 500); // the host is first seen now: sweeps at 1000, 2000, ...
    await clock.advance(500);
    await gate.admit({ host: "h" }); // next slot at 1300
    await clock.advance(500);
    expect(gate.hostCount).toBe(1);
    expect(gate.delayFor("h")).toBe(300);
  });

  it("keeps a host with a waiter at a sweep, and spaces the waiter's successor from it", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 1000 });
    await gate.admit({ host: "h" });
    const second = gate.admit({ host: "h" });
    await clock.advance(1000); // the sweep runs just before the waiter's timer
    expect(await settled(clock, second)).toBe(true);
    expect(gate.hostCount).toBe(1);
    expect(gate.delayFor("h")).toBe(1000);
  });

  it("makes a second call wait for the slot; admitNow and tryAdmit refuse meanwhile", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 100, defaultHost: "h" });
    await gate.admit();
    expect(await gate.tryAdmit()).toBeUndefined();
    expect(gate.admitNow({}, 1)).toBeUndefined();
    const second = gate.admit();
    expect(await settled(clock, second)).toBe(false);
    await clock.advance(99);
    expect(await settled(clock, second)).toBe(false);
    await clock.advance(1);
    expect(await settled(clock, second)).toBe(true);
    expect(gate.snapshot()).toMatchObject({ admitted: 2, tokenWaitMs: 100 });
  });

  it("lets no caller that comes the instant a slot opens overtake the waiter in line", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 1000 });
    await gate.admit({ host: "h" });
    const order: string[] = [];
    let late: Promise<unknown> | undefined;
    let atOnce: unknown[] = [];
    // Due at the same instant as the waiter's slot, and set before it, so it runs first.
    clock.setTimeout(() => {
      atOnce = [gate.admitNow({ host: "h" }, 1)];
      void gate.tryAdmit({ host: "h" }).then((t) => atOnce.push(t));
      late = gate.admit({ host: "h" }).then(() => order.push("late"));
    }, 1000);
    const waiter = gate.admit({ host: "h" }).then(() => order.push("waiter"));
    await clock.advance(1000);
    expect(atOnce).toEqual([undefined, undefined]);
    expect(order).toEqual(["waiter"]);
    await clock.advance(1000);
    await Promise.all([waiter, late]);
    expect(order).toEqual(["waiter", "late"]);
  });

  it("admitNow refuses a negative or fractional cost, a missing host, closed, aborted", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 100 });
    expect(gate.admitNow({ host: "h" }, -1)).toBeUndefined();
    expect(gate.admitNow({ host: "h" }, 0.5)).toBeUndefined();
    expect(gate.admitNow({}, 1)).toBeUndefined();
    const ac = new AbortController();
    ac.abort();
    expect(gate.admitNow({ host: "h", signal: ac.signal }, 1)).toBeUndefined();
    expect(gate.delayFor("h")).toBe(0);
    expect(gate.snapshot().admitted).toBe(0);
    const zero = gate.admitNow({ host: "h" }, 0);
    expect(zero?.cost).toBe(0);
    expect(gate.delayFor("h")).toBe(100);
    await clock.advance(100);
    expect(gate.admitNow({ host: "h" }, 1)?.cost).toBe(1);
    await gate.close();
    await clock.advance(100);
    expect(gate.admitNow({ host: "h" }, 1)).toBeUndefined();
  });

  it("admitNow admits on a fresh host and behind nobody", () => {
    const gate = memory({ clock: new FakeClock() }).intervalGate("ig", { minIntervalMs: 100 });
    const t = gate.admitNow({ host: "fresh" }, 1);
    expect(t?.cost).toBe(1);
    expect(gate.snapshot()).toMatchObject({ inFlight: 1, admitted: 1 });
  });

  it("tryAdmit admits when the slot has come", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 100 });
    expect(await gate.tryAdmit({ host: "h" })).toBeDefined();
    await clock.advance(100);
    expect(await gate.tryAdmit({ host: "h" })).toBeDefined();
    expect(await gate.tryAdmit({ host: "h" })).toBeUndefined();
  });

  it("logs a pause with its host and length", async () => {
    const { logger, entries } = recorder(false);
    const gate = memory({ clock: new FakeClock(), logger }).intervalGate("ig", { minIntervalMs: 10 });
    await gate.pause("api.test", 250);
    expect(entries).toEqual([
      {
        stage: "ig",
        kind: "intervalGate",
        backend: "memory",
        host: "api.test",
        ms: 250,
        level: "warn",
        msg: "host paused",
      },
    ]);
  });

  it("delayFor() without a default host asks about the host named 'default'", async () => {
    const gate = memory({ clock: new FakeClock() }).intervalGate("ig", { minIntervalMs: 100 });
    await gate.admit({ host: "default" });
    expect(gate.delayFor()).toBe(100);
  });

  it("grants a waiter whose slot comes at the very instant of its timeout", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 1000 });
    await gate.admit({ host: "h" });
    const second = gate.admit({ host: "h", timeoutMs: 1000 });
    await clock.advance(1000);
    const t: Ticket = await second;
    expect(t.cost).toBe(1);
    expect(gate.snapshot()).toMatchObject({ timedOut: 0, admitted: 2 });
  });

  it("leaves no timer behind once closed", async () => {
    const clock = new FakeClock();
    const gate = memory({ clock }).intervalGate("ig", { minIntervalMs: 1000 });
    await gate.admit({ host: "h" });
    const waiting = gate.admit({ host: "h" }).catch((e: unknown) => e);
    await clock.flush();
    await gate.close();
    expect(await waiting).toBeInstanceOf(ClosedError);
    expect(clock.pendingTimers).toBe(0);
  });
});

describe("a Gate's call waiting at a memory permit stage", () => {
  it("counts its wait in the stage's permitWaitMs / queueWaitMs", async () => {
    const clock = new FakeClock();
    const b = memory({ clock });
    const sem = b.semaphore("sem", { limit: 1 });
    const q = b.queue("q", { maxSize: 1 });
    const held = [await sem.admit(), await q.admit()];
    const viaSem = new Gate([sem], { clock }).admit();
    const viaQueue = new Gate([q], { clock }).admit();
    expect(sem.snapshot().waiting).toBe(1);
    expect(q.snapshot().waiting).toBe(1);
    await clock.advance(7);
    for (const t of held) await t.release();
    await (await viaSem).release();
    await (await viaQueue).release();
    expect(sem.snapshot().permitWaitMs).toBe(7);
    expect(q.snapshot().queueWaitMs).toBe(7);
  });

  it("times out at once with timeoutMs 0, without a timer", async () => {
    const clock = new FakeClock();
    const sem = memory({ clock }).semaphore("sem", { limit: 1 });
    await sem.admit();
    const call = new Gate([sem], { clock }).admit({ timeoutMs: 0 }).catch((e: unknown) => e);
    expect(await settled(clock, call)).toBe(true);
    expect(await call).toBeInstanceOf(AdmitTimeoutError);
    expect(sem.snapshot()).toMatchObject({ waiting: 0, timedOut: 1 });
  });

  it("is shed at once by a full shedding queue", async () => {
    const clock = new FakeClock();
    const q = memory({ clock }).queue("q", { maxSize: 1, whenFull: "shed" });
    await q.admit();
    const call = new Gate([q], { clock }).admit().catch((e: unknown) => e);
    expect(await settled(clock, call)).toBe(true);
    expect(await call).toBeInstanceOf(ShedError);
    expect(q.snapshot()).toMatchObject({ waiting: 0, shed: 1 });
  });

  it("waits in line at a blocking queue, and goes on when a slot frees", async () => {
    const clock = new FakeClock();
    const q = memory({ clock }).queue("q", { maxSize: 1 });
    const first = await q.admit();
    const call = new Gate([q], { clock }).admit();
    expect(await settled(clock, call)).toBe(false);
    expect(q.snapshot().waiting).toBe(1);
    await first.release();
    expect(await settled(clock, call)).toBe(true);
  });

  it("is refused with ClosedError by a closed stage", async () => {
    const clock = new FakeClock();
    const sem = memory({ clock }).semaphore("sem", { limit: 1 });
    await sem.close();
    await expect(new Gate([sem], { clock }).admit()).rejects.toBeInstanceOf(ClosedError);
  });
});
