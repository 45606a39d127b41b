import {
  AdmitTimeoutError,
  BackendUnavailableError,
  ClosedError,
  Gate,
  InvalidOptionsError,
  memory,
  type Outcome,
  type Stage,
  type Ticket,
} from "floodgate";
import { type RedisBackend, redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import type { Redis } from "ioredis";
import { describe, expect, it } from "vitest";
import { TURN_CHUNK } from "../../src/redis/batch.js";
import { commandName } from "../../src/redis/scripts.js";
import { recorder } from "../recorder.js";
import { warningsDuring } from "../warnings.js";
import { ownRedis, useClients } from "./clients.js";
import { randomPrefix, seeded, until, within } from "./helpers.js";

/** This file counts the script calls Redis runs: on a server of its own. */
const redisUrl = ownRedis();

/**
 * A Gate of Redis stages of one backend decides an admission in one script call (lua/gate.lua):
 * every stage at one instant, all or nothing, holding nothing while a call waits.
 */
describe("a fused Redis gate", () => {
  const { connect } = useClients(redisUrl);

  /** A backend on its own connection (a process of the fleet), deciding with `clock`'s time. */
  async function backend(
    prefix: string,
    clock: FakeClock,
    extra: { pollMs?: number; random?: () => number } = {},
  ) {
    const client = await connect();
    return { client, b: redis(client, { prefix, clock, time: "clock", claimMs: 30_000, ...extra }) };
  }

  /**
   * Two gates on `b` sharing its semaphore "inflight" (limit 1): "gate", with a bucket, and
   * "other", with an interval gate; neither of those binds.
   */
  function sharingGates(b: RedisBackend, clock: FakeClock) {
    const sem = b.semaphore("inflight", { limit: 1 });
    const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 100, refillPerSecond: 1 })], { clock });
    const other = new Gate([sem, b.intervalGate("hosts", { minIntervalMs: 0, defaultHost: "api" })], {
      name: "other",
      clock,
    });
    return { sem, gate, other };
  }

  /**
   * Count the script calls on keys under `prefix`, as MONITOR sees them (other test files share
   * the server, so its global counts would not do), and the messages they publish telling a
   * waiter to ask again (`wakes`: on channels under `prefix`, but for grants).
   */
  async function countScripts(
    prefix: string,
  ): Promise<{ readonly calls: number; readonly wakes: number; shown(): Promise<void>; stop(): void }> {
    const monitor = await connect();
    const other = await connect();
    const feed = await monitor.monitor();
    let echoed = 0;
    const counter = {
      calls: 0,
      wakes: 0,
      /** Resolves once MONITOR has shown every command sent before it was called. */
      async shown() {
        const mark = `${prefix}mark`;
        const before = echoed;
        await other.echo(mark);
        await until(() => echoed > before, { timeoutMs: 2000, message: "MONITOR did not show the mark" });
      },
      stop: () => feed.disconnect(),
    };
    feed.on("monitor", (_time: string, args: string[]) => {
      const command = args[0]?.toLowerCase();
      if (command === "echo" && args[1] === `${prefix}mark`) echoed++;
      if ((command === "evalsha" || command === "eval") && args.slice(3).some((a) => a.startsWith(prefix)))
        counter.calls++;
      if (command === "publish" && args[1]?.startsWith(prefix) && !args[2]?.startsWith("g|")) counter.wakes++;
    });
    return counter;
  }

  /** Wait until the line at `key` holds `n` callers: 5 s bounds a failure, and proves no timing. */
  function lined(client: Redis, key: string, n: number, message: string): Promise<unknown> {
    return until(async () => (await client.zcard(key)) === n, { timeoutMs: 5000, message });
  }

  /** The llm scenario's five stages: rpm and tpm buckets, a semaphore, AIMD, an interval gate. */
  function llm(b: ReturnType<typeof redis>) {
    return [
      b.tokenBucket("rpm", { capacity: 60, refillPerSecond: 1 }),
      b.tokenBucket("tpm", { capacity: 10_000, refillPerSecond: 200 }),
      b.semaphore("inflight", { limit: 4 }),
      b.aimd("adaptive", { initial: 4, max: 8 }),
      b.intervalGate("hosts", { minIntervalMs: 0, defaultHost: "api" }),
    ];
  }

  it("is fused for two or more stages of one Redis backend, and chained otherwise", async () => {
    const clock = new FakeClock();
    const { b } = await backend(randomPrefix("fused-which"), clock);
    const { b: other } = await backend(randomPrefix("fused-which-2"), clock);
    const m = memory({ clock });
    const sem = b.semaphore("s", { limit: 2 });
    const bucket = b.tokenBucket("t", { capacity: 2, refillPerSecond: 1 });
    expect(new Gate([sem, bucket]).fused).toBe(true);
    expect(new Gate([b.queue("q", { maxSize: 4 }), sem, bucket]).fused).toBe(true);
    expect(new Gate([sem]).fused).toBe(false);
    expect(new Gate([m.semaphore("m", { limit: 2 }), bucket]).fused).toBe(false);
    expect(new Gate([other.semaphore("o", { limit: 2 }), bucket]).fused).toBe(false);
    const classes = { interactive: { share: 0.5 }, bulk: { share: 0.5 } };
    expect(new Gate([b.semaphore("c", { limit: 2, classes }), bucket]).fused).toBe(false);
    const open = b.semaphore("open", { limit: 2, onBackendError: "fail-open" });
    expect(new Gate([open, bucket]).fused).toBe(false);
    expect(new Gate([new Gate([sem, bucket]), b.semaphore("s2", { limit: 1 })]).fused).toBe(false);
  });

  it("admits and releases a four- and a five-stage gate in one script call each", async () => {
    const clock = new FakeClock();
    const prefix = randomPrefix("fused-calls");
    const { b } = await backend(prefix, clock);
    const five = new Gate(llm(b), { clock });
    const [rpm, tpm, sem, aimd] = five.stages;
    const four = new Gate([rpm!, tpm!, sem!, aimd!], { clock, name: "four" });
    // Scripts reach Redis once before counting (the first call of a script sends its body).
    await (await five.admit({ costs: { tpm: 100 } })).release("success");
    await (await four.admit()).release("success");
    const counter = await countScripts(prefix);
    try {
      for (const gate of [four, five]) {
        for (let i = 0; i < 3; i++) {
          const before = counter.calls;
          const ticket = await gate.admit({ costs: { tpm: 100 } });
          await counter.shown();
          expect(counter.calls - before).toBe(1);
          await ticket.release("success");
          await counter.shown();
          expect(counter.calls - before).toBe(2);
        }
      }
    } finally {
      counter.stop();
    }
    expect(sem!.snapshot().inFlight).toBe(0);
    expect(aimd!.snapshot().inFlight).toBe(0);
  });

  /** The bucket's and the interval gate's keys as Redis would dump them, and the permit counts. */
  async function state(client: Redis, prefix: string) {
    const keys = (await client.keys(`${prefix}*`)).sort();
    const dumps: Record<string, string | null> = {};
    for (const key of keys) {
      if (key.includes("{rate}") || key.includes("{hosts}")) {
        dumps[key] = (await client.dumpBuffer(key))?.toString("hex") ?? null;
      }
    }
    return {
      dumps,
      held: await client.zcard(`${prefix}{inflight}:holders`),
      used: await client.hget(`${prefix}{inflight}:meta`, "used"),
      aimdHeld: await client.zcard(`${prefix}{adaptive}:holders`),
    };
  }

  it("holds nothing anywhere when one stage refuses: a full semaphore leaves tokens and spacing as they were", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-none");
    const { client, b } = await backend(prefix, clock);
    const rate = b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 });
    const hosts = b.intervalGate("hosts", { minIntervalMs: 500, defaultHost: "api" });
    const sem = b.semaphore("inflight", { limit: 1 });
    const aimd = b.aimd("adaptive", { initial: 2, max: 2 });
    const gate = new Gate([rate, hosts, sem, aimd], { clock });
    const first = await gate.admit();
    await clock.advance(600);
    const before = await state(client, prefix);
    expect(await gate.tryAdmit()).toBe(undefined);
    expect(await state(client, prefix)).toEqual(before);
    await first.release("success");
    // Now every stage admits: all of them are taken together.
    const second = await gate.tryAdmit();
    expect(second).toBeDefined();
    expect(sem.snapshot().inFlight).toBe(1);
    expect(aimd.snapshot().inFlight).toBe(1);
    await second!.release("success");
  });

  it("holds nothing anywhere when the bucket refuses: the permits it would have taken stay free", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-none-rate");
    const { client, b } = await backend(prefix, clock);
    const gate = new Gate(
      [
        b.semaphore("inflight", { limit: 3 }),
        b.aimd("adaptive", { initial: 3, max: 3 }),
        b.intervalGate("hosts", { minIntervalMs: 0, defaultHost: "api" }),
        b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 }),
      ],
      { clock },
    );
    const first = await gate.admit();
    const before = await state(client, prefix);
    expect(before.held).toBe(1);
    expect(await gate.tryAdmit()).toBe(undefined);
    expect(await state(client, prefix)).toEqual(before);
    await first.release("success");
  });

  it("rejects a call one stage refuses on its own (a keyed bucket given no key) with that stage's error, holding nothing", async () => {
    // The bucket refuses before any script call; the gate call still goes with the other steps.
    // Its rejection must wait for that call without being an unhandled rejection meanwhile.
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-bad-option");
    const { client, b } = await backend(prefix, clock);
    const sem = b.semaphore("inflight", { limit: 1 });
    const gate = new Gate(
      [
        sem,
        b.intervalGate("hosts", { minIntervalMs: 100, defaultHost: "api" }),
        b.tokenBucket("rate", { keyed: true, capacity: 1, refillPerSecond: 1 }),
      ],
      { clock },
    );
    await (await gate.admit({ key: "k" })).release("success");
    await clock.advance(100);
    const before = await state(client, prefix);
    for (const entry of ["admit", "tryAdmit"] as const) {
      const error = await gate[entry]().then(
        () => undefined,
        (e: unknown) => e,
      );
      expect(error, entry).toBeInstanceOf(InvalidOptionsError);
      expect((error as InvalidOptionsError).field, entry).toBe("key");
      expect(sem.snapshot().inFlight, entry).toBe(0);
      expect(await state(client, prefix), entry).toEqual(before);
    }
    // The host's spacing and the permit were given back: the next call goes at once.
    const ticket = await gate.tryAdmit({ key: "j" });
    expect(ticket).toBeDefined();
    await ticket!.release("success");
  });

  it("leaves a host that had no slot without one when a later stage refuses: it starts at once, even below zero", async () => {
    // A host's slot is put back from the interval gate's reply, not from a copy of its key.
    const clock = new FakeClock(-5000);
    const prefix = randomPrefix("fused-no-slot");
    const { client, b } = await backend(prefix, clock);
    const gate = new Gate(
      [
        b.intervalGate("hosts", { minIntervalMs: 100 }),
        b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 }),
      ],
      { clock },
    );
    const first = await gate.admit({ host: "a" });
    expect(await gate.tryAdmit({ host: "z" })).toBe(undefined);
    expect(await client.exists(`${prefix}{hosts}:h:z`)).toBe(0);
    await clock.advance(1000);
    // The clock still reads below zero: a slot of 0 would refuse the call; no slot admits it.
    const second = await gate.tryAdmit({ host: "z" });
    expect(second).toBeDefined();
    await first.release("success");
    await second!.release("success");
  });

  it("holds no permit while a call waits for its token, whatever the order of the stages", async () => {
    const clock = new FakeClock(1000);
    const { b } = await backend(randomPrefix("fused-order"), clock);
    const sem = b.semaphore("inflight", { limit: 1 });
    // The semaphore first: chained, a waiting call would hold its permit while the bucket refills.
    const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 })], { clock });
    const first = await gate.admit();
    await first.release("success");
    let second: Ticket | undefined;
    const waiting = gate.admit().then((t) => {
      second = t;
    });
    for (let ms = 0; ms < 900; ms += 100) {
      await clock.advance(100);
      expect(second).toBe(undefined);
      expect(sem.snapshot().inFlight).toBe(0);
      // The permit is free for anyone else meanwhile.
      const other = await sem.tryAdmit();
      expect(other).toBeDefined();
      await other!.release("success");
    }
    await clock.advance(100);
    await waiting;
    expect(second).toBeDefined();
    expect(sem.snapshot().inFlight).toBe(1);
    await second!.release("success");
  });

  it("grants the stage's own waiters on its release, with the stage's keys (a semaphore shared with direct callers)", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-shared");
    const { b, client } = await backend(prefix, clock);
    const { b: other } = await backend(prefix, clock);
    const sem = b.semaphore("inflight", { limit: 1 });
    const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 })], { clock });
    const held = await gate.admit();
    // Callers of the semaphore itself, in this process and in another, wait in its own line.
    const queued = (n: number) =>
      lined(client, `${prefix}{inflight}:queue`, n, "the direct callers did not line up");
    const direct = other.semaphore("inflight", { limit: 1 }).admit();
    await queued(1);
    const local = sem.admit();
    await queued(2);
    // The gate's release grants the first of them in the same script call.
    await held.release("success");
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(1);
    expect(await client.zcard(`${prefix}{inflight}:queue`)).toBe(1);
    // (The other process's waiter is passed over while its grant channel has no listener yet.)
    const granted = await Promise.race([direct, local]);
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(1);
    await granted.release("success");
    for (const t of await Promise.all([direct, local])) if (t !== granted) await t.release("success");
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(0);
  });

  it("admits a turn at once up to the first call a stage refuses, in order, and decides the rest as alone", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-pass");
    const { b, client } = await backend(prefix, clock);
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 3 }), b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 })],
      {
        clock,
      },
    );
    const held = await gate.admit();
    // Five at one instant: with one held, two fit; each later one is refused, holding nothing.
    const turn = await Promise.all(Array.from({ length: 5 }, () => gate.tryAdmit()));
    expect(turn.map((t) => t !== undefined)).toEqual([true, true, false, false, false]);
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(3);
    expect(await client.hget(`${prefix}{inflight}:meta`, "used")).toBe("3");
    expect(Number(await client.hget(`${prefix}{rate}:b:default`, "tokens"))).toBeCloseTo(2, 6);
    for (const t of [held, ...turn]) await t?.release("success");
    expect(await client.hget(`${prefix}{inflight}:meta`, "used")).toBe("0");
  });

  it("counts a lease already in Redis once, as the stage's script would, when a turn's leases go in together", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-lease-there");
    const { b, client } = await backend(prefix, clock);
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 4 }), b.tokenBucket("rate", { capacity: 9, refillPerSecond: 1 })],
      { clock },
    );
    const holders = `${prefix}{inflight}:holders`;
    const used = async () => await client.hget(`${prefix}{inflight}:meta`, "used");
    const held = await gate.admit();
    // A lease of one permit takes its call's name, "<token>-<n>", n counting up the gate's calls.
    // Some are there already, as a client that sent a call twice would leave them: the script
    // writes them again uncounted.
    const [member] = await client.zrange(holders, 0, 0);
    const [, token, n] = /^([0-9a-f]+)-(\d+)$/.exec(member!)!;
    const next = (k: number) => `${token}-${Number(n) + k}`;
    await client.zadd(holders, 2000, next(2), 2000, next(3));
    // Three at one instant: the first goes alone (new), the other two in one call (both there;
    // counted as new, the two would fill the limit).
    const turn = await Promise.all([gate.tryAdmit(), gate.tryAdmit(), gate.tryAdmit()]);
    expect(turn.map((t) => t !== undefined)).toEqual([true, true, true]);
    expect(await used()).toBe("2");
    expect(await client.zcard(holders)).toBe(4);
    // Their leases were written again: they end with the call's lease, not at 2000 ms.
    expect(Number(await client.zscore(holders, next(2)))).toBeGreaterThan(2000);
    // A call alone, the same way.
    await client.zadd(holders, 2000, next(4));
    expect(await gate.tryAdmit()).toBeDefined();
    expect(await used()).toBe("2");
    expect(Number(await client.zscore(holders, next(4)))).toBeGreaterThan(2000);
    await held.release("success");
    await gate.close();
  });

  it("lets nobody past a caller waiting in a permit stage's own line, even with room for a smaller one", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-ahead");
    const { b, client } = await backend(prefix, clock);
    const { b: other } = await backend(prefix, clock);
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 2 }), b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 })],
      {
        clock,
      },
    );
    const direct = other.semaphore("inflight", { limit: 2 });
    const holder = await direct.admit();
    // Two permits wanted, one free: it waits first in the stage's line.
    const big = direct.admit({ cost: 2 });
    await lined(client, `${prefix}{inflight}:queue`, 1, "the caller of two permits did not line up");
    // One permit is free, but the gate's call of one would pass the caller ahead of it.
    expect(await gate.tryAdmit()).toBeUndefined();
    expect(await client.hget(`${prefix}{inflight}:meta`, "used")).toBe("1");
    await holder.release("success");
    await (await big).release("success");
    const after = await gate.tryAdmit();
    expect(after).toBeDefined();
    await after!.release("success");
  });

  it("grants nothing during a quarantine, whether Redis lost the stage's data or keeps its mark", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-quarantine");
    const { b, client } = await backend(prefix, clock);
    const sem = b.semaphore("inflight", { limit: 4, leaseMs: 5000 });
    const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 50, refillPerSecond: 1 })], { clock });
    await (await gate.admit()).release("success");
    await (await gate.admit()).release("success");
    // The stage's data gone (a restart without persistence): this process has seen fences the
    // store no longer has, so the next admission starts a quarantine of a lease instead.
    await client.del(`${prefix}{inflight}:meta`);
    expect(await gate.tryAdmit()).toBeUndefined();
    expect(Number(await client.hget(`${prefix}{inflight}:meta`, "quarantine"))).toBe(clock.now() + 5000);
    await clock.advance(4999);
    expect(await gate.tryAdmit()).toBeUndefined();
    await clock.advance(1);
    const after = await gate.tryAdmit();
    expect(after).toBeDefined();
    // The fencing sequence goes on from the highest this process had seen.
    expect(Number(await client.hget(`${prefix}{inflight}:meta`, "seq"))).toBeGreaterThan(2);
    await after!.release("success");
  });

  it("admits and releases with stage names that hold lone surrogates, reaching the stage's own waiters as their calls do", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-surrogate");
    const { b, client } = await backend(prefix, clock);
    const { b: other } = await backend(prefix, clock);
    // (On the wire a lone surrogate goes as U+FFFD, the replacement character, in keys and arguments.)
    const name = "in\ud800flight\udc00";
    const key = (part: string) => `${prefix}{in\ufffdflight\ufffd}:${part}`;
    const sem = b.semaphore(name, { limit: 1 });
    const gate = new Gate([sem, b.tokenBucket("rate\udbff", { capacity: 5, refillPerSecond: 1 })], { clock });
    expect(gate.fused).toBe(true);
    const held = await gate.admit();
    expect(await client.zcard(key("holders"))).toBe(1);
    // A caller of the semaphore itself, in another process, waits in its line and hears its
    // grant on the channel the gate's release names (once it listens: a release passes over a
    // waiter nobody listens for).
    const channels = () => client.pubsub("CHANNELS", key("wake:*"));
    const listening = (await channels()).length;
    const direct = other.semaphore(name, { limit: 1 }).admit();
    await until(async () => (await channels()).length > listening, {
      timeoutMs: 5000,
      message: "the direct caller did not listen for its grant",
    });
    await lined(client, key("queue"), 1, "the direct caller did not line up");
    await held.release("success");
    const granted = await within(direct, 5000, "the direct caller's admission");
    await granted.release("success");
    expect(await client.zcard(key("holders"))).toBe(0);
  });

  it("decides its permit line when a permit is freed outside it: by a caller of the stage, or by another gate, here or in another process", async () => {
    // The fake clock never moves: a waiter's poll never comes, so only being told admits it.
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-freed");
    const { client, b } = await backend(prefix, clock);
    const { sem, gate, other } = sharingGates(b, clock);
    expect([gate.fused, other.fused]).toEqual([true, true]);
    const line = `${prefix}{gate:gate|inflight|rate}:line`;
    // A caller of the stage in another process, and the other gate there.
    const { b: remoteBackend } = await backend(prefix, clock);
    const remote = remoteBackend.semaphore("inflight", { limit: 1 });
    const remoteOther = new Gate(
      [remote, remoteBackend.intervalGate("hosts", { minIntervalMs: 0, defaultHost: "api" })],
      { name: "other", clock },
    );
    const freed = `${prefix}{inflight}:wake:freed`;
    const heard = async () => ((await client.pubsub("NUMSUB", freed)) as [string, number])[1] > 0;
    // What is said there, seen through a pattern (which NUMSUB does not count).
    const said: string[] = [];
    const tap = await connect();
    tap.on("pmessage", (_pattern: string, _channel: string, message: string) => said.push(message));
    await tap.psubscribe(freed);
    // First through the gate itself: from then on its process listens for grants, so a waiter of
    // the gate sleeps once in line (before, it asks once more after it starts listening).
    const holders = [
      () => gate.admit(),
      () => sem.admit(),
      () => other.admit(),
      () => remote.admit(),
      () => remoteOther.admit(),
    ];
    for (const holder of holders) {
      const held = await holder();
      const waiting = gate.admit();
      await lined(client, line, 1, "the gate's call did not line up for the permit");
      // (Its process listens for permits freed elsewhere once one of its calls was first in line.)
      await until(heard, { timeoutMs: 5000, message: "nobody listened for freed permits" });
      await held.release("success");
      const admitted = await within(waiting, 5000, "the gate's call, once the permit was freed");
      expect(await client.zcard(line)).toBe(0);
      await admitted.release("success");
    }
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(0);
    // Said by the releases of the stage's own callers (""), and by those through the other gate,
    // in each process, as "<that gate's wake channel>|<its token there>": not by the gate's own,
    // which decides its line itself. (The mark comes after anything said before it.)
    await client.publish(freed, "mark");
    await until(() => said.includes("mark"), { timeoutMs: 5000, message: "the mark did not come" });
    const otherChannel = `${prefix}{gate:other|inflight|hosts}:gwake`;
    expect(said.map((m) => m.replace(/\|[0-9a-f]{16}$/, "|<token>"))).toEqual([
      "",
      `${otherChannel}|<token>`,
      "",
      `${otherChannel}|<token>`,
      "mark",
    ]);
    expect(said[1]).not.toBe(said[3]);
    await Promise.all([gate.close(), other.close(), remoteOther.close()]);
  });

  it("tells another gate of permits its releases free only while that gate's callers wait for them", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-freed-gates");
    // Waiters stay in line (and their gate stays known as waiting) 30 s without asking again.
    const { client, b } = await backend(prefix, clock, { pollMs: 10_000 });
    const { gate, other } = sharingGates(b, clock);
    const freed = `${prefix}{inflight}:wake:freed`;
    const gates = `${prefix}{inflight}:wake:gates`;
    const said: string[] = [];
    const tap = await connect();
    tap.on("pmessage", (_pattern: string, _channel: string, message: string) => said.push(message));
    await tap.psubscribe(freed);
    const mark = async (text: string) => {
      await client.publish(freed, text);
      await until(() => said.includes(text), { timeoutMs: 5000, message: `${text} did not come` });
    };

    // Nobody waits: a release through the other gate says nothing.
    await (await other.admit()).release("success");
    await mark("nobody waits");
    expect(said).toEqual(["nobody waits"]);

    // The gate's call waits for the permit: the gate is known as waiting there until its wait
    // would end (30 s), and the other gate's release says so.
    const held = await other.admit();
    const waiting = gate.admit();
    await lined(client, `${prefix}{gate:gate|inflight|rate}:line`, 1, "the gate's call did not line up");
    expect(await client.zrange(gates, 0, -1, "WITHSCORES")).toEqual([
      `${prefix}{gate:gate|inflight|rate}:gwake`,
      "31000",
    ]);
    await held.release("success");
    const admitted = await within(waiting, 5000, "the gate's call, once the permit was freed");
    await mark("one waits");
    expect(said.slice(1)).toEqual([
      expect.stringMatching(/\{gate:other\|inflight\|hosts\}:gwake\|[0-9a-f]{16}$/),
      "one waits",
    ]);
    // (Its own release decides its own line: nothing said.)
    await admitted.release("success");

    // Once that wait is over, the other gate's release says nothing, and forgets the gate there.
    await clock.advance(30_000);
    await (await other.admit()).release("success");
    await mark("no longer");
    expect(said.slice(3)).toEqual(["no longer"]);
    expect(await client.zcard(gates)).toBe(0);
    await Promise.all([gate.close(), other.close()]);
  });

  it("asks Redis once, not again, for what a release through a gate frees while another gate waits", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-freed-once");
    // Two processes, each on a pub/sub connection of this test's, to see when a message has been
    // handled (the backend's own listener came first).
    const process1 = await connect();
    const sub1 = await connect();
    const process2 = await connect();
    const sub2 = await connect();
    const options = { prefix, clock, time: "clock" as const, claimMs: 30_000 };
    const b1 = redis(process1, { ...options, subscriber: sub1 });
    const b2 = redis(process2, { ...options, subscriber: sub2 });
    const { gate: gate1, other: other1 } = sharingGates(b1, clock);
    const sem2 = b2.semaphore("inflight", { limit: 1 });
    const gate2 = new Gate([sem2, b2.tokenBucket("rate", { capacity: 100, refillPerSecond: 1 })], { clock });
    const client = process1;
    const freed = `${prefix}{inflight}:wake:freed`;
    const listeners = async () => ((await client.pubsub("NUMSUB", freed)) as [string, number])[1];
    const held = await gate1.admit();
    // Waiting, each first in its gate's line, its process listening for permits freed at the
    // stage: a call of the other gate in process 1, and a call of the gate in process 2 (its steps
    // kept, for a release to decide it).
    const waitingOther = other1.admit();
    await lined(
      client,
      `${prefix}{gate:other|inflight|hosts}:line`,
      1,
      "the other gate's call did not line up",
    );
    const waiting = gate2.admit();
    await lined(client, `${prefix}{gate:gate|inflight|rate}:line`, 1, "the gate's call did not line up");
    await until(async () => (await client.hlen(`${prefix}{gate:gate|inflight|rate}:held`)) === 1, {
      timeoutMs: 5000,
      message: "the gate's waiting call's steps were not kept",
    });
    await until(async () => (await listeners()) === 2, {
      timeoutMs: 5000,
      message: "the two processes did not listen for freed permits",
    });
    const seen: string[][] = [[], []];
    for (const [i, sub] of [sub1, sub2].entries()) {
      sub.on("message", (channel: string, message: string) => {
        if (channel === freed) seen[i]!.push(message);
      });
    }
    const counter = await countScripts(prefix);
    try {
      // The gate's release in process 1 admits its waiting call in process 2 and, since the other
      // gate's caller waits at the stage, says so on the stage's channel, heard in both. The other
      // gate, of the releasing process, was told directly, and asks once (a grant call); the gate
      // decided its own line. Neither acts on what the channel says: two script calls in all.
      await held.release("success");
      const admitted = await within(waiting, 5000, "the gate's call, once the permit was freed");
      await until(() => seen[0]!.length === 1 && seen[1]!.length === 1, {
        timeoutMs: 5000,
        message: "the release said nothing",
      });
      await counter.shown();
      expect(counter.calls).toBe(2);
      await admitted.release("success");
      await (await within(waitingOther, 5000, "the other gate's call")).release("success");
    } finally {
      counter.stop();
    }
    await Promise.all([gate1.close(), other1.close(), gate2.close()]);
  });

  it("asks again when the lease that keeps its permit runs out (a holder that died), not at its next poll", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-lease-end");
    // Polls 30 to 90 s apart: within the second this test moves the clock, only the lease's end
    // can make the call ask again.
    const { client, b } = await backend(prefix, clock, { pollMs: 60_000 });
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 1 }), b.tokenBucket("rate", { capacity: 100, refillPerSecond: 1 })],
      { clock },
    );
    // A holder whose process died: its lease ends at 1500 ms, and nobody will release it.
    await client.zadd(`${prefix}{inflight}:holders`, 1500, "dead-1:1");
    await client.hset(`${prefix}{inflight}:meta`, "used", 1);
    let admitted: Ticket | undefined;
    const waiting = gate.admit().then((t) => {
      admitted = t;
      return t;
    });
    await lined(client, `${prefix}{gate:gate|inflight|rate}:line`, 1, "the call did not line up");
    await clock.advance(499);
    expect(admitted).toBe(undefined);
    await clock.advance(2);
    const ticket = await within(waiting, 5000, "the call, once the dead holder's lease ran out");
    expect(await client.zrange(`${prefix}{inflight}:holders`, 0, -1)).not.toContain("dead-1:1");
    await ticket.release("success");
    await gate.close();
  });

  it("keeps a call in its own lane in a turn where its steps repeat the call before it's", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-lane-repeat");
    const { client, b } = await backend(prefix, clock);
    const gate = new Gate(
      [
        b.semaphore("inflight", { limit: 10 }),
        b.intervalGate("hosts", { minIntervalMs: 60_000, defaultHost: "api" }),
      ],
      { clock },
    );
    const lane = (name: string) => `${prefix}{gate:gate|inflight|hosts}:lane:${name}`;
    // The first call goes alone; the next two, made while it is out, go together in one turn.
    // They take the same host's slot (the default, named or not), so their steps differ only in
    // their own arguments; their lanes differ (the host as the call gives it).
    const first = gate.admit({ host: "other" });
    const named = gate.admit({ host: "api" });
    const unnamed = gate.admit();
    const tickets = await Promise.all([first, named]);
    await lined(client, lane("|"), 1, "the call without a host did not wait in its own lane");
    expect(await client.exists(lane("api|"))).toBe(0);
    const closed = gate.close();
    await expect(unnamed).rejects.toThrow();
    for (const t of tickets) await t.release("success");
    await closed;
  });

  it("lets a lane go while another waits for its own tokens (keyed buckets do not hold each other up)", async () => {
    const clock = new FakeClock(1000);
    const { b } = await backend(randomPrefix("fused-lanes"), clock);
    const gate = new Gate(
      [
        b.semaphore("inflight", { limit: 10 }),
        b.tokenBucket("rate", { keyed: true, capacity: 1, refillPerSecond: 1 }),
      ],
      { clock },
    );
    const a1 = await gate.admit({ key: "a" });
    let a2: Ticket | undefined;
    const waiting = gate.admit({ key: "a" }).then((t) => {
      a2 = t;
    });
    await clock.advance(10);
    expect(a2).toBe(undefined);
    // Key "b" has its token: it goes at once, not behind key "a"'s waiter.
    const b1 = await within(gate.admit({ key: "b" }), 2000, "key b's admission");
    await clock.advance(1000);
    await waiting;
    expect(a2).toBeDefined();
    for (const t of [a1, a2!, b1]) await t.release("success");
  });

  it("serves the callers a full semaphore refused in arrival order, whichever process they ask from", async () => {
    const prefix = randomPrefix("fused-fifo");
    const clients = [await connect(), await connect()];
    const fleet = clients.map((client) => {
      const b = redis(client, { prefix, pollMs: 200 });
      return new Gate([
        b.semaphore("inflight", { limit: 1 }),
        b.tokenBucket("rate", { capacity: 100, refillPerSecond: 100 }),
      ]);
    });
    const [one, two] = fleet as [Gate, Gate];
    const holder = await one.admit();
    const order: string[] = [];
    const asks: [string, Gate][] = [
      ["one-1", one],
      ["two-1", two],
      ["one-2", one],
      ["two-2", two],
    ];
    const calls: Promise<void>[] = [];
    for (const [name, gate] of asks) {
      calls.push(
        gate.run(async () => {
          order.push(name);
        }),
      );
      // Each has lined up before the next asks.
      const line = `${prefix}{gate:gate|inflight|rate}:line`;
      await until(
        async () =>
          (await clients[0]!.zscore(line, "x")) === null && (await clients[0]!.zcard(line)) === calls.length,
        {
          timeoutMs: 2000,
          message: `${name} did not line up`,
        },
      );
    }
    await holder.release("success");
    await within(Promise.all(calls), 5000, "the waiting calls");
    expect(order).toEqual(["one-1", "two-1", "one-2", "two-2"]);
  });

  it("takes a caller that gives up out of the line, and the next goes on", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-leave");
    const { client, b } = await backend(prefix, clock);
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 1 }), b.tokenBucket("rate", { capacity: 10, refillPerSecond: 10 })],
      { clock },
    );
    const line = `${prefix}{gate:gate|inflight|rate}:line`;
    const holder = await gate.admit();
    const timedOut = gate.admit({ timeoutMs: 100 }).catch((e: unknown) => e);
    const controller = new AbortController();
    const aborted = gate.admit({ signal: controller.signal }).catch((e: unknown) => e);
    let next: Ticket | undefined;
    const later = gate.admit().then((t) => {
      next = t;
    });
    await clock.advance(10);
    expect(await client.zcard(line)).toBe(3);
    // With no time to wait, a call only tries: it takes no place in line.
    expect(await gate.admit({ timeoutMs: 0 }).catch((e: unknown) => e)).toBeInstanceOf(AdmitTimeoutError);
    expect(await client.zcard(line)).toBe(3);
    controller.abort(new Error("gave up"));
    await clock.advance(100);
    expect(await timedOut).toBeInstanceOf(AdmitTimeoutError);
    expect(((await aborted) as Error).message).toBe("gave up");
    await until(async () => (await client.zcard(line)) === 1, {
      timeoutMs: 2000,
      message: "the line did not shrink",
    });
    await holder.release("success");
    await clock.advance(10);
    await within(later, 2000, "the last caller");
    expect(next).toBeDefined();
    expect(await client.zcard(line)).toBe(0);
    await next!.release("success");
  });

  it("closes with every waiting call rejected, and no listener piled on a shared signal", async () => {
    const clock = new FakeClock(1000);
    const { b } = await backend(randomPrefix("fused-close"), clock);
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 1 }), b.tokenBucket("rate", { capacity: 10, refillPerSecond: 10 })],
      { clock },
    );
    const warnings = await warningsDuring(async () => {
      const holder = await gate.admit();
      const waiting = Array.from({ length: 30 }, () => gate.admit().catch((e: unknown) => e));
      await clock.advance(10);
      expect(gate.snapshot().waiting).toBe(30);
      await gate.close();
      for (const outcome of await Promise.all(waiting)) expect(outcome).toBeInstanceOf(ClosedError);
      await holder.release("success");
    });
    expect(warnings).not.toContain("MaxListenersExceededWarning");
  });

  it("passes a waiter that stopped asking once its place in line expires", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-dead");
    const { client, b } = await backend(prefix, clock, { pollMs: 100 });
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 1 }), b.tokenBucket("rate", { capacity: 10, refillPerSecond: 10 })],
      { clock },
    );
    const id = `${prefix}{gate:gate|inflight|rate}`;
    // A process that lined up and was killed: its place ends 300 ms (3 polls) after its last ask.
    await client.zadd(`${id}:line`, 0, "deadbeef-1");
    await client.zadd(`${id}:lexp`, 1300, "deadbeef-1");
    let ticket: Ticket | undefined;
    const waiting = gate.admit().then((t) => {
      ticket = t;
    });
    await clock.advance(250);
    expect(ticket).toBe(undefined);
    await clock.advance(200);
    await waiting;
    expect(ticket).toBeDefined();
    await ticket!.release("success");
  });

  /**
   * Two processes on one lane (a semaphore that never binds, a bucket of one token a 100 ms),
   * each deciding with its own clock: a first whose clock never moves on (a process frozen; it
   * polls every 1000 ms), and a live one (its poll `livePollMs`, its random 0). `warm`: a caller
   * of the live process waits first (from 1000 to 1100), so that process listens on its channel
   * and its next caller's first try is the only ask before it sleeps. Then the frozen first is
   * refused for the rate, first in the lane, told to come back in 100 ms, and never does; and the
   * live process's next caller lines up right behind it: `next`, with `admitted()` saying whether
   * it has been.
   */
  async function behindFrozenFirst(label: string, livePollMs: number, warm: boolean) {
    const frozenClock = new FakeClock(1000);
    const clock = new FakeClock(1000);
    const prefix = randomPrefix(label);
    const stages = (b: RedisBackend): Stage[] => [
      b.semaphore("inflight", { limit: 10 }),
      b.tokenBucket("rate", { capacity: 1, refillPerSecond: 10 }),
    ];
    const { b: one } = await backend(prefix, frozenClock, { pollMs: 1000 });
    const { client, b: two } = await backend(prefix, clock, { pollMs: livePollMs, random: () => 0 });
    const frozen = new Gate(stages(one), { clock: frozenClock });
    const live = new Gate(stages(two), { clock });
    const lane = `${prefix}{gate:gate|inflight|rate}:lane:`;
    const inLane = (n: number, message: string) =>
      until(async () => (await client.zcard(lane)) === n, { timeoutMs: 2000, message });
    await (await live.admit()).release("success"); // the bucket's one token, at 1000
    if (warm) {
      const waited = live.admit({ timeoutMs: 60_000 });
      await inLane(1, "the live process's caller did not wait");
      await clock.advance(100);
      await (await within(waited, 2000, "the live process's waiting caller")).release("success");
      await frozenClock.advanceTo(1100);
    }
    const stuck = frozen.admit({ timeoutMs: 60_000 }).catch((error: unknown) => error);
    await inLane(1, "no first in the lane");
    let ticket: Ticket | undefined;
    const next = live.admit({ timeoutMs: 60_000 }).then((t) => {
      ticket = t;
    });
    await inLane(2, "nobody behind it");
    return {
      clock,
      admitted: () => ticket !== undefined,
      async end() {
        await within(next, 2000, "the next in the lane");
        await ticket!.release("success");
        await frozen.close();
        await stuck;
      },
    };
  }

  it("keeps a first that does not come back when its wait is over only its turn's length: the next in its lane goes on as it ends", async () => {
    const { clock, admitted, end } = await behindFrozenFirst("fused-frozen-first", 1000, false);
    // Its turn: its wait and half a poll (100 + 500 ms), to 1600. The next, right behind it, is
    // told so: it asks at its poll, 1500, still behind it, and then as the turn ends, at 1601,
    // first, and its token is there (at its next poll, 2000, before it was told; a place of three
    // polls, to 4000, would keep it waiting past then).
    await clock.advance(500);
    expect(admitted()).toBe(false);
    await clock.advance(100);
    expect(admitted(), "admitted before the first's turn ended").toBe(false);
    await clock.advance(1);
    await end();
  });

  it("tells a first try right behind a first that does not come back when that first's turn ends: it asks then, not at its poll", async () => {
    // The live process polls every 1500 ms, longer than the frozen first's turn (100 + 500 ms,
    // from 1100 to 1700). Its caller's first try, right behind the first, was told the turn ends
    // at 1700: it asks at 1701 (at its poll, 2600, before it was told).
    const { clock, admitted, end } = await behindFrozenFirst("fused-frozen-first-try", 3000, true);
    await clock.advance(600);
    expect(admitted(), "admitted before the first's turn ended").toBe(false);
    await clock.advance(1);
    await end();
  });

  /**
   * A second process of the fleet whose grant messages can be cut off (`deaf()`: another
   * connection keeps listening on its channel, so Redis still takes it for alive) or which can
   * look dead (`dead()`: nobody listens on its channel).
   */
  async function deafened(prefix: string, clock: FakeClock) {
    const client = await connect();
    const subscriber = await connect();
    const spare = await connect();
    const b = redis(client, { prefix, clock, time: "clock", claimMs: 500, pollMs: 200, subscriber });
    const deaf = async (id: string) => {
      const [member] = await client.zrange(`${id}:line`, 0, 0);
      await spare.subscribe(`${id}:gwake:${member!.slice(0, member!.indexOf("-"))}`);
      await subscriber.unsubscribe();
    };
    return {
      b,
      deaf,
      dead: () => subscriber.unsubscribe(),
      // (Its pub/sub connection back: listening again on its wake channel, `id`'s.)
      hears: (id: string, token: string) => subscriber.subscribe(`${id}:gwake:${token}`),
    };
  }

  /**
   * Two processes of the fleet with the same gate of `stages` (its name "gate"): `a` an ordinary
   * one, with `extra` for its backend; `bGate` one made by `deafened`, whose `deaf` and `dead`
   * come with it; `id` the base of the gate's keys.
   */
  /** A gate's stages: a semaphore "inflight" of `limit` (leases of `leaseMs`), then a bucket "rate" of 10, 10 a second. */
  function inflightAndRate(limit: number, leaseMs?: number): (b: ReturnType<typeof redis>) => Stage[] {
    return (b) => [
      b.semaphore("inflight", leaseMs === undefined ? { limit } : { limit, leaseMs }),
      b.tokenBucket("rate", { capacity: 10, refillPerSecond: 10 }),
    ];
  }

  async function twoProcesses(
    name: string,
    clock: FakeClock,
    stages: (b: ReturnType<typeof redis>) => Stage[],
    extra: { pollMs?: number } = {},
  ) {
    const prefix = randomPrefix(name);
    const { client, b: one } = await backend(prefix, clock, extra);
    const second = await deafened(prefix, clock);
    const list = stages(one);
    const a = new Gate(list, { clock });
    const bGate = new Gate(stages(second.b), { clock });
    const id = `${prefix}{gate:gate|${list.map((stage) => stage.name).join("|")}}`;
    return { client, prefix, a, bGate, id, deaf: second.deaf, dead: second.dead, hears: second.hears };
  }

  /**
   * Resolves once `n` waiters of the permit line have their steps kept, each from try `fromTry` or
   * later (a process's first waiter tries again at once, once the process listens for grants).
   */
  async function kept(client: Redis, id: string, n: number, fromTry = 2): Promise<void> {
    const settled = async () => {
      let count = 0;
      for (const m of await client.zrange(`${id}:line`, 0, -1)) {
        const steps = await client.hget(`${id}:held`, `s:${m}`);
        if (steps !== null && Number(JSON.parse(steps)[0]) >= fromTry) count++;
      }
      return count === n;
    };
    await until(settled, {
      timeoutMs: 2000,
      message: `${n} waiter(s) did not line up with their steps kept`,
    });
  }

  /**
   * The same gate twice on one fake clock: on Redis (`b`) and in memory. Each is a semaphore
   * "inflight" of 1 (on Redis with long leases, so no renewal falls due), then a bucket "rate"
   * (10, 10 a second, unless `rate` says).
   */
  function twinGates(b: RedisBackend, clock: FakeClock, rate = { capacity: 10, refillPerSecond: 10 }) {
    const twin = memory({ clock });
    const sems = [
      b.semaphore("inflight", { limit: 1, leaseMs: 120_000 }),
      twin.semaphore("inflight", { limit: 1 }),
    ];
    const rates = [b, twin].map((on) => on.tokenBucket("rate", rate));
    const gates = [0, 1].map((i) => new Gate([sems[i]!, rates[i]!], { clock }));
    return { gates, sems, rates };
  }

  it("counts a waiter's wait until a release admits it against its permit stage, as in memory", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-grant-wait");
    const { client, b } = await backend(prefix, clock, { pollMs: 60_000 });
    const { gates, sems, rates } = twinGates(b, clock);
    const holders = [await gates[0]!.admit(), await gates[1]!.admit()];
    const waiting = gates.map((g) => g.admit());
    await kept(client, `${prefix}{gate:gate|inflight|rate}`, 1);
    // Nothing but the release can admit it: the fake clock moves 500 ms and no timer is due.
    await clock.advance(500);
    for (const h of holders) await h.release("success");
    const tickets = await within(Promise.all(waiting), 2000, "the waiters' grants");
    for (const sem of sems) expect(sem.snapshot().permitWaitMs).toBe(500);
    for (const rate of rates) expect(rate.snapshot().tokenWaitMs).toBe(0);
    for (const gate of gates) expect(gate.snapshot().permitWaitMs).toBe(500);
    for (const t of tickets) await t.release("success");
  });

  it("keeps the snapshots a fused memory gate keeps, through waits ended by a grant, a timeout and an abort", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-parity");
    const { client, b } = await backend(prefix, clock, { pollMs: 60_000 });
    const { gates } = twinGates(b, clock);
    const holders = await Promise.all(gates.map((g) => g.admit()));
    const stops = gates.map(() => new AbortController());
    const ended = gates.map((g, i) => [
      g.admit({ timeoutMs: 200 }).then(
        () => "admitted",
        (error: unknown) => (error as Error).name,
      ),
      g.admit({ signal: stops[i]!.signal }).then(
        () => "admitted",
        (error: unknown) => (error as Error).name,
      ),
    ]);
    const granted = gates.map((g) => g.admit());
    const line = `${prefix}{gate:gate|inflight|rate}:line`;
    await until(async () => (await client.zcard(line)) === 3, { timeoutMs: 2000, message: "the waiters" });
    await kept(client, `${prefix}{gate:gate|inflight|rate}`, 1);
    await clock.advance(100);
    for (const stop of stops) stop.abort();
    await clock.advance(100);
    // (The Redis gate's callers that gave up leave its line in the background.)
    await until(async () => (await client.zcard(line)) === 1, { timeoutMs: 2000, message: "the line" });
    await clock.advance(100);
    for (const h of holders) await h.release("success");
    const tickets = await within(Promise.all(granted), 2000, "the grants");
    for (const outcomes of ended)
      expect(await Promise.all(outcomes)).toEqual(["AdmitTimeoutError", "AbortError"]);
    await clock.advance(50);
    for (const t of tickets) await t.release("success");
    // Each gate's snapshot and its stages', but for what only Redis has (the backend's name, the
    // fleet's view of a permit stage).
    const seen = gates.map((g) =>
      JSON.parse(JSON.stringify(g.snapshot()), (key, value) =>
        key === "backend" || key === "fleet" ? undefined : value,
      ),
    );
    expect(seen[0]).toEqual(seen[1]);
    expect(seen[0].permitWaitMs).toBe(100 + 200 + 300);
    expect(seen[0]).toMatchObject({ admitted: 2, timedOut: 1, aborted: 1, waiting: 0, inFlight: 0 });
  });

  it("counts a wait once when the try that ends it fails", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-wait-failed");
    const client = await connect();
    // (No jitter: the waiter asks again at its poll, 1000 ms on.)
    const b = redis(client, { prefix, clock, time: "clock", pollMs: 1000, random: () => 0.5 });
    const sem = b.semaphore("inflight", { limit: 1, leaseMs: 120_000 });
    const gate = new Gate([sem, b.tokenBucket("rate", { capacity: 10, refillPerSecond: 10 })], { clock });
    await gate.admit();
    const waiting = gate.admit().then(
      () => undefined,
      (error: unknown) => error,
    );
    await kept(client, `${prefix}{gate:gate|inflight|rate}`, 1);
    await clock.advance(999);
    // Redis goes away: the try at the poll fails closed, ending the wait.
    client.disconnect();
    await clock.advance(1);
    expect(await within(waiting, 2000, "the failed try")).toBeInstanceOf(BackendUnavailableError);
    expect(sem.snapshot().permitWaitMs).toBe(1000);
  });

  /**
   * Twin gates (see `twinGates`) of one permit and one token, then one a second: A holds; B waits
   * for the permit, first in line, and C behind it; A releases 100 ms on, which admits B's permit
   * but not its token (900 ms away): B keeps its place, waiting for the rate, C behind it. Returns
   * once B is admitted, 900 ms later, with C still waiting.
   */
  async function behindARate(name: string) {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix(name);
    const { client, b } = await backend(prefix, clock, { pollMs: 60_000 });
    const { gates, sems, rates } = twinGates(b, clock, { capacity: 1, refillPerSecond: 1 });
    const id = `${prefix}{gate:gate|inflight|rate}`;
    const first = await Promise.all(gates.map((g) => g.admit()));
    const second = gates.map((g) => g.admit());
    await kept(client, id, 1);
    const third = gates.map((g) => g.admit());
    await lined(client, `${id}:line`, 2, "the second waiter did not line up");
    await clock.advance(100);
    for (const t of first) await t.release("success");
    await kept(client, id, 1, 3);
    await clock.advance(900);
    const bs = await within(Promise.all(second), 2000, "B's admission");
    return { clock, client, id, sems, rates, bs, third };
  }

  it("counts the wait of a caller behind a first that waits for a rate at that rate, as in memory", async () => {
    const { clock, client, id, sems, rates, bs, third } = await behindARate("fused-behind-rate");
    await clock.advance(100);
    // Now C is first, and waits for its own token.
    for (const t of bs) await t.release("success");
    await kept(client, id, 1, 2);
    await clock.advance(900);
    const cs = await within(Promise.all(third), 2000, "C's admission");
    for (const t of cs) await t.release("success");
    // B: 100 ms for the permit, 900 for the token; C: 100 and 100 for the permit (before B's
    // token wait and after it), 900 behind B for the token and 900 for its own.
    for (const sem of sems) expect(sem.snapshot().permitWaitMs).toBe(300);
    for (const rate of rates) expect(rate.snapshot().tokenWaitMs).toBe(2700);
  });

  it("counts the wait of a caller a release admits behind a first that waited for a rate at that rate, as in memory", async () => {
    const { clock, sems, rates, bs, third } = await behindARate("fused-granted-rate");
    // B holds for a second; its release admits C, whose token is there by then.
    await clock.advance(1000);
    for (const t of bs) await t.release("success");
    const cs = await within(Promise.all(third), 2000, "C's grant");
    for (const t of cs) await t.release("success");
    // B: 100 ms for the permit, 900 for the token; C: 100 for the permit, 900 behind B for the
    // token, then 1,000 for the permit B held.
    for (const sem of sems) expect(sem.snapshot().permitWaitMs).toBe(1200);
    for (const rate of rates) expect(rate.snapshot().tokenWaitMs).toBe(1800);
  });

  /**
   * Twin gates (see `twinGates`) of one permit and one token, then four a second, on a fake
   * clock; `call` runs a call of 150 ms through a gate, `drive` moves the clock 5 ms at a time
   * until every one of `work` has ended.
   */
  async function fourASecond(name: string) {
    const clock = new FakeClock(1000);
    const { b } = await backend(randomPrefix(name), clock);
    const twins = twinGates(b, clock, { capacity: 1, refillPerSecond: 4 });
    const call = (gate: Gate) =>
      gate.run(() => new Promise<void>((resolve) => clock.setTimeout(resolve, 150)));
    const drive = async (work: Promise<unknown>[], what: string) => {
      let done = 0;
      const ended = () => done++;
      for (const w of work) w.then(ended, ended);
      for (let step = 0; step < 1000 && done < work.length; step++) await clock.advance(5);
      await within(Promise.all(work), 2000, what);
    };
    return { clock, ...twins, call, drive };
  }

  it("counts a caller's wait for permits from when the permit line took its lane, as in memory", async () => {
    // Four calls at once, three rounds: from the second round on, the first waits for a token in
    // its lane with the others behind it; once it is admitted, the next is refused the permit and
    // the permit line takes the whole lane, whose callers then wait behind the holder (permits)
    // and behind the line's first (its token), in turn.
    const { gates, sems, rates, call, drive } = await fourASecond("fused-lane-moved");
    for (let round = 0; round < 3; round++) {
      await drive(
        gates.flatMap((gate) => [0, 1, 2, 3].map(() => call(gate))),
        `round ${round}'s calls`,
      );
    }
    // Each round 900 ms for the permit (150, 300 and 450 by the second, third and fourth) and
    // 600 for tokens, then 1,000 (100 more for each: the first waits 100 ms for its token).
    for (const sem of sems) expect(sem.snapshot().permitWaitMs).toBe(2700);
    for (const rate of rates) expect(rate.snapshot().tokenWaitMs).toBe(2600);
  });

  it("counts the waits of callers that ask again as soon as each call ends as memory counts them", async () => {
    // Four callers, each asking again as soon as its call ends, for 3 s: whoever replies while
    // the line's first waits for its token must not count the part of that wait still to come
    // as gone by (it passes while they wait, and counts at the rate then).
    const { clock, gates, sems, rates, call, drive } = await fourASecond("fused-looping");
    const end = clock.now() + 3000;
    const loop = async (gate: Gate) => {
      while (clock.now() < end) await call(gate);
    };
    await drive(
      gates.flatMap((gate) => [0, 1, 2, 3].map(() => loop(gate))),
      "the callers' loops",
    );
    // 16 calls. The first four, asked at once, wait 900 ms for the permit and 600 for tokens in
    // all; each later one 450 and 400: 150 behind each of the three holders ahead of it, and 100
    // for each one's token, and its own (a token every 250 ms, calls of 150).
    for (const sem of sems) expect(sem.snapshot().permitWaitMs).toBe(6300);
    for (const rate of rates) expect(rate.snapshot().tokenWaitMs).toBe(5400);
  });

  it("admits the first waiter on a release, in that script call: its process does not ask again", async () => {
    const clock = new FakeClock(1000);
    const { client, prefix, a, bGate, id } = await twoProcesses(
      "fused-grant",
      clock,
      inflightAndRate(1, 10_000),
      { pollMs: 200 },
    );
    const holder = await a.admit();
    let ticket: Ticket | undefined;
    const waiting = bGate.admit().then((t) => {
      ticket = t;
    });
    await kept(client, id, 1);
    const counter = await countScripts(prefix);
    try {
      const before = counter.calls;
      await holder.release("success");
      // The fake clock stands still: no poll, no renewal. Only the grant message can admit it.
      await within(waiting, 2000, "the waiter's grant");
      await counter.shown();
      expect(counter.calls - before).toBe(1);
    } finally {
      counter.stop();
    }
    // The grant's record (its steps and their replies), until it ends.
    const [member] = await client.zrange(`${id}:hexp`, 0, -1);
    expect((await client.hkeys(`${id}:held`)).sort()).toEqual([`g:${member}`, `s:${member}`]);
    // The grant's lease lasts its claim window, until the waiter's process renews it.
    const holders = `${prefix}{inflight}:holders`;
    const [, ends] = await client.zrange(holders, 0, 0, "WITHSCORES");
    expect(Number(ends)).toBe(1500);
    await clock.advance(400);
    await until(async () => Number((await client.zrange(holders, 0, 0, "WITHSCORES"))[1]) > 1500, {
      timeoutMs: 2000,
      message: "the grant was not renewed",
    });
    expect(Number((await client.zrange(holders, 0, 0, "WITHSCORES"))[1])).toBeGreaterThan(1000 + 10_000);
    await clock.advance(600);
    expect(await client.hlen(`${id}:held`)).toBe(2);
    await ticket!.release("success");
    expect(await client.zcard(holders)).toBe(0);
    // A later grant clears the records that ended.
    const next = await a.admit();
    const third = bGate.admit();
    await kept(client, id, 1, 1);
    await next.release("success");
    await (await within(third, 2000, "the second grant")).release("success");
    expect((await client.hkeys(`${id}:held`)).sort()).toEqual(
      (await client.zrange(`${id}:hexp`, 0, -1)).flatMap((m) => [`g:${m}`, `s:${m}`]).sort(),
    );
    expect(await client.zcard(`${id}:hexp`)).toBe(1);
  });

  it("lets no lone call past a caller waiting in the gate's permit line, even with room for it", async () => {
    const clock = new FakeClock(1000);
    const { client, a, bGate, id } = await twoProcesses(
      "fused-line-first",
      clock,
      inflightAndRate(2, 10_000),
      { pollMs: 200 },
    );
    const holder = await a.admit();
    // Two permits wanted, one free: it waits in the gate's line (in the other process).
    const waiting = bGate.admit({ costs: { inflight: 2 } });
    await kept(client, id, 1);
    // One permit is free, but the line comes first: refused, alone in its script call.
    expect(await a.tryAdmit()).toBeUndefined();
    expect(await client.zcard(`${id}:line`)).toBe(1);
    await holder.release("success");
    const granted = await within(waiting, 2000, "the waiter's grant");
    expect(await a.tryAdmit()).toBeUndefined();
    await granted.release("success");
    await (await a.admit()).release("success");
  });

  it("admits waiters on a turn's releases of a stage's leases, sent as one step", async () => {
    const clock = new FakeClock(1000);
    const { client, a, bGate, id } = await twoProcesses(
      "fused-grant-turn",
      clock,
      inflightAndRate(3, 10_000),
      { pollMs: 60_000 },
    );
    const holders = [await a.admit(), await a.admit(), await a.admit()];
    // (The second lines up once its process listens for grants: its steps are kept from its first try.)
    const waiting = [bGate.admit()];
    await kept(client, id, 1);
    waiting.push(bGate.admit());
    await kept(client, id, 2, 1);
    // The first release goes alone and admits the first waiter; the other two go as one step
    // (a turn's), which frees room for the second. The fake clock stands still: no poll.
    await Promise.all(holders.map((t) => t.release("success")));
    const admitted = await within(Promise.all(waiting), 2000, "the waiters' grants");
    await Promise.all(admitted.map((t) => t.release("success")));
    expect(await client.zcard(`${id}:line`)).toBe(0);
  });

  it("grants the next waiter on the same release when a lease there has ended (a holder that died)", async () => {
    const clock = new FakeClock(1000);
    const { client, prefix, a, bGate, id } = await twoProcesses(
      "fused-grant-reap",
      clock,
      inflightAndRate(2, 10_000),
      { pollMs: 60_000 },
    );
    // A holder of another process, alive when the waiters line up, and one of this process.
    const holders = `${prefix}{inflight}:holders`;
    await client.zadd(holders, 11_000, "dead-1:1");
    await client.hset(`${prefix}{inflight}:meta`, "used", 1);
    const holder = await a.admit();
    const waiting = [bGate.admit()];
    await kept(client, id, 1);
    waiting.push(bGate.admit());
    await kept(client, id, 2, 1);
    // The other process dies: its lease ends now, and nobody renews or releases it.
    await client.zadd(holders, "XX", 999, "dead-1:1");
    // One release frees one permit for the first waiter; the ended lease is the second's, decided
    // in the same script call as its own try would be. The fake clock stands still: no poll.
    await holder.release("success");
    const admitted = await within(Promise.all(waiting), 2000, "both waiters' grants");
    expect(await client.zrange(holders, 0, -1)).not.toContain("dead-1:1");
    expect(await client.zcard(`${id}:line`)).toBe(0);
    await Promise.all(admitted.map((t) => t.release("success")));
    expect(await client.zcard(holders)).toBe(0);
    expect(await client.hget(`${prefix}{inflight}:meta`, "used")).toBe("0");
  });

  it("keeps the next waiter first when the one before took the last permit, and takes its tokens on its own grant", async () => {
    const clock = new FakeClock(1000);
    const { client, prefix, a, bGate, id } = await twoProcesses(
      "fused-grant-full",
      clock,
      inflightAndRate(1, 10_000),
      { pollMs: 60_000 },
    );
    const holder = await a.admit();
    const first = bGate.admit();
    await kept(client, id, 1);
    const second = bGate.admit();
    await kept(client, id, 2, 1);
    const bucket = `${prefix}{rate}:b:default`;
    await holder.release("success");
    const granted = await within(first, 2000, "the first waiter's grant");
    // The second stays first, its steps kept; its tokens go with its own grant, once.
    const tokens = await client.hget(bucket, "tokens");
    const [next] = await client.zrange(`${id}:line`, 0, -1);
    expect(await client.hget(`${id}:held`, `s:${next}`)).not.toBeNull();
    await granted.release("success");
    await (await within(second, 2000, "the second waiter's grant")).release("success");
    expect(Number(await client.hget(bucket, "tokens"))).toBe(Number(tokens) - 1);
  });

  it("collects a grant whose message never came with the waiter's next try", async () => {
    const clock = new FakeClock(1000);
    const { client, prefix, a, bGate, id, deaf } = await twoProcesses("fused-collect", clock, (b) => [
      b.semaphore("inflight", { limit: 1 }),
      b.tokenBucket("rate", { capacity: 10, refillPerSecond: 10 }),
    ]);
    const holder = await a.admit();
    let ticket: Ticket | undefined;
    const waiting = bGate.admit().then((t) => {
      ticket = t;
    });
    await kept(client, id, 1);
    await deaf(id);
    await holder.release("success");
    expect((await client.hkeys(`${id}:held`)).filter((f) => f.startsWith("g:"))).toHaveLength(1);
    await new Promise((resolve) => setTimeout(resolve, 50));
    expect(ticket).toBe(undefined);
    // Its poll (at most 1.5 × pollMs) collects the grant, and asks nothing else of the stages.
    await clock.advance(300);
    await within(waiting, 2000, "the collected grant");
    expect(await client.hlen(`${id}:held`)).toBe(0);
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(1);
    expect(await client.hget(`${prefix}{inflight}:meta`, "used")).toBe("1");
    await ticket!.release("success");
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(0);
  });

  it("takes back a grant its waiter gave up on before it came: permits freed, tokens and slot handed back", async () => {
    const clock = new FakeClock(1000);
    const { client, prefix, a, bGate, id, deaf } = await twoProcesses("fused-giveup", clock, (b) => [
      b.semaphore("inflight", { limit: 1 }),
      b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1 }),
      b.intervalGate("hosts", { minIntervalMs: 1, defaultHost: "api" }),
    ]);
    const holder = await a.admit();
    await clock.advance(10);
    const waiting = bGate.admit({ timeoutMs: 100 }).catch((e: unknown) => e);
    await kept(client, id, 1);
    await deaf(id);
    const bucket = (await client.keys(`${prefix}{rate}*`))[0]!;
    const host = (await client.keys(`${prefix}{hosts}*`))[0]!;
    const before = { tokens: await client.hget(bucket, "tokens"), slot: await client.hget(host, "nextAt") };
    await holder.release("success");
    // The release gave the permit, a token and the host's slot to the waiter that stopped listening.
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(1);
    expect(await client.hget(host, "nextAt")).not.toBe(before.slot);
    await clock.advance(100);
    expect(await waiting).toBeInstanceOf(AdmitTimeoutError);
    await until(async () => (await client.zcard(`${prefix}{inflight}:holders`)) === 0, {
      timeoutMs: 2000,
      message: "the grant was not given back",
    });
    expect(await client.hget(`${prefix}{inflight}:meta`, "used")).toBe("0");
    expect(await client.hlen(`${id}:held`)).toBe(0);
    // The refund puts the token back as of then; no refill has been lost or gained since.
    expect(Number(await client.hget(bucket, "tokens"))).toBeGreaterThanOrEqual(Number(before.tokens));
    expect(await client.hget(host, "nextAt")).toBe(before.slot);
    const next = await a.tryAdmit();
    expect(next).toBeDefined();
    await next!.release("success");
  });

  it("passes over a first waiter nobody listens for any more (its process died), and grants the next", async () => {
    const clock = new FakeClock(1000);
    const { client, prefix, a, bGate, id, dead } = await twoProcesses(
      "fused-grant-dead",
      clock,
      inflightAndRate(1),
      { pollMs: 200 },
    );
    const holder = await a.admit();
    let late: Ticket | undefined;
    const silent = bGate.admit().then((t) => {
      late = t;
    });
    await kept(client, id, 1);
    const next = a.admit();
    await kept(client, id, 2);
    await dead();
    await holder.release("success");
    // The release took the silent waiter out of the line and admitted the one behind it.
    const ticket = await within(next, 2000, "the caller behind the silent one");
    expect(await client.zrange(`${id}:line`, 0, -1)).toEqual([]);
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(1);
    await ticket.release("success");
    // A process that was only deaf asks again at its poll, and is served.
    await clock.advance(300);
    await within(silent, 2000, "the silent waiter's next try");
    expect(late).toBeDefined();
    await late!.release("success");
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(0);
  });

  it("keeps the place of a first waiter passed over while its process did not listen, for its next try", async () => {
    const clock = new FakeClock(1000);
    const { client, prefix, a, bGate, id, dead, hears } = await twoProcesses(
      "fused-grant-back",
      clock,
      inflightAndRate(1),
      { pollMs: 60_000 },
    );
    const holder = await a.admit();
    let back: Ticket | undefined;
    const passed = bGate.admit().then((t) => {
      back = t;
      return t;
    });
    await kept(client, id, 1);
    const [first] = await client.zrange(`${id}:line`, 0, 0);
    const second = a.admit();
    await kept(client, id, 2);
    let thirdIn: Ticket | undefined;
    const third = a.admit().then((t) => {
      thirdIn = t;
      return t;
    });
    await kept(client, id, 3, 1);
    // Its pub/sub connection drops: the release passes it over and grants the one behind it.
    await dead();
    await holder.release("success");
    const granted = await within(second, 2000, "the caller behind the one passed over");
    expect(await client.zrange(`${id}:line`, 0, -1)).not.toContain(first);
    // Listening again, it asks at its poll, and is back in its place: ahead of the third.
    await hears(id, first!.slice(0, first!.indexOf("-")));
    await clock.advance(300);
    await until(async () => (await client.zrange(`${id}:line`, 0, 0))[0] === first, {
      timeoutMs: 2000,
      message: "the waiter passed over did not get its place back",
    });
    await kept(client, id, 2, 1);
    await granted.release("success");
    const ticket = await within(passed, 2000, "the waiter back in its place");
    expect(thirdIn).toBeUndefined();
    await ticket.release("success");
    await (await within(third, 2000, "the third")).release("success");
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(0);
    expect(back).toBeDefined();
    // Nothing of its kept place is left.
    expect((await client.hkeys(`${id}:held`)).filter((f) => f.startsWith("p:"))).toEqual([]);
  });

  it("tells the first waiter to ask again when a rate refuses it at the release, holding no permit meanwhile", async () => {
    const clock = new FakeClock(1000);
    const { client, prefix, a, bGate, id } = await twoProcesses("fused-grant-rate", clock, (b) => [
      b.semaphore("inflight", { limit: 1 }),
      b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 }),
    ]);
    const holder = await a.admit();
    let ticket: Ticket | undefined;
    const waiting = bGate.admit().then((t) => {
      ticket = t;
    });
    await kept(client, id, 1);
    await holder.release("success");
    // The bucket was empty at the release: the waiter is told, and waits for its token holding nothing.
    await until(async () => (await client.hlen(`${id}:held`)) === 0, {
      timeoutMs: 2000,
      message: "the waiter did not ask again",
    });
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(0);
    for (let ms = 0; ms < 900; ms += 100) {
      await clock.advance(100);
      expect(ticket).toBe(undefined);
      expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(0);
    }
    await clock.advance(150);
    await within(waiting, 2000, "the waiter's token");
    await ticket!.release("success");
  });

  it("tells a waiter of its own process to ask again in the release's reply alone, so it asks once", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-tell-own");
    const { client, b } = await backend(prefix, clock, { pollMs: 60_000 });
    const gate = new Gate(
      [b.semaphore("inflight", { limit: 1 }), b.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 })],
      { clock },
    );
    const id = `${prefix}{gate:gate|inflight|rate}`;
    const holder = await gate.admit();
    const waiting = gate.admit();
    await kept(client, id, 1);
    const seen = await countScripts(prefix);
    try {
      await holder.release("success");
      // The bucket was empty at the release: the waiter is told, asks, and keeps its place for its
      // token (its steps kept again, from its third try).
      await kept(client, id, 1, 3);
      await clock.flush();
      await seen.shown();
      // The release, and the waiter's one try: it was not told again on pub/sub.
      expect(seen.wakes).toBe(0);
      expect(seen.calls).toBe(2);
    } finally {
      seen.stop();
    }
    await clock.advance(1000);
    await (await within(waiting, 2000, "the waiter's token")).release("success");
  });

  it("holds the cap with a crowd in two processes", async () => {
    const prefix = randomPrefix("fused-crowd");
    const fleet = [];
    for (let i = 0; i < 2; i++) {
      const b = redis(await connect(), { prefix, pollMs: 200 });
      fleet.push(
        new Gate([
          b.tokenBucket("rate", { capacity: 1000, refillPerSecond: 1000 }),
          b.semaphore("inflight", { limit: 4 }),
          b.aimd("adaptive", { initial: 6, max: 6 }),
        ]),
      );
    }
    let inFlight = 0;
    let peak = 0;
    const call = async () => {
      peak = Math.max(peak, ++inFlight);
      await new Promise((resolve) => setTimeout(resolve, 2));
      inFlight--;
    };
    const calls = fleet.flatMap((gate) => Array.from({ length: 40 }, () => gate.run(call)));
    await within(Promise.all(calls), 20_000, "the crowd");
    expect(peak).toBeLessThanOrEqual(4);
    expect(peak).toBe(4);
    for (const gate of fleet) expect(gate.snapshot().inFlight).toBe(0);
  });

  it("sends the tries and the releases of one turn together, TURN_CHUNK to a script call", async () => {
    const prefix = randomPrefix("fused-turn");
    const b = redis(await connect(), { prefix });
    const gate = new Gate([
      b.tokenBucket("rate", { capacity: 1000, refillPerSecond: 1000 }),
      b.semaphore("inflight", { limit: 1000 }),
    ]);
    await (await gate.admit()).release("success");
    const counter = await countScripts(prefix);
    try {
      // 64 callers at once: together at the end of the turn, in script calls of TURN_CHUNK (32:
      // two of them); their releases the same way.
      const perTurn = Math.ceil(64 / TURN_CHUNK);
      const tickets = await Promise.all(Array.from({ length: 64 }, () => gate.admit()));
      await counter.shown();
      expect(counter.calls).toBe(perTurn);
      await Promise.all(tickets.map((t) => t.release("success")));
      await counter.shown();
      expect(counter.calls).toBe(2 * perTurn);
    } finally {
      counter.stop();
    }
  });

  it("releases a turn's leases of each permit stage as one step, leaving what releasing them one by one leaves", async () => {
    const clock = new FakeClock(1000);
    const released = async (prefix: string, together: boolean) => {
      const { client, b } = await backend(prefix, clock);
      const gate = new Gate(
        [b.semaphore("inflight", { limit: 100 }), b.aimd("adaptive", { initial: 10, max: 100 })],
        { clock },
      );
      const tickets: Ticket[] = [];
      for (let i = 0; i < 8; i++) tickets.push(await gate.admit());
      // Two successes and a drop, in turn: the AIMD limiter's limit moves as each one says.
      const outcomes = tickets.map((_, i): Outcome => (i % 3 === 2 ? "dropped" : "success"));
      if (together) await Promise.all(tickets.map((t, i) => t.release(outcomes[i])));
      else for (let i = 0; i < tickets.length; i++) await tickets[i]!.release(outcomes[i]);
      const state = await Promise.all([
        client.hmget(`${prefix}{inflight}:meta`, "used"),
        client.hmget(`${prefix}{adaptive}:meta`, "used", "limit"),
        client.zcard(`${prefix}{inflight}:holders`),
        client.zcard(`${prefix}{adaptive}:holders`),
      ]);
      return { state };
    };
    const prefix = randomPrefix("fused-releases");
    const monitor = await connect();
    const feed = await monitor.monitor();
    const each: string[][] = [];
    feed.on("monitor", (_time: string, args: string[]) => {
      if (
        args[0]?.toLowerCase() === "evalsha" &&
        args.includes("each") &&
        args.some((a) => a.startsWith(prefix))
      )
        each.push(JSON.parse(args[args.length - 1]!) as string[]);
    });
    try {
      const turn = await released(prefix, true);
      const oneByOne = await released(randomPrefix("fused-releases-alone"), false);
      // The same state as releasing them one by one: nothing held, the same limit.
      expect(turn.state).toEqual(oneByOne.state);
      expect(turn.state.slice(2)).toEqual([0, 0]);
      expect(Number(turn.state[0]![0])).toBe(0);
      // The eight releases go together, as one step per stage.
      await until(() => each.length >= 1, { timeoutMs: 2000, message: "MONITOR did not show the releases" });
      const [all] = each;
      expect(all![4]).toBe("2");
      expect(all!.filter((f) => f === "aimd-release" || f === "semaphore-release")).toHaveLength(2);
      expect(all!.filter((f) => f === "~")).toHaveLength(0);
      expect(all!.filter((f) => /^[0-9a-f]+-\d+$/.test(f))).toHaveLength(16);
    } finally {
      feed.disconnect();
    }
  });

  it("tells each lease of a turn's releases whether it was still held, and each stage its count once they are all back", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-releases-lost");
    const { logger, entries } = recorder(false);
    const { client, b } = await backend(prefix, clock);
    const sem = b.semaphore("inflight", { limit: 100, logger });
    const aimd = b.aimd("adaptive", { initial: 10, max: 100, logger });
    const gate = new Gate([sem, aimd], { clock });
    const tickets: Ticket[] = [];
    for (let i = 0; i < 4; i++) tickets.push(await gate.admit());
    // The third call's leases are gone (they ran out and a try reaped them: counted no more).
    for (const name of ["inflight", "adaptive"]) {
      const members = await client.zrange(`${prefix}{${name}}:holders`, 0, -1);
      const third = members.find((m) => m.endsWith("-3"));
      expect(third, `the third call's lease at ${name}`).toBeDefined();
      await client.zrem(`${prefix}{${name}}:holders`, third!);
      await client.hincrby(`${prefix}{${name}}:meta`, "used", -1);
    }
    // The first call was dropped: the AIMD limiter backs off (once: the others' epoch is older).
    await Promise.all(tickets.map((t, i) => t.release(i === 0 ? "dropped" : "success")));
    // That lease, at each stage, and no other, was told it had run out.
    const lost = entries.filter((w) => w.level === "warn" && w.msg === "lease had run out before release");
    expect(lost.map((w) => w.stage).sort()).toEqual(["adaptive", "inflight"]);
    for (const w of lost) expect(String(w.lease)).toMatch(/-3$/);
    // Each stage's count as Redis has it once all are back: nothing held; the AIMD limiter's
    // limit backed off, here as there.
    const [used, limit] = await client.hmget(`${prefix}{adaptive}:meta`, "used", "limit");
    expect(Number(used)).toBe(0);
    expect(Number(await client.hget(`${prefix}{inflight}:meta`, "used"))).toBe(0);
    expect(Number(limit)).toBeLessThan(10);
    expect(aimd.snapshot().limit).toBe(Number(limit));
    expect(sem.snapshot().inFlight).toBe(0);
    expect(aimd.snapshot().inFlight).toBe(0);
    await b.close();
  });

  // A turn's releases of a stage's leases answer in short: one flag a lease. A reply whose flags
  // do not match the leases it answers for is told to none of them as theirs: each stage says its
  // releases failed (they ran in Redis: nothing is left held there), and the callers' releases
  // end as a failed release does, with the warning.
  it("tells no lease a turn's reply in short that lacks a flag for one of them, and warns", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-releases-short");
    const { logger, entries } = recorder(false);
    const { client, b } = await backend(prefix, clock);
    const sem = b.semaphore("inflight", { limit: 100, logger });
    const aimd = b.aimd("adaptive", { initial: 10, max: 100, logger });
    const gate = new Gate([sem, aimd], { clock });
    const tickets = [await gate.admit(), await gate.admit()];
    // The client's next gate call (the two releases, one step a stage) answers one flag short.
    const command = commandName("gate");
    const commands = client as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
    const original = commands[command]!.bind(client);
    let cut = 0;
    commands[command] = async (...args: unknown[]) => {
      commands[command] = original;
      const reply = (await original(...args)) as unknown[][];
      for (const step of reply[0]![4] as unknown[][]) {
        if (step[0] === "n") {
          step[1] = String(step[1]).slice(1);
          cut++;
        }
      }
      return reply;
    };
    await Promise.all(tickets.map((t) => t.release("success")));
    expect(cut, "releases answered in short").toBe(2);
    const failed = entries.filter((w) => w.level === "warn" && String(w.msg).startsWith("release failed"));
    expect(failed.map((w) => w.stage).sort()).toEqual(["adaptive", "adaptive", "inflight", "inflight"]);
    for (const w of failed) expect(String(w.err)).toMatch(/a turn's reply has 1 flags for 2 leases/);
    // No lease was told it had run out: the reply said nothing of any.
    expect(entries.some((w) => w.msg === "lease had run out before release")).toBe(false);
    for (const name of ["inflight", "adaptive"]) {
      expect(await client.zcard(`${prefix}{${name}}:holders`)).toBe(0);
      expect(Number(await client.hget(`${prefix}{${name}}:meta`, "used"))).toBe(0);
    }
    expect(sem.snapshot().inFlight).toBe(0);
    expect(aimd.snapshot().inFlight).toBe(0);
    await b.close();
  });

  it("runs a stage's step and a ticket's release as their own script calls outside a gate's call", async () => {
    // (tryStep and releaseStep are how a fused gate drives its stages; outside its script call
    // they fall back to the stage's own scripts, answering the same way.)
    const prefix = randomPrefix("fused-outside");
    const client = await connect();
    const b = redis(client, { prefix });
    const sem = b.semaphore("inflight", { limit: 1 }) as unknown as {
      tryStep(o: object | undefined, done: (t: Ticket | undefined, e?: unknown) => void): void;
    };
    const step = () =>
      new Promise<[Ticket | undefined, unknown]>((resolve) =>
        sem.tryStep(undefined, (t, e) => resolve([t, e])),
      );
    const [ticket, error] = await step();
    expect(error).toBeUndefined();
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(1);
    // Full: refused, not failed.
    expect(await step()).toEqual([undefined, undefined]);
    const released = await new Promise<unknown>((resolve) =>
      (ticket as unknown as { releaseStep(o: string, done: (e?: unknown) => void): void }).releaseStep(
        "success",
        resolve,
      ),
    );
    expect(released).toBeUndefined();
    expect(await client.zcard(`${prefix}{inflight}:holders`)).toBe(0);
    expect(await client.hget(`${prefix}{inflight}:meta`, "used")).toBe("0");
    const [bad, why] = await new Promise<[Ticket | undefined, unknown]>((resolve) =>
      sem.tryStep({ cost: -1 }, (t, e) => resolve([t, e])),
    );
    expect(bad).toBeUndefined();
    expect(why).toBeInstanceOf(InvalidOptionsError);
  });

  it("settles every stage of the gate in one script call", async () => {
    const clock = new FakeClock(1000);
    const prefix = randomPrefix("fused-settle");
    const { client, b } = await backend(prefix, clock);
    const gate = new Gate(llm(b), { clock });
    const warm = await gate.admit({ costs: { tpm: 10 } });
    await warm.settle({ tpm: 5 });
    await warm.release("success");
    const counter = await countScripts(prefix);
    try {
      const ticket = await gate.admit({ costs: { tpm: 1000 } });
      const tokens = Number(await client.hget(`${prefix}{tpm}:b:default`, "tokens"));
      const before = counter.calls;
      await ticket.settle({ tpm: 400 });
      await counter.shown();
      expect(counter.calls - before).toBe(1);
      expect(Number(await client.hget(`${prefix}{tpm}:b:default`, "tokens"))).toBeCloseTo(tokens + 600, 6);
      await ticket.release("success");
    } finally {
      counter.stop();
    }
  });
});

