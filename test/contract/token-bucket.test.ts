import { AdmitTimeoutError, InvalidOptionsError, type TokenBucketOptions } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { backends, track, useBackend } from "./backends.js";

describe.each(backends)("token bucket on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;
  const make = (options: TokenBucketOptions) => backend.make(clock).tokenBucket("rate", options);

  beforeEach(() => {
    clock = new FakeClock();
  });

  it("grants a burst up to capacity, then one token per 1/rate", async () => {
    const bucket = make({ capacity: 3, refillPerSecond: 2 });
    const grants: number[] = [];
    const calls = Array.from({ length: 6 }, () => bucket.admit().then(() => grants.push(clock.now())));
    await clock.advance(5000);
    await Promise.all(calls);
    expect(grants).toEqual([0, 0, 0, 500, 1000, 1500]);
    expect(bucket.snapshot().tokenWaitMs).toBe(500 + 1000 + 1500);
  });

  it("refills a key that starts below the cost from its first call on", async () => {
    const bucket = make({ keyed: true, capacity: 5, refillPerSecond: 10, initialTokens: 0 });
    const first = track(bucket.admit({ key: "first" }));
    await clock.advance(99);
    expect(first.settled).toBe(false);
    await clock.advance(1);
    expect(first.settled).toBe(true);
    // A refused try counts as the first call too: the key refills from then.
    expect(await bucket.tryAdmit({ key: "late", cost: 2 })).toBeUndefined();
    await clock.advance(200);
    expect(await bucket.tryAdmit({ key: "late", cost: 2 })).toBeDefined();
  });

  it("keeps one bucket per key", async () => {
    const bucket = make({ keyed: true, capacity: 1, refillPerSecond: 1 });
    await bucket.admit({ key: "acme" });
    const acme = track(bucket.admit({ key: "acme" }));
    const globex = track(bucket.admit({ key: "globex" }));
    await clock.flush();
    expect(globex.settled).toBe(true);
    expect(acme.settled).toBe(false);
    await clock.advance(1000);
    expect(acme.settled).toBe(true);
  });

  it("weighs a call by its cost", async () => {
    const bucket = make({ capacity: 10, refillPerSecond: 10 });
    await bucket.admit({ cost: 8 });
    const next = track(bucket.admit({ cost: 5 }));
    await clock.advance(299);
    expect(next.settled).toBe(false);
    await clock.advance(1);
    expect(next.settled).toBe(true);
  });

  it("refuses a cost above capacity at once, naming the field", async () => {
    const bucket = make({ capacity: 5, refillPerSecond: 1 });
    const error = await bucket.admit({ cost: 6 }).catch((e) => e);
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect(error.field).toBe("cost");
    expect(error.message).toContain('tokenBucket "rate": cost must be <= capacity (5), got 6 (number)');
    await expect(bucket.tryAdmit({ cost: 6 })).rejects.toBeInstanceOf(InvalidOptionsError);
  });

  it("accepts a cost equal to capacity", async () => {
    const bucket = make({ capacity: 5, refillPerSecond: 1 });
    await bucket.admit({ cost: 5 });
    const next = track(bucket.admit({ cost: 5 }));
    await clock.advance(5000);
    expect(next.settled).toBe(true);
  });

  it("refuses at once a wait longer than timeoutMs, saying how long it would take", async () => {
    const bucket = make({ capacity: 1, refillPerSecond: 1 });
    await bucket.admit();
    const error = await bucket.admit({ timeoutMs: 200 }).catch((e) => e);
    expect(error).toBeInstanceOf(AdmitTimeoutError);
    expect(error.retryAfterMs).toBe(1000);
    expect(bucket.snapshot()).toMatchObject({ timedOut: 1, waiting: 0 });
  });

  it("refuses at once, behind others waiting, a wait longer than timeoutMs, saying how long", async () => {
    const bucket = make({ capacity: 1, refillPerSecond: 1 });
    await bucket.admit();
    const first = track(bucket.admit({ cost: 1 })); // goes at 1000
    await clock.flush();
    const error = await bucket.admit({ timeoutMs: 1500 }).catch((e) => e);
    expect(error).toBeInstanceOf(AdmitTimeoutError);
    expect(error.retryAfterMs).toBe(2000);
    expect(bucket.snapshot()).toMatchObject({ timedOut: 1, waiting: 1 });
    const second = track(bucket.admit({ timeoutMs: 2000 }));
    await clock.advance(2000);
    expect(first.settled && second.settled).toBe(true);
    expect(second.error).toBeUndefined();
  });

  it("counts the line as it stands: once a waiter ahead leaves, a shorter timeout is in time", async () => {
    const bucket = make({ capacity: 1, refillPerSecond: 1 });
    await bucket.admit();
    const controller = new AbortController();
    const ahead = track(bucket.admit({ signal: controller.signal }));
    await clock.flush();
    expect((await bucket.admit({ timeoutMs: 1500 }).catch((e) => e)).retryAfterMs).toBe(2000);
    controller.abort();
    await clock.flush();
    expect(ahead.error).toBe(controller.signal.reason);
    const next = track(bucket.admit({ timeoutMs: 1500 }));
    await clock.advance(1000);
    expect(next.settled).toBe(true);
    expect(next.error).toBeUndefined();
  });

  it("grants within timeoutMs when the tokens arrive in time", async () => {
    const bucket = make({ capacity: 1, refillPerSecond: 1 });
    await bucket.admit();
    const next = track(bucket.admit({ timeoutMs: 1000 }));
    await clock.advance(1000);
    expect(next.settled).toBe(true);
    expect(next.error).toBeUndefined();
  });

  it("serves one key first in, first out, so a large cost is not starved", async () => {
    const bucket = make({ capacity: 10, refillPerSecond: 1 });
    await bucket.admit({ cost: 10 });
    const order: string[] = [];
    const big = bucket.admit({ cost: 10 }).then(() => order.push("big"));
    const small = bucket.admit({ cost: 1 }).then(() => order.push("small"));
    await clock.advance(11_000);
    await Promise.all([big, small]);
    expect(order).toEqual(["big", "small"]);
  });

  it("takes nothing for an aborted wait, and the next waiter moves up", async () => {
    const bucket = make({ capacity: 2, refillPerSecond: 1 });
    await bucket.admit({ cost: 2 });
    const controller = new AbortController();
    const big = track(bucket.admit({ cost: 2, signal: controller.signal }));
    const small = track(bucket.admit({ cost: 1 }));
    await clock.advance(1000);
    expect(small.settled).toBe(false);
    controller.abort();
    await clock.flush();
    expect(big.error).toBe(controller.signal.reason);
    expect(small.settled).toBe(true);
    expect(bucket.snapshot().waiting).toBe(0);
    expect(clock.pendingTimers).toBeLessThanOrEqual(1); // at most the idle-key sweep
  });

  it("gives refunded tokens back", async () => {
    const bucket = make({ capacity: 2, refillPerSecond: 1 });
    const ticket = await bucket.admit({ cost: 2 });
    expect(await bucket.tryAdmit()).toBeUndefined();
    await ticket.refund();
    expect(await bucket.tryAdmit({ cost: 2 })).toBeDefined();
  });

  it("never refunds above capacity", async () => {
    const bucket = make({ capacity: 2, refillPerSecond: 1 });
    const ticket = await bucket.admit({ cost: 2 });
    await clock.advance(10_000);
    await ticket.refund();
    expect(await bucket.tryAdmit({ cost: 2 })).toBeDefined();
    expect(await bucket.tryAdmit({ cost: 1 })).toBeUndefined();
  });

  it("slows a key down after a drop when a penalty is set, and recovers", async () => {
    const bucket = make({
      keyed: true,
      capacity: 1,
      refillPerSecond: 10,
      penalty: { factor: 0.5, recoveryMs: 10_000 },
    });
    const first = await bucket.admit({ key: "s1" });
    await first.release("dropped");
    // Half rate right after the drop: one token takes 200 ms instead of 100.
    const slowed = track(bucket.admit({ key: "s1" }));
    await clock.advance(150);
    expect(slowed.settled).toBe(false);
    await clock.advance(50);
    expect(slowed.settled).toBe(true);
    // Another key is untouched.
    const other = await bucket.admit({ key: "s2" });
    await other.release("success");
    // After recoveryMs the rate is back to full.
    await clock.advance(10_000);
    await bucket.admit({ key: "s1" });
    const recovered = track(bucket.admit({ key: "s1" }));
    await clock.advance(100);
    expect(recovered.settled).toBe(true);
  });

  it("does not penalise without a penalty option", async () => {
    const bucket = make({ capacity: 1, refillPerSecond: 10 });
    await (await bucket.admit()).release("dropped");
    const next = track(bucket.admit());
    await clock.advance(100);
    expect(next.settled).toBe(true);
  });

  it("charges a call that cost more than its estimate when it settles", async () => {
    const bucket = make({ capacity: 10, refillPerSecond: 10 });
    const ticket = await bucket.admit({ cost: 2 });
    await ticket.settle(7);
    expect(await bucket.tryAdmit({ cost: 4 })).toBeUndefined();
    expect(await bucket.tryAdmit({ cost: 3 })).toBeDefined();
  });

  it("lets a settle put a key into debt that later calls wait out", async () => {
    const bucket = make({ capacity: 10, refillPerSecond: 10 });
    const ticket = await bucket.admit({ cost: 10 });
    await ticket.settle(15); // 5 tokens of debt
    const next = track(bucket.admit());
    await clock.advance(599);
    expect(next.settled).toBe(false);
    await clock.advance(1);
    expect(next.settled).toBe(true);
  });

  it("gives back what a call did not use when it settles", async () => {
    const bucket = make({ capacity: 10, refillPerSecond: 1 });
    const ticket = await bucket.admit({ cost: 8 });
    await ticket.settle(3);
    expect(await bucket.tryAdmit({ cost: 7 })).toBeDefined();
    expect(await bucket.tryAdmit({ cost: 1 })).toBeUndefined();
  });

  it("gives nothing back on settle once another call has taken from the key", async () => {
    const bucket = make({ capacity: 10, refillPerSecond: 1 });
    const first = await bucket.admit({ cost: 5 });
    await bucket.admit({ cost: 1 });
    await first.settle(1);
    expect(await bucket.tryAdmit({ cost: 5 })).toBeUndefined();
    expect(await bucket.tryAdmit({ cost: 4 })).toBeDefined();
  });

  it("refuses a settle that is not an integer >= 0, naming the field", async () => {
    const bucket = make({ capacity: 10, refillPerSecond: 1 });
    const ticket = await bucket.admit();
    const error = await ticket.settle(-1).catch((e) => e);
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect(error.field).toBe("actual");
  });

  it("refuses bad options with the stage, field, rule and value", () => {
    const b = backend.make(clock);
    expect(() => b.tokenBucket("de-rate", { capacity: 0, refillPerSecond: 1 })).toThrow(
      'tokenBucket "de-rate": capacity must be an integer >= 1, got 0 (number)',
    );
    expect(() => b.tokenBucket("x", { capacity: 1, refillPerSecond: 0 })).toThrow(
      "refillPerSecond must be a finite number > 0, got 0 (number)",
    );
    expect(() => b.tokenBucket("x", { capacity: 1, refillPerSecond: Number.POSITIVE_INFINITY })).toThrow(
      "refillPerSecond must be a finite number > 0, got Infinity (number)",
    );
    expect(() => b.tokenBucket("x", { capacity: 2, refillPerSecond: 1, initialTokens: 3 })).toThrow(
      "initialTokens must be an integer in [0, capacity] (capacity is 2), got 3 (number)",
    );
    expect(() => b.tokenBucket("x", { capacity: 2, refillPerSecond: 1, penalty: { factor: 1 } })).toThrow(
      "penalty.factor must be a number in (0, 1), got 1 (number)",
    );
  });
});
