import type { IntervalGateOptions, Ticket } from "floodgate";
import { redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import { describe, expect, it } from "vitest";
import { commandName } from "../../src/redis/scripts.js";
import { ownRedis, useClients } from "./clients.js";
import { randomPrefix, until, watchScripts } from "./helpers.js";

/** This file counts the script calls Redis runs: on a server of its own. */
const redisUrl = ownRedis();

/**
 * A Redis interval gate's line in one process: its waiters for a host asked for one head at a
 * time, or, when the gate spaces nothing (only a pause holds a host back), up to 32 of them in
 * one take, as memory lets every waiter whose slot has come go at once.
 */
describe("a Redis interval gate's line for a host", () => {
  const { clients, connect } = useClients(redisUrl);

  async function gate(options: IntervalGateOptions) {
    const clock = new FakeClock();
    const prefix = randomPrefix("interval-line");
    const client = await connect();
    const hosts = redis(client, { prefix, clock, time: "clock" }).intervalGate("hosts", options);
    return { clock, hosts, client, admin: clients[0]!, key: `${prefix}{hosts}:h:` };
  }

  /** The script calls on keys under `key`, and the takes they asked for (one a spacing after `now`). */
  async function countScripts(key: string) {
    const watch = await watchScripts(await connect(), key);
    return {
      ...watch,
      get calls() {
        return watch.seen.length;
      },
      get takes() {
        return watch.seen.reduce((n, args) => n + args.length - 5, 0);
      },
    };
  }

  it("lets every waiter of a gate that spaces nothing go when a pause ends, in order, in one take", async () => {
    const { clock, hosts, admin, key } = await gate({ minIntervalMs: 0 });
    await hosts.pause("api.example", 1000);
    const counter = await countScripts(key);
    const order: number[] = [];
    const waits: Promise<Ticket>[] = [];
    for (let i = 0; i < 20; i++) {
      waits.push(
        hosts.admit({ host: "api.example" }).then((t) => {
          order.push(i);
          return t;
        }),
      );
    }
    // Told to wait for the pause: the first asked alone; the others, behind it, wait with it.
    await until(() => hosts.snapshot().waiting === 20 && counter.calls >= 1, {
      timeoutMs: 5000,
      message: "the waiters did not all ask",
    });
    await clock.flush();
    expect(order).toEqual([]);
    await clock.advance(1000);
    const tickets = await Promise.all(waits);
    expect(order).toEqual(Array.from({ length: 20 }, (_, i) => i));
    await counter.shown(admin, 2);
    counter.stop();
    // The first waiter's take (refused), then one for all 20 at the pause's end, where a take went
    // for each waiter in turn.
    expect(counter.calls).toBe(2);
    expect(counter.takes).toBe(1 + 20);
    for (const t of tickets) await t.release("success");
  });

  it("lets a crowd through a gate that spaces nothing at once, in takes of up to 32", async () => {
    const { hosts, admin, key } = await gate({ minIntervalMs: 0, jitterMs: 0 });
    const counter = await countScripts(key);
    const tickets = await Promise.all(Array.from({ length: 70 }, () => hosts.admit({ host: "api.example" })));
    expect(tickets).toHaveLength(70);
    await counter.shown(admin, 4);
    counter.stop();
    // The first alone (nobody behind it yet), then 69 in takes of 32, 32 and 5.
    expect(counter.calls).toBe(4);
    expect(counter.takes).toBe(70);
    for (const t of tickets) await t.release("success");
  });

  it("asks for one head at a time when the gate spaces its calls, each at its slot and not before", async () => {
    const { clock, hosts, admin, key } = await gate({ minIntervalMs: 100 });
    const counter = await countScripts(key);
    const at: number[] = [];
    const waits = Array.from({ length: 5 }, () =>
      hosts.admit({ host: "api.example" }).then((t) => {
        at.push(clock.now());
        return t;
      }),
    );
    await clock.advance(400);
    await Promise.all(waits);
    expect(at).toEqual([0, 100, 200, 300, 400]);
    await counter.shown(admin, 5);
    counter.stop();
    // One take a call, each when its slot came: a grant says how far off the next slot is, so the
    // line sleeps until then instead of asking at once and being told to wait.
    expect(counter.takes).toBe(counter.calls);
    expect(counter.calls).toBe(5);
  });

  it("spaces the calls of two processes' lines for one host, each line sleeping until its slot", async () => {
    const clock = new FakeClock();
    const prefix = randomPrefix("interval-line-two");
    const [a, b] = await Promise.all([connect(), connect()]);
    const options = { prefix, clock, time: "clock" } as const;
    const gates = [a, b].map((client) =>
      redis(client, options).intervalGate("hosts", { minIntervalMs: 100 }),
    );
    const starts: number[] = [];
    const waits: Promise<void>[] = [];
    for (let i = 0; i < 6; i++) {
      waits.push(
        gates[i % 2]!.admit({ host: "api.example" }).then((t) => {
          starts.push(clock.now());
          return t.release("success");
        }),
      );
      await clock.flush();
    }
    await clock.advance(500);
    await Promise.all(waits);
    expect(starts).toEqual([0, 100, 200, 300, 400, 500]);
  });

  it("lets the rest of one take go when a waiter leaves while it is out, and the host is free after", async () => {
    const { clock, hosts, client } = await gate({ minIntervalMs: 0 });
    await hosts.pause("api.example", 1000);
    const controller = new AbortController();
    const first = hosts.admit({ host: "api.example" });
    const leaving = hosts.admit({ host: "api.example", signal: controller.signal }).catch((e: unknown) => e);
    const last = hosts.admit({ host: "api.example" });
    await until(() => hosts.snapshot().waiting === 3, {
      timeoutMs: 5000,
      message: "the waiters did not ask",
    });
    await clock.flush();
    // The second leaves as the take for all three goes out, when the pause ends.
    const commands = client as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
    const command = commandName("interval-gate-take");
    const take = commands[command]!.bind(client);
    let sent = 0;
    commands[command] = (...args: unknown[]) => {
      sent++;
      const out = take(...args);
      queueMicrotask(() => controller.abort(new Error("gone")));
      return out;
    };
    await clock.advance(1000);
    expect(sent).toBe(1);
    expect(await leaving).toEqual(new Error("gone"));
    const [a, b] = await Promise.all([first, last]);
    await a.release("success");
    await b.release("success");
    // Nothing is held back: the next goes at once.
    expect(await hosts.tryAdmit({ host: "api.example" })).toBeDefined();
    commands[command] = take;
  });
});
