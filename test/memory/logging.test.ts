import { Writable } from "node:stream";
import { memory } from "floodgate";
import { FakeClock } from "floodgate/testing";
import { pino } from "pino";
import { describe, expect, it } from "vitest";

function capture(level: string) {
  const lines: Record<string, unknown>[] = [];
  const stream = new Writable({
    write(chunk, _enc, done) {
      lines.push(JSON.parse(String(chunk)));
      done();
    },
  });
  return { lines, logger: pino({ level }, stream) };
}

describe("logging", () => {
  it("logs grants at debug with the stage, kind and backend bound", async () => {
    const { lines, logger } = capture("debug");
    const clock = new FakeClock();
    const sem = memory({ clock, logger }).semaphore("inflight", { limit: 1 });
    const held = await sem.admit();
    const next = sem.admit();
    await held.release();
    await next;
    await new Promise((r) => setImmediate(r));
    const grant = lines.find((l) => l.msg === "granted");
    expect(grant).toMatchObject({ level: 20, stage: "inflight", kind: "semaphore", backend: "memory" });
  });

  it("logs sheds and timeouts at warn", async () => {
    const { lines, logger } = capture("warn");
    const clock = new FakeClock();
    const b = memory({ clock, logger });
    const q = b.queue("jobs", { maxSize: 1, whenFull: "shed" });
    await q.admit();
    await q.admit().catch(() => {});
    const sem = b.semaphore("inflight", { limit: 1 });
    await sem.admit();
    const late = sem.admit({ timeoutMs: 10 }).catch(() => {});
    await clock.advance(10);
    await late;
    await new Promise((r) => setImmediate(r));
    expect(lines.map((l) => [l.level, l.stage, l.msg])).toEqual([
      [40, "jobs", "queue full, shed"],
      [40, "inflight", "admission timed out"],
    ]);
  });

  it("writes nothing by default", async () => {
    const sem = memory().semaphore("quiet", { limit: 1 });
    await (await sem.admit()).release();
    expect(sem.snapshot().admitted).toBe(1);
  });
});
