import { redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { useClients } from "./clients.js";
import { randomPrefix } from "./helpers.js";

/**
 * A stage with classes whose holder died, its leases taken back by a process that built the
 * same stage without classes (an operator's sweep, a tool): no class keeps counting a permit.
 */
describe("leases of a stage with classes reaped by a process without them", () => {
  const { connect } = useClients();

  it("takes the reaped permits off their classes' counts too", async () => {
    const [dying, sweeping, admin] = [await connect(), await connect(), await connect()];
    const prefix = randomPrefix("mixed-classes");
    const clock = new FakeClock(1_000);
    const options = { prefix, clock, time: "clock", claimMs: 30_000 } as const;
    const classed = redis(dying, options).semaphore("sem", {
      limit: 3,
      leaseMs: 1_000,
      classes: { a: { share: 50 }, b: { share: 50 } },
    });
    await classed.admit({ class: "a" });
    await classed.admit({ class: "b", cost: 2 });
    const meta = `${prefix}{sem}:meta`;
    expect(await admin.hmget(meta, "used", "u0", "u1")).toEqual(["3", "1", "2"]);

    dying.disconnect(); // the holder dies: its leases are renewed no more
    await clock.advance(2_000);
    const plain = redis(sweeping, options).semaphore("sem", { limit: 3, leaseMs: 1_000 });
    const swept = await plain.tryAdmit({ cost: 3 });
    expect(swept).toBeDefined();
    await swept!.release("ignored");
    expect(await admin.hmget(meta, "used", "u0", "u1")).toEqual(["0", "0", "0"]);
  });

  it("takes one reaped lease off its class while others are still held", async () => {
    const [dying, living, admin] = [await connect(), await connect(), await connect()];
    const prefix = randomPrefix("mixed-classes");
    const clock = new FakeClock(1_000);
    const options = { prefix, clock, time: "clock", claimMs: 30_000 } as const;
    const classes = { a: { share: 50 }, b: { share: 50 } };
    const doomed = redis(dying, options).semaphore("sem", { limit: 4, leaseMs: 1_000, classes });
    await doomed.admit({ class: "b", cost: 2 });
    const alive = redis(living, options).semaphore("sem", { limit: 4, leaseMs: 1_000, classes });
    const held = await alive.admit({ class: "a" });
    dying.disconnect();
    await clock.advance(2_000); // the living holder renews; the dead one's lease runs out
    const plain = redis(await connect(), options).semaphore("sem", { limit: 4, leaseMs: 1_000 });
    const t = await plain.tryAdmit({ cost: 3 }); // fits only once the dead lease is reaped
    expect(t).toBeDefined();
    const meta = `${prefix}{sem}:meta`;
    expect(await admin.hmget(meta, "used", "u0", "u1")).toEqual(["4", "1", "0"]);
    await t!.release("ignored");
    await held.release("ignored");
    expect(await admin.hmget(meta, "used", "u0", "u1")).toEqual(["0", "0", "0"]);
  });
});
