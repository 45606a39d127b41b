import { type Gate, LeaseLostError, type Ticket } from "floodgate";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { type Job, pollWorker, type Report } from "../../examples/delaware-worker.js";
import { TestServer } from "../http/server.js";

let server: TestServer;

beforeEach(async () => {
  server = await new TestServer().start();
});

afterEach(async () => {
  await server.close();
});

/** A job source of `jobs`, keeping what the worker reports. */
function source(jobs: Job[]) {
  const reports: Report[] = [];
  return {
    reports,
    next: async () => jobs.shift(),
    report: (r: Report) => reports.push(r),
  };
}

/** A gate whose every ticket's permit has run out: its signal aborted with `LeaseLostError`. */
function lostPermits(): Gate {
  return {
    run: async (fn: (ticket: Ticket) => unknown) => {
      const controller = new AbortController();
      controller.abort(
        new LeaseLostError("de-inflight", 'semaphore "de-inflight": lease l1 ran out before release'),
      );
      return fn({ signal: controller.signal } as Ticket);
    },
  } as unknown as Gate;
}

describe("the delaware example's worker", () => {
  it("defers a poll whose permit ran out under way, sending nothing, rather than failing it", async () => {
    const jobs = source([{ id: "DE-1", cls: "sweep" }]);
    await pollWorker(lostPermits(), jobs, {
      worker: 0,
      providerUrl: server.url,
      acquireTimeoutMs: 60,
      backoffMs: 1,
      stop: new AbortController().signal,
    });
    expect(jobs.reports).toEqual([
      { type: "deferred", id: "DE-1", cls: "sweep", worker: 0, reason: "lease" },
    ]);
    // The request was never sent: the aborted signal stopped it.
    expect(server.received).toHaveLength(0);
  });
});
