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

/** The end of the current turn of the event loop (the ticks queued before this one run first). */
const endOfTurn = () => new Promise<void>((resolve) => process.nextTick(resolve));

/**
 * A fused gate's tries and releases go through a TurnQueue. A `send` that throws must reach every
 * item it was given, alone or with its turn: an item nobody answers would leave its call waiting
 * forever, and a throw in a tick would end the process.
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
    // Alone: sent at the end of its turn, not before.
    const first = item("first");
    queue.add(first);
    expect(sent).toEqual([]);
    await endOfTurn();
    expect(sent).toEqual([["first"]]);
    // While it is out, two are gathered for the end of the turn; their send throws.
    fail = true;
    const a = item("a");
    const b = item("b");
    queue.add(a);
    queue.add(b);
    await endOfTurn();
    expect(sent).toEqual([["first"], ["a", "b"]]);
    expect((a.rejected as Error).message).toBe("send failed");
    expect((b.rejected as Error).message).toBe("send failed");
    expect(first.rejected).toBe(undefined);
    // The first's reply comes back; a lone send that throws rejects its item too.
    out!();
    await new Promise<void>((resolve) => setImmediate(resolve));
    const alone = item("alone");
    queue.add(alone);
    await endOfTurn();
    expect(sent).toEqual([["first"], ["a", "b"], ["alone"]]);
    expect((alone.rejected as Error).message).toBe("send failed");
    // And a later send that works still goes, at the end of its turn.
    fail = false;
    const later = item("later");
    queue.add(later);
    await endOfTurn();
    expect(sent.at(-1)).toEqual(["later"]);
    expect(later.rejected).toBe(undefined);
  });

  it("leaves no unhandled rejection when a send's reply fails", async () => {
    const unhandled: unknown[] = [];
    const onUnhandled = (reason: unknown) => unhandled.push(reason);
    process.on("unhandledRejection", onUnhandled);
    try {
      const queue = new TurnQueue<Item>(() => Promise.reject(new Error("lost")));
      queue.add(item("x"));
      await endOfTurn();
      await new Promise<void>((resolve) => setImmediate(resolve));
      expect(unhandled).toEqual([]);
    } finally {
      process.off("unhandledRejection", onUnhandled);
    }
  });

  it("sends a turn of more than TURN_CHUNK items as several sends, in order, in the same tick", async () => {
    const sent: number[][] = [];
    const queue = new TurnQueue<Item & { n: number }>((items) => {
      sent.push(items.map((i) => i.n));
      return new Promise<void>(() => {});
    });
    const total = 2 * TURN_CHUNK + 5;
    // Every item of the turn waits for its end, the first too.
    for (let n = 0; n < total; n++) queue.add({ ...item(String(n)), n });
    expect(sent).toEqual([]);
    await endOfTurn();
    const numbers = (from: number, count: number) => Array.from({ length: count }, (_, i) => from + i);
    expect(sent).toEqual([
      numbers(0, TURN_CHUNK),
      numbers(TURN_CHUNK, TURN_CHUNK),
      numbers(2 * TURN_CHUNK, 5),
    ]);
  });
});

/** A lone stage's calls of one turn go in script calls of up to TURN_CHUNK too, in order. */
describe("ScriptBatch", () => {
  it("sends a turn of more than TURN_CHUNK calls as several script calls, each call answered with its own reply", async () => {
    const sent: string[][] = [];
    const batch = new ScriptBatch((args) => {
      sent.push(args);
      // Each script call answers its calls' first arguments back (one call: its reply alone).
      const replies: string[] = [];
      for (let i = 0; i < args.length; i += 2) replies.push(`reply ${args[i]}`);
      return Promise.resolve(replies.length === 1 ? replies[0] : replies);
    });
    const total = 2 * TURN_CHUNK + 5;
    const answers = Array.from({ length: total }, (_, n) => batch.run(String(n), "x"));
    expect(sent).toEqual([]);
    await endOfTurn();
    const argsOf = (from: number, count: number) =>
      Array.from({ length: count }, (_, i) => [String(from + i), "x"]).flat();
    expect(sent).toEqual([argsOf(0, TURN_CHUNK), argsOf(TURN_CHUNK, TURN_CHUNK), argsOf(2 * TURN_CHUNK, 5)]);
    expect(await Promise.all(answers)).toEqual(Array.from({ length: total }, (_, n) => `reply ${n}`));
  });

  it("sends a lone call alone at the end of its turn, answered with its reply", async () => {
    const sent: string[][] = [];
    const batch = new ScriptBatch((args) => {
      sent.push(args);
      return Promise.resolve(`reply ${args[0]}`);
    });
    const answer = batch.run("only", "x");
    expect(sent).toEqual([]);
    await endOfTurn();
    expect(sent).toEqual([["only", "x"]]);
    expect(await answer).toBe("reply only");
  });
});
