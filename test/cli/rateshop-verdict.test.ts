import { describe, expect, it } from "vitest";
import { spacingVerdict } from "../../examples/rateshop.js";

describe("rateshop's spacing verdict", () => {
  it("fails two requests the app sent closer than the host tolerates", () => {
    const v = spacingVerdict(150, [0, 200, 340], 140, 1);
    expect(v).toEqual({ sentMinMs: 140, broken: true, delivered: 0 });
  });

  it("counts, without failing, refusals of requests sent far enough apart that arrived closer", () => {
    // Sent 187 ms apart, arrived 119 ms apart: the machine delivered the first one late.
    const v = spacingVerdict(150, [1000, 1187, 1400], 119, 1);
    expect(v).toEqual({ sentMinMs: 187, broken: false, delivered: 1 });
  });

  it("counts no delivery refusals when arrivals kept the spacing", () => {
    expect(spacingVerdict(150, [0, 190, 400], 185, 0)).toEqual({
      sentMinMs: 190,
      broken: false,
      delivered: 0,
    });
  });

  it("judges a host with one request or none as holding its spacing", () => {
    expect(spacingVerdict(150, [5], Number.POSITIVE_INFINITY, 0).broken).toBe(false);
    expect(spacingVerdict(150, [], Number.POSITIVE_INFINITY, 0).broken).toBe(false);
  });
});
