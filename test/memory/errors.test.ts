import {
  AdmitTimeoutError,
  BackendUnavailableError,
  ClosedError,
  FloodgateError,
  InvalidOptionsError,
  isFloodgateError,
  LeaseLostError,
  ShedError,
} from "floodgate";
import { describe, expect, it } from "vitest";

describe("errors", () => {
  const cases = [
    [new ShedError("q", "full"), ShedError, "SHED"],
    [new AdmitTimeoutError("s", "late", { retryAfterMs: 5 }), AdmitTimeoutError, "ADMIT_TIMEOUT"],
    [new InvalidOptionsError("s", "limit", "bad"), InvalidOptionsError, "INVALID_OPTIONS"],
    [
      new BackendUnavailableError("s", "down", { cause: new Error("ECONNREFUSED") }),
      BackendUnavailableError,
      "BACKEND_UNAVAILABLE",
    ],
    [new LeaseLostError("s", "gone"), LeaseLostError, "LEASE_LOST"],
    [new ClosedError("s"), ClosedError, "CLOSED"],
  ] as const;

  it.each(cases)("%s carries a stable code and is a FloodgateError", (error, type, code) => {
    expect(error).toBeInstanceOf(type);
    expect(error).toBeInstanceOf(FloodgateError);
    expect(error).toBeInstanceOf(Error);
    expect(error.code).toBe(code);
    expect(error.name).toBe(type.name);
    expect(isFloodgateError(error)).toBe(true);
    expect(isFloodgateError(error, code)).toBe(true);
  });

  it("tells the kinds apart", () => {
    expect(new ShedError("q", "full")).not.toBeInstanceOf(AdmitTimeoutError);
    expect(isFloodgateError(new ShedError("q", "full"), "ADMIT_TIMEOUT")).toBe(false);
    expect(isFloodgateError(new Error("plain"))).toBe(false);
    expect(isFloodgateError(null)).toBe(false);
  });

  it("recognises an error made by another copy of the package", () => {
    // Another copy has other classes but brands its errors with the same global symbol.
    class OtherCopyError extends Error {}
    const foreign = new OtherCopyError("full");
    Object.defineProperty(foreign, Symbol.for("floodgate.error.code"), { value: "SHED" });
    expect(foreign).toBeInstanceOf(ShedError);
    expect(foreign).toBeInstanceOf(FloodgateError);
    expect(foreign).not.toBeInstanceOf(ClosedError);
  });

  it("keeps the cause, the stage and retryAfterMs", () => {
    const cause = new Error("ECONNREFUSED");
    const e = new BackendUnavailableError("de", "down", { cause, retryAfterMs: 250 });
    expect(e.cause).toBe(cause);
    expect(e.stage).toBe("de");
    expect(e.retryAfterMs).toBe(250);
  });
});
