import { diagnose, Gate } from "floodgate";
import { redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { useClients } from "./clients.js";
import { randomPrefix } from "./helpers.js";

/**
 * What a Redis permit stage knows of the whole fleet: the permits held by every process, as the
 * last reply said, in `snapshot().fleet`; `diagnose` reads it.
 */
describe("fleet-wide figures of Redis permit stages", () => {
  const { connect } = useClients();

  /** Two processes' backends sharing one prefix, on one fake clock. */
  async function fleet() {
    const [a, b] = [await connect(), await connect()];
    const prefix = randomPrefix("flow-fleet");
    const clock = new FakeClock(1_000);
    const options = { prefix, clock, time: "clock", claimMs: 30_000 } as const;
    return { clock, one: redis(a, options), two: redis(b, options) };
  }

  it("says how many permits the whole fleet holds, against the fleet-wide limit", async () => {
    const { clock, one, two } = await fleet();
    const semOne = one.semaphore("sem", { limit: 8 });
    const semTwo = two.semaphore("sem", { limit: 8 });
    expect(semOne.snapshot().fleet).toBeUndefined(); // nothing heard from Redis yet
    const held = [await semOne.admit(), await semOne.admit(), await semOne.admit()];
    const mine = [await semTwo.admit(), await semTwo.admit()];
    await clock.advance(250);
    expect(semTwo.snapshot().inFlight).toBe(2);
    expect(semTwo.snapshot().fleet).toEqual({ inFlight: 5, limit: 8, ageMs: 250 });
    expect(semOne.snapshot().fleet!.inFlight).toBe(3); // its last reply came before the other's
    await mine[0]!.release("success");
    expect(semTwo.snapshot().fleet).toEqual({ inFlight: 4, limit: 8, ageMs: 0 });
    for (const t of [...held, mine[1]!]) await t.release("success");
    await one.close();
    await two.close();
  });

  it("an AIMD limiter's figure follows its current limit", async () => {
    const { one, two } = await fleet();
    const aimd = one.aimd("aimd", { initial: 4, max: 8 });
    const other = two.aimd("aimd", { initial: 4, max: 8 });
    const t = await other.admit();
    const u = await aimd.admit();
    await u.release("dropped"); // cuts the limit: 4 → 3 (backoffRatio 0.75)
    const snap = aimd.snapshot();
    expect(snap.limit).toBe(3);
    expect(snap.fleet).toEqual({ inFlight: 1, limit: 3, ageMs: 0 });
    await t.release("success");
    await one.close();
    await two.close();
  });

  it("diagnose names a fleet-wide bound full of other processes' calls", async () => {
    const { one, two } = await fleet();
    const semOne = one.semaphore("sem", { limit: 4 });
    const semTwo = two.semaphore("sem", { limit: 4 });
    const held = [await semOne.admit(), await semOne.admit(), await semOne.admit()];
    const gate = new Gate([semTwo]);
    const mine = await gate.admit();
    const d = diagnose(gate);
    expect(d.constraint).toBe("bound");
    expect(d.summary).toMatch(/fleet-wide 4 of 4/);
    expect(d.stages[0]!.line).toMatch(/; fleet-wide 4 of 4$/);
    await mine.release("success");
    for (const t of held) await t.release("success");
    await one.close();
    await two.close();
  });
  it("a fused gate times each stage's flow on that stage's clock, one on a clock of its own too", async () => {
    const client = await connect();
    const clock = new FakeClock(1_000);
    const own = new FakeClock(5_000_000);
    const backend = redis(client, { prefix: randomPrefix("flow-clocks"), clock, time: "clock" });
    const sem = backend.semaphore("sem", { limit: 4 });
    const bucket = backend.tokenBucket("bucket", { capacity: 100, refillPerSecond: 100, clock: own });
    const gate = new Gate([sem, bucket]);
    for (let i = 0; i < 5; i++) {
      // 20 ms pass on the bucket's clock while the call runs, none on the backend's.
      await gate.run(() => own.advance(20));
    }
    // (Read on the backend's clock, at 1,000, the bucket's releases at 5,000,020 and later would be
    // none of its window; read on its own, they all are.)
    expect(bucket.snapshot().flow).toMatchObject({ released: 5, serviceMs: 20 });
    expect(sem.snapshot().flow).toMatchObject({ released: 5, serviceMs: 0 });
    await gate.close();
    await backend.close();
  });
});
