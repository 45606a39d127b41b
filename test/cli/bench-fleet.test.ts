import { describe, expect, it } from "vitest";
import { fleetModes, handoffLegs, handoffs } from "../../bench/fleet.js";
import type { RunReport } from "../../bench/fleet-worker.js";

/** A worker's report with only what the handoff legs read. */
function report(
  grants: number[],
  heard: (number | null)[],
  releases: number[],
  written: (number | null)[],
): RunReport {
  return {
    kind: "done",
    sent: 0,
    ok: 0,
    r429: 0,
    errors: 0,
    waits: [],
    cutOff: 0,
    perCaller: [],
    services: [],
    thinks: [],
    grants,
    releases,
    heard,
    written,
  };
}

describe("the fleet benchmark's handoffs", () => {
  it("pairs the k-th release with the (k + cap)-th grant, in time, whatever process each came from", () => {
    // Two permits: the first two grants need no release; each later one is let in by the
    // release before it in time. Worker order is not time order.
    const grants = [20.75, 0, 10.5, 0.25];
    const releases = [20, 10];
    expect(handoffs(grants, releases, 2)).toEqual([0.5, 0.75]);
  });

  it("leaves out releases that no grant followed (the run's end) and gaps that would be negative", () => {
    expect(handoffs([0, 1, 5], [4, 9, 12], 2)).toEqual([1]);
    expect(handoffs([0, 1, 3], [4], 2)).toEqual([]);
    expect(handoffs([], [], 8)).toEqual([]);
  });
});

describe("the fleet benchmark's handoff legs (--legs)", () => {
  it("splits each paired handoff at its release's command written and its grant heard, across processes", () => {
    // One permit. Worker A: granted at 0 (nobody released), released at 10 (written 10.25);
    // worker B: granted at 12 (heard at 11.5), released at 20 (written 20.5); worker A again:
    // granted at 21.25 (heard at 21).
    const a = report([0, 21.25], [null, 21], [10], [10.25]);
    const b = report([12], [11.5], [20], [20.5]);
    expect(handoffLegs([a, b], 1)).toEqual({
      written: [0.25, 0.5],
      heard: [0.5, 1.25],
      admitted: [0.25, 0.5],
    });
  });

  it("leaves out a leg whose times are missing, or a grant heard before the release's command went out", () => {
    // Released at 10 with no command written; the grant at 12, heard at 11: only "admitted".
    expect(handoffLegs([report([0, 12], [null, 11], [10], [null])], 1)).toEqual({
      written: [],
      heard: [],
      admitted: [1],
    });
    // Heard at 9.5, before the release at 10 (another wait's message): neither "heard" nor "admitted".
    expect(handoffLegs([report([0, 12], [null, 9.5], [10], [10.25])], 1)).toEqual({
      written: [0.25],
      heard: [],
      admitted: [],
    });
  });
});

describe("the fleet benchmark's --only", () => {
  it("runs the ceiling and the contenders named, in the table's order", () => {
    expect(fleetModes(["floodgate-gate", "floodgate"]).map((m) => m.mode)).toEqual([
      "ceiling",
      "floodgate",
      "floodgate-gate",
    ]);
    expect(fleetModes(undefined).map((m) => m.mode)).toContain("blpop");
  });

  it("refuses an id that is no contender's, naming them", () => {
    expect(() => fleetModes(["gate"])).toThrow(
      /--only names "gate", which is no contender; they are ceiling, floodgate, /,
    );
  });
});
