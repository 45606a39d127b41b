import { scriptSource } from "floodgate/redis";
import type { Redis } from "ioredis";
import { describe, expect, it } from "vitest";
import { useClients } from "./clients.js";
import { randomPrefix } from "./helpers.js";

/**
 * A member is never granted twice while it holds its lease: a second grant only moved its lease's
 * end (ZADD of a member already there) while `used` and its class's count went up again, and its
 * one release took them down once, so a permit stayed counted for good with no lease left (the
 * chaos run of docs/guarantees.md clause 12a). The scripts are called directly, at fake times,
 * as the processes (the token before "-" of each member) would call them.
 */
describe("a member that holds its lease is never granted again", () => {
  const { connect } = useClients();
  const CLASSES = "2,1,1,1;1,1,1,0";

  function stage(client: Redis, label: string, limit: number, classes: string) {
    const p = `${randomPrefix(label)}{s}:`;
    const keys = ["holders", "queue", "qexp", "meta", "procs"].map((k) => p + k);
    return {
      keys,
      acquire: (t: number, member: string, mode: string, again: string, lastFence = 0) =>
        client.eval(
          scriptSource("semaphore-acquire"),
          5,
          ...keys,
          t,
          member,
          limit,
          1500,
          mode,
          3000,
          `${p}wake`,
          "",
          lastFence,
          again,
          2000,
          "",
          500,
          classes,
        ) as Promise<unknown[]>,
      release: (t: number, member: string) =>
        client.eval(
          scriptSource("semaphore-release"),
          5,
          ...keys,
          t,
          member,
          limit,
          `${p}wake`,
          "lease",
          500,
          "",
          classes,
        ) as Promise<unknown[]>,
      renew: (t: number, member: string) =>
        client.eval(scriptSource("semaphore-renew"), 2, keys[0]!, keys[4]!, t, member, 1500, "", 2000),
    };
  }

  /** A stage of 2 permits with classes: aa-1 and aa-2 hold them at 1000, bb-1 waits in line. */
  async function fullWithAWaiter(label: string) {
    const client = await connect();
    const s = stage(client, label, 2, CLASSES);
    await s.acquire(1000, "aa-1~0:1", "wait", "");
    await s.acquire(1000, "aa-2~0:1", "wait", "");
    expect((await s.acquire(1001, "bb-1~0:1", "wait", ""))[0]).toBe(0);
    return { client, s };
  }

  /** Nothing held, nothing counted: in all and by each class. */
  async function expectNothingHeld(client: Redis, s: ReturnType<typeof stage>) {
    expect(await client.zcard(s.keys[0]!)).toBe(0);
    expect(await client.hmget(s.keys[3]!, "used", "u0", "u1")).toEqual(["0", "0", "0"]);
  }

  it("takes a waiter granted by its own call's reaping as admitted, not lined up again (classes)", async () => {
    const { client, s } = await fullWithAWaiter("own-grant");
    await s.renew(2400, "aa-2~0:1"); // aa-1's process is gone: its lease ends at 2500
    // bb-1 asks again: aa-1 is reaped and bb-1, the head of its class's line, gets the permit.
    const reply = await s.acquire(2600, "bb-1~0:1", "wait", "1");
    expect(reply[0]).toBe(1);
    expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual([]);
    expect(Number(await client.zscore(s.keys[0]!, "bb-1~0:1"))).toBe(2600 + 1500); // a full lease
    expect((await s.release(3000, "aa-2~0:1"))[3]).toEqual([]);
    await s.release(3100, "bb-1~0:1");
    await expectNothingHeld(client, s);
  });

  it("does not line up again, in a quarantine, a waiter that holds a grant made before it began", async () => {
    const { client, s } = await fullWithAWaiter("quarantine");
    expect((await s.release(1010, "aa-1~0:1"))[3]).toHaveLength(1); // bb-1 granted on the release
    // A process that saw a fence Redis has lost asks: the quarantine begins.
    expect((await s.acquire(1015, "cc-1~1:1", "try", "", 99))[6]).toBe(1500);
    // bb-1's poll, sent before its grant message came, arrives: it holds its grant, so it is not lined up.
    expect((await s.acquire(1020, "bb-1~0:1", "wait", "1"))[0]).toBe(0);
    expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual([]);
    // Its process takes the grant from the message and renews it.
    for (const t of [1400, 2000, 2400]) {
      await s.renew(t, "bb-1~0:1");
      await s.renew(t, "aa-2~0:1");
    }
    expect((await s.release(2600, "aa-2~0:1"))[3]).toEqual([]); // after the quarantine: nobody to grant
    await s.release(2700, "bb-1~0:1");
    await expectNothingHeld(client, s);
  });

  it.each([
    ["without classes", "", "aa-1:1", { used: "2" }],
    ["with classes", CLASSES, "aa-1~0:1", { used: "2", u0: "1", u1: "1" }],
  ])(
    "sets back to nothing a count with no lease held, when it stands in a caller's way (%s)",
    async (_, classes, member, count) => {
      const client = await connect();
      const s = stage(client, "healed", 2, classes);
      // However it came to be: permits counted, none held, nobody in line.
      await client.hset(s.keys[3]!, count);
      expect((await s.acquire(1000, member, "wait", ""))[0]).toBe(1);
      expect(await client.hmget(s.keys[3]!, "used", "u0", "u1")).toEqual(
        classes === "" ? ["1", null, null] : ["1", "1", "0"],
      );
      await s.release(1100, member);
      expect(await client.hget(s.keys[3]!, "used")).toBe("0");
    },
  );

  it.each([
    ["without classes", "", "bb-1:1", "aa-1:1"],
    ["with classes", CLASSES, "bb-1~0:1", "aa-1~0:1"],
  ])(
    "grants nothing, and counts nothing, to a waiter in line that holds its lease already (%s)",
    async (_, classes, held, other) => {
      const client = await connect();
      const s = stage(client, "held", 3, classes);
      await s.acquire(1000, other, "wait", "");
      await s.acquire(1000, held, "wait", "");
      // However it came to be, `held` both holds a lease and waits in line.
      await client.zadd(s.keys[1]!, 99, held);
      await client.zadd(s.keys[2]!, 4000, held);
      expect((await s.release(1100, other))[3]).toEqual([]);
      expect(await client.zrange(s.keys[1]!, 0, -1)).toEqual([]);
      expect(Number(await client.zscore(s.keys[0]!, held))).toBe(2500); // its lease as it was
      expect(await client.hget(s.keys[3]!, "used")).toBe("1");
    },
  );
});