/**
 * Step for step: a fused decision equals the decisions of the stages taken in order at that
 * instant, with everything taken rolled back on the first refusal; over random sequences of
 * tries, releases, refunds and settles at random times, the two sets of stages agree on every
 * decision and end in the same state.
 */
describe("a fused Redis gate, step for step against its stages in turn", () => {
  const { connect } = useClients(redisUrl);

  /** Tight: most bursts are cut short. Loose: most admit whole (a host may start twice at once). */
  const SIZES = {
    tight: { rpm: [6, 5], interval: 80, permits: 3 },
    loose: { rpm: [20, 10], interval: 0, permits: 8 },
  } as const;

  function stages(b: ReturnType<typeof redis>, size: keyof typeof SIZES = "tight"): Stage[] {
    const z = SIZES[size];
    return [
      b.tokenBucket("rpm", { capacity: z.rpm[0], refillPerSecond: z.rpm[1] }),
      b.intervalGate("hosts", { minIntervalMs: z.interval }),
      b.semaphore("inflight", { limit: z.permits }),
      b.aimd("adaptive", { initial: z.permits, max: z.permits + 1, backoffRatio: 0.5 }),
      b.tokenBucket("tpm", { keyed: true, capacity: 50, refillPerSecond: 40 }),
    ];
  }

  /**
   * The stages in turn, at one instant: each tried, and on the first refusal everything rolled
   * back: the tickets refunded, and the buckets' and the host's keys put back as they were (a
   * refund of tokens leaves the key's latest grant moved, which a rollback must not).
   */
  async function inTurn(
    client: Redis,
    prefix: string,
    list: Stage[],
    costs: Record<string, number>,
    key: string,
    host: string,
  ) {
    const keys = [`${prefix}{rpm}:b:default`, `${prefix}{tpm}:b:${key}`, `${prefix}{hosts}:h:${host}`];
    const saved = await Promise.all(
      keys.map(async (k) => [await client.dumpBuffer(k), await client.pttl(k)] as const),
    );
    const held: Ticket[] = [];
    for (const stage of list) {
      const t = await stage.tryAdmit({
        cost: costs[stage.name] ?? 1,
        key: stage.keyedBy === "key" ? key : undefined,
        host,
      });
      if (!t) {
        for (const h of held.reverse()) await h.refund();
        for (let i = 0; i < keys.length; i++) {
          const [dump, pttl] = saved[i]!;
          if (dump) await client.restore(keys[i]!, Math.max(0, pttl), dump, "REPLACE");
          else await client.del(keys[i]!);
        }
        return undefined;
      }
      held.push(t);
    }
    return held;
  }

  // Bursts: up to four tries (or releases) at one instant, which the gate decides together in one
  // call (the first alone, the rest as one turn), each as if it had come alone, in order.
  // (A clock that reads below zero: a host with no slot starts at once, one whose slot is 0 not.)
  for (const [seed, burst, size, from] of [
    [1, 1, "tight", 10_000],
    [2, 1, "tight", 10_000],
    [3, 1, "tight", 10_000],
    [4, 1, "tight", -5_000],
    [5, 4, "tight", 10_000],
    [6, 4, "tight", -5_000],
    [7, 4, "loose", 10_000],
    [8, 4, "loose", 10_000],
    [9, 4, "loose", -5_000],
  ] as const) {
    const named = `seed ${seed}${burst > 1 ? `, bursts of up to ${burst}, ${size} limits` : ""}${from < 0 ? ", from below zero" : ""}`;
    it(`agrees over a random sequence (${named})`, async () => {
      const clock = new FakeClock(from);
      const rnd = seeded(seed);
      const fusedPrefix = randomPrefix("step-fused");
      const fusedB = redis(await connect(), { prefix: fusedPrefix, clock, time: "clock" });
      const turnClient = await connect();
      const turnPrefix = randomPrefix("step-turn");
      const turnB = redis(turnClient, { prefix: turnPrefix, clock, time: "clock" });
      const rates: Record<string, readonly [number, number]> = { rpm: SIZES[size].rpm, tpm: [50, 40] };
      /** The tokens a bucket key holds at `now` (capacity when it has no state). */
      const level = async (prefix: string, key: string, now: number) => {
        const [tokens, updatedAt] = await turnClient.hmget(key, "tokens", "updatedAt");
        const [capacity, rate] = rates[key.slice(prefix.length + 1).split("}")[0]!]!;
        if (tokens === null) return capacity;
        return Math.min(capacity, Number(tokens) + (Math.max(0, now - Number(updatedAt)) * rate) / 1000);
      };
      const gate = new Gate(stages(fusedB, size), { clock });
      expect(gate.fused).toBe(true);
      const list = stages(turnB, size);
      const open: [Ticket, Ticket[]][] = [];
      let admitted = 0;
      let refused = 0;
      for (let step = 0; step < 120; step++) {
        const r = rnd();
        const many = 1 + Math.floor(rnd() * burst);
        if (r < 0.45) {
          const tries = Array.from({ length: many }, () => ({
            costs: { rpm: 1 + Math.floor(rnd() * 2), tpm: Math.floor(rnd() * 30) },
            key: rnd() < 0.5 ? "a" : "b",
            host: rnd() < 0.5 ? "x" : "y",
          }));
          const fusedAll = await Promise.all(tries.map((t) => gate.tryAdmit(t)));
          for (let i = 0; i < tries.length; i++) {
            const { costs, key, host } = tries[i]!;
            const fused = fusedAll[i];
            const turn = await inTurn(turnClient, turnPrefix, list, costs, key, host);
            expect(fused !== undefined, `step ${step}, try ${i}`).toBe(turn !== undefined);
            if (fused && turn) {
              open.push([fused, turn]);
              admitted++;
            } else refused++;
          }
        } else if (r < 0.75 && open.length > 0) {
          const gives = open.splice(0, Math.min(many, open.length)).map(([fused, turn]) => {
            const how = rnd();
            return { fused, turn, how, actual: Math.floor(rnd() * 40) };
          });
          const outcomeOf = (how: number) => (how < 0.3 ? "dropped" : "success");
          // Settles first (each alone), then the releases and refunds at once.
          for (const { fused, turn, how, actual } of gives) {
            if (how <= 0.8) continue;
            await fused.settle({ tpm: actual });
            for (const t of turn) await t.settle({ tpm: actual });
          }
          await Promise.all(
            gives.map(({ fused, how }) => (how < 0.15 ? fused.refund() : fused.release(outcomeOf(how)))),
          );
          for (const { turn, how } of gives) {
            if (how < 0.15) for (const t of [...turn].reverse()) await t.refund();
            else for (const t of [...turn].reverse()) await t.release(outcomeOf(how));
          }
        } else {
          await clock.advance(Math.floor(rnd() * 300));
        }
        if (step % 10 === 9) {
          for (const bucket of ["rpm:b:default", "tpm:b:a", "tpm:b:b"]) {
            const [name, , key] = bucket.split(":");
            const at = (prefix: string) => level(prefix, `${prefix}{${name}}:b:${key}`, clock.now());
            expect(await at(fusedPrefix), `${bucket} at step ${step}`).toBeCloseTo(await at(turnPrefix), 6);
          }
          // The permits held in Redis, lease for lease.
          for (const name of ["inflight", "adaptive"]) {
            const held = (prefix: string) => turnClient.zcard(`${prefix}{${name}}:holders`);
            expect(await held(fusedPrefix), `${name} at step ${step}`).toBe(await held(turnPrefix));
          }
        }
      }
      expect(admitted).toBeGreaterThan(10);
      expect(refused).toBeGreaterThan(5);
      const [, , sem, aimd] = gate.stages;
      expect(sem!.snapshot().inFlight).toBe(list[2]!.snapshot().inFlight);
      expect(aimd!.snapshot().limit).toBe(list[3]!.snapshot().limit);
      for (const [fused, turn] of open) {
        await fused.release("success");
        for (const t of turn) await t.release("success");
      }
    });
  }
});
