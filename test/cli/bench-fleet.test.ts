import { describe, expect, it } from "vitest";
import { fleetModes, handoffs } from "../../bench/fleet.js";

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
