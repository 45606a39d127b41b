import diagnostics_channel from "node:diagnostics_channel";
import { CHANNELS } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { backends, useBackend } from "./backends.js";

/**
 * The `node:diagnostics_channel` events: each stage publishes admit, wait, grant, release,
 * shed and pause, with the stage, its kind and backend, and the call's figures. Alike on every
 * backend.
 */
describe.each(backends)("diagnostics channels on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;
  let seen: { channel: string; message: Record<string, unknown> }[];
  const subscribers: [string, (message: unknown) => void][] = [];

  beforeEach(() => {
    clock = new FakeClock(1_000);
    seen = [];
    for (const name of Object.values(CHANNELS)) {
      const fn = (message: unknown) =>
        seen.push({ channel: name, message: message as Record<string, unknown> });
      diagnostics_channel.subscribe(name, fn);
      subscribers.push([name, fn]);
    }
  });

  afterEach(() => {
    for (const [name, fn] of subscribers.splice(0)) diagnostics_channel.unsubscribe(name, fn);
  });

  /** The messages of `channel` about `stage`. */
  const of = (channel: string, stage: string) =>
    seen.filter((s) => s.channel === channel && s.message.stage === stage).map((s) => s.message);

  it("publishes admit, wait, grant and release for a semaphore, with the wait and the time held", async () => {
    const b = backend.make(clock);
    const sem = b.semaphore("sem", { limit: 1 });
    const first = await sem.admit({ cost: 1 });
    const second = sem.admit();
    await clock.flush();
    await clock.advance(40);
    await first.release("dropped");
    const t = await second;
    await clock.advance(10);
    await t.refund();
    const kind = { stage: "sem", kind: "semaphore", backend: backend.name === "memory" ? "memory" : "redis" };
    expect(of(CHANNELS.admit, "sem")).toEqual([{ ...kind, key: "", cost: 1 }]);
    expect(of(CHANNELS.wait, "sem")).toEqual([{ ...kind, key: "", cost: 1 }]);
    const [grant] = of(CHANNELS.grant, "sem");
    expect(grant).toMatchObject({ ...kind, key: "", cost: 1 });
    expect(grant!.waitedMs as number).toBeGreaterThanOrEqual(40);
    const released = of(CHANNELS.release, "sem");
    expect(released.map((m) => m.outcome)).toEqual(["dropped", "refund"]);
    expect(released[0]!.heldMs as number).toBeGreaterThanOrEqual(40);
    expect(released[1]!.heldMs as number).toBeGreaterThanOrEqual(10);
  });

  it("publishes a shed of a full queue and a pause of a host", async () => {
    const b = backend.make(clock);
    const queue = b.queue("jobs", { maxSize: 1, whenFull: "shed" });
    const held = await queue.admit();
    await expect(queue.admit({ cost: 1 })).rejects.toMatchObject({ code: "SHED" });
    expect(of(CHANNELS.shed, "jobs")).toEqual([
      { stage: "jobs", kind: "queue", backend: backend.name === "memory" ? "memory" : "redis", cost: 1 },
    ]);
    await held.release("success");
    const hosts = b.intervalGate("hosts", { minIntervalMs: 10 });
    await hosts.pause("api.example", 1_500);
    expect(of(CHANNELS.pause, "hosts")).toEqual([
      {
        stage: "hosts",
        kind: "intervalGate",
        backend: backend.name === "memory" ? "memory" : "redis",
        host: "api.example",
        ms: 1_500,
      },
    ]);
  });

  it("names the key of a keyed bucket's calls and the host of an interval gate's", async () => {
    const b = backend.make(clock);
    const bucket = b.tokenBucket("rate", { capacity: 5, refillPerSecond: 1, keyed: true });
    const hosts = b.intervalGate("hosts", { minIntervalMs: 10 });
    await (await bucket.admit({ key: "acme", cost: 2 })).release("success");
    await (await hosts.admit({ host: "api.example" })).release("success");
    expect(of(CHANNELS.admit, "rate")).toMatchObject([{ key: "acme", cost: 2 }]);
    expect(of(CHANNELS.admit, "hosts")).toMatchObject([{ key: "api.example", cost: 1 }]);
    expect(of(CHANNELS.release, "rate")).toMatchObject([{ key: "acme", outcome: "success" }]);
  });
});
