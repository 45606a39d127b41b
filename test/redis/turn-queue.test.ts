import { describe, expect, it } from "vitest";
import { ScriptBatch, TURN_CHUNK, TurnQueue } from "../../src/redis/batch.js";

/** An item of the queue: what it was rejected with, if it was. */
interface Item {
  name: string;
  rejected?: unknown;
  reject(error: unknown): void;
}

function item(name: string): Item {
  const it: Item = {
    name,
    reject: (error) => {
      it.rejected = error;
    },
  };
  return it;
}

/**
 * A fused gate's tries and releases go through a TurnQueue. A `send` that throws must reach every
 * item it was given, whether it went alone at once or with its turn after a tick: an item nobody
 * answers would leave its call waiting forever, and a throw in a tick would end the process.
 */
describe("TurnQueue", () => {
  it("rejects every item of a send that throws, alone or gathered, and goes on sending", async () => {
    const sent: string[][] = [];
    let out: (() => void) | undefined;
    let fail = false;
    const queue = new TurnQueue<Item>((items) => {
      sent.push(items.map((i) => i.name));
      if (fail) throw new Error("send failed");
      return new Promise<void>((resolve) => {
        out = resolve;
      });
    });
    // Alone: sent at once.
    const first = item("first");
    queue.add(first);
    expect(sent).toEqual([["first"]]);
    // While it is out, two are gathered for the end of the turn; their send throws.
    fail = true;
    const a = item("a");
    const b = item("b");
    queue.add(a);
    queue.add(b);
    await new Promise<void>((resolve) => process.nextTick(resolve));
    expect(sent).toEqual([["first"], ["a", "b"]]);
    expect((a.rejected as Error).message).toBe("send failed");
    expect((b.rejected as Error).message).toBe("send failed");
    expect(first.rejected).toBe(undefined);
    // The first's reply comes back; a send that throws at once rejects its item too.
    out!();
    await new Promise<void>((resolve) => setImmediate(resolve));
    const alone = item("alone");
    queue.add(alone);
    expect(sent).toEqual([["first"], ["a", "b"], ["alone"]]);
    expect((alone.rejected as Error).message).toBe("send failed");
    // And a later send that works goes out at once: nothing counts as out.
    fail = false;
    queue.add(item("later"));
    expect(sent.at(-1)).toEqual(["later"]);
  });

  it("sends a turn of more than TURN_CHUNK items as several sends, in order, in the same tick", async () => {
    const sent: number[][] = [];
    const queue = new TurnQueue<Item & { n: number }>((items) => {
      sent.push(items.map((i) => i.n));
      return new Promise<void>(() => {});
    });
    const total = 2 * TURN_CHUNK + 5;
    // The first goes at once; the rest are gathered while it is out.
    for (let n = 0; n <= total; n++) queue.add({ ...item(String(n)), n });
    expect(sent).toEqual([[0]]);
    await new Promise<void>((resolve) => process.nextTick(resolve));
    const numbers = (from: number, count: number) => Array.from({ length: count }, (_, i) => from + i);
    expect(sent).toEqual([
      [0],
      numbers(1, TURN_CHUNK),
      numbers(1 + TURN_CHUNK, TURN_CHUNK),
      numbers(1 + 2 * TURN_CHUNK, 5),
    ]);
  });
});

/** A lone stage's calls of one turn go in script calls of up to TURN_CHUNK too, in order. */
describe("ScriptBatch", () => {
  it("sends a turn of more than TURN_CHUNK calls as several script calls, each call answered with its own reply", async () => {
    const sent: string[][] = [];
    let first: ((reply: unknown) => void) | undefined;
    const batch = new ScriptBatch((args) => {
      sent.push(args);
      // The first goes alone and stays out; each batch answers its calls' first arguments back.
      if (sent.length === 1) {
        return new Promise((resolve) => {
          first = resolve;
        });
      }
      const replies: string[] = [];
      for (let i = 0; i < args.length; i += 2) replies.push(`reply ${args[i]}`);
      return Promise.resolve(replies.length === 1 ? replies[0] : replies);
    });
    const total = 2 * TURN_CHUNK + 5;
    const answers = Array.from({ length: total + 1 }, (_, n) => batch.run(String(n), "x"));
    expect(sent).toEqual([["0", "x"]]);
    await new Promise<void>((resolve) => process.nextTick(resolve));
    const argsOf = (from: number, count: number) =>
      Array.from({ length: count }, (_, i) => [String(from + i), "x"]).flat();
    expect(sent.slice(1)).toEqual([
      argsOf(1, TURN_CHUNK),
      argsOf(1 + TURN_CHUNK, TURN_CHUNK),
      argsOf(1 + 2 * TURN_CHUNK, 5),
    ]);
    first!("reply 0");
    expect(await Promise.all(answers)).toEqual(Array.from({ length: total + 1 }, (_, n) => `reply ${n}`));
  });
});
