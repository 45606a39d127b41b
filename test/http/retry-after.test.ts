import { parseRetryAfter } from "floodgate/fetch";
import { describe, expect, it } from "vitest";

/** A whole-second wall-clock time, so HTTP dates (one-second resolution) land exactly. */
const NOW = Date.UTC(2026, 2, 1, 12, 0, 0);
const at = (offsetMs: number) => new Date(NOW + offsetMs).toUTCString();

describe("parseRetryAfter", () => {
  const table: Array<[string, Record<string, string | string[] | undefined>, number | undefined]> = [
    ["no header", {}, undefined],
    ["delta-seconds", { "retry-after": "120" }, 120_000],
    ["zero seconds", { "retry-after": "0" }, 0],
    ["seconds with spaces around", { "retry-after": "  7 " }, 7_000],
    ["fractional seconds, rounded up to a millisecond", { "retry-after": "1.5" }, 1_500],
    ["an HTTP date (IMF-fixdate)", { "retry-after": at(30_000) }, 30_000],
    ["an HTTP date in the RFC 850 form", { "retry-after": "Sunday, 01-Mar-26 12:00:45 GMT" }, 45_000],
    ["an HTTP date in the asctime form", { "retry-after": "Sun Mar  1 12:01:00 2026" }, 60_000],
    ["a date already passed", { "retry-after": at(-60_000) }, 0],
    ["retry-after-ms", { "retry-after-ms": "1500" }, 1_500],
    ["fractional retry-after-ms, rounded up", { "retry-after-ms": "21.2" }, 22],
    ["retry-after-ms before retry-after", { "retry-after-ms": "250", "retry-after": "10" }, 250],
    [
      "a malformed retry-after-ms falls back to retry-after",
      { "retry-after-ms": "soon", "retry-after": "3" },
      3_000,
    ],
    ["a malformed value", { "retry-after": "soon" }, undefined],
    ["an empty value", { "retry-after": "" }, undefined],
    ["negative seconds", { "retry-after": "-5" }, undefined],
    ["negative retry-after-ms", { "retry-after-ms": "-100" }, undefined],
    ["an exponent", { "retry-after": "1e3" }, undefined],
    ["hexadecimal", { "retry-after": "0x10" }, undefined],
    ["a date with an impossible day", { "retry-after": "Mon, 30 Feb 2026 12:00:00 GMT" }, undefined],
    ["a date with an impossible hour", { "retry-after": "Sun, 01 Mar 2026 25:00:00 GMT" }, undefined],
    ["a date without a zone", { "retry-after": "Sun, 01 Mar 2026 12:00:10" }, undefined],
    ["a repeated header (undici's array)", { "retry-after": ["soon", "4"] }, 4_000],
    ["a header name in another case", { "Retry-After": "9" }, 9_000],
  ];

  it.each(table)("reads %s", (_name, headers, expected) => {
    expect(parseRetryAfter(headers, NOW)).toBe(expected);
  });

  it("reads a fetch Headers object", () => {
    expect(parseRetryAfter(new Headers({ "Retry-After": "2" }), NOW)).toBe(2_000);
    expect(parseRetryAfter(new Headers({ "Retry-After": at(5_000) }), NOW)).toBe(5_000);
    expect(parseRetryAfter(new Headers({ "retry-after-ms": "40" }), NOW)).toBe(40);
    expect(parseRetryAfter(new Headers(), NOW)).toBeUndefined();
  });

  it("reads a repeated header that Headers joined with a comma", () => {
    const seconds = new Headers([
      ["retry-after", "5"],
      ["retry-after", "6"],
    ]);
    expect(parseRetryAfter(seconds, NOW)).toBe(5_000);
    const dates = new Headers([
      ["retry-after", at(10_000)],
      ["retry-after", at(20_000)],
    ]);
    expect(parseRetryAfter(dates, NOW)).toBe(10_000);
  });

  it("reads a number value as node:http may hold one", () => {
    expect(parseRetryAfter({ "retry-after": 3 } as never, NOW)).toBe(3_000);
  });

  it("returns undefined for no headers at all", () => {
    expect(parseRetryAfter(undefined, NOW)).toBeUndefined();
    expect(parseRetryAfter(null, NOW)).toBeUndefined();
  });

  it("reads a two-digit RFC 850 year more than 50 years ahead as the past century", () => {
    expect(parseRetryAfter({ "retry-after": "Friday, 01-Mar-80 12:00:00 GMT" }, NOW)).toBe(0);
    expect(parseRetryAfter({ "retry-after": "Friday, 01-Mar-30 12:00:00 GMT" }, NOW)).toBe(
      Date.UTC(2030, 2, 1, 12) - NOW,
    );
  });

  it("uses the wall clock at call time when no time is given", () => {
    const inTwoMinutes = new Date(Date.now() + 120_000).toUTCString();
    const ms = parseRetryAfter({ "retry-after": inTwoMinutes });
    expect(ms).toBeGreaterThan(100_000);
    expect(ms).toBeLessThanOrEqual(120_000);
  });
});
