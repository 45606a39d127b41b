/**
 * Reading `Retry-After` and `Retry-After-Ms` from a response. Pure: the wall clock comes in as a
 * number, used only to turn an HTTP date into a delay.
 */
import type { HeadersLike } from "./types.js";

const DELTA = /^\d+(?:\.\d+)?$/;
const MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"];
const MONTH = "(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)";
const TIME = "(\\d{2}):(\\d{2}):(\\d{2})";
/** `Sun, 06 Nov 1994 08:49:37 GMT` (IMF-fixdate; the weekday is not checked). */
const IMF_FIXDATE = new RegExp(`^(?:[a-z]{3},\\s*)?(\\d{1,2}) ${MONTH} (\\d{4}) ${TIME} (?:gmt|utc)$`, "i");
/** `Sunday, 06-Nov-94 08:49:37 GMT` (obsolete RFC 850 form). */
const RFC_850 = new RegExp(`^[a-z]+, (\\d{2})-${MONTH}-(\\d{2}) ${TIME} gmt$`, "i");
/** `Sun Nov  6 08:49:37 1994` (obsolete asctime form, always GMT). */
const ASCTIME = new RegExp(`^[a-z]{3} ${MONTH} +(\\d{1,2}) ${TIME} (\\d{4})$`, "i");

/**
 * The value of header `name` (lowercase) as a list of strings; empty when absent.
 * @internal
 */
export function headerValues(headers: HeadersLike, name: string): string[] {
  const getter = (headers as { get?: unknown }).get;
  if (typeof getter === "function") {
    const value = (getter as (name: string) => unknown).call(headers, name);
    return typeof value === "string" ? [value] : [];
  }
  const record = headers as Readonly<Record<string, unknown>>;
  let value = record[name];
  if (value === undefined) {
    for (const key of Object.keys(record)) {
      if (key.toLowerCase() === name) {
        value = record[key];
        break;
      }
    }
  }
  if (typeof value === "string") return [value];
  if (typeof value === "number") return [String(value)];
  if (Array.isArray(value)) return value.filter((v): v is string => typeof v === "string");
  return [];
}

/** Where year, month, day, hours, minutes and seconds stand in a match of each date form. */
const IMF_AT = [3, 2, 1, 4, 5, 6] as const;
const ASCTIME_AT = [6, 1, 2, 3, 4, 5] as const;

/** The date fields of match `m`, read at `at` (the year given, when the form needs it worked out). */
function fieldsAt(m: RegExpExecArray, at: readonly number[], year = Number(m[at[0]!])): number[] {
  return [
    year,
    MONTHS.indexOf(m[at[1]!]!.toLowerCase()),
    Number(m[at[2]!]),
    Number(m[at[3]!]),
    Number(m[at[4]!]),
    Number(m[at[5]!]),
  ];
}

/** The fields of an HTTP date in any of the three forms RFC 9110 accepts. */
function dateFields(text: string, now: number): number[] | undefined {
  let m = IMF_FIXDATE.exec(text);
  if (m) return fieldsAt(m, IMF_AT);
  m = RFC_850.exec(text);
  if (m) {
    // A two-digit year more than 50 years in the future means the past century (RFC 9110 §5.6.7).
    let year = 2000 + Number(m[3]);
    if (year > new Date(now).getUTCFullYear() + 50) year -= 100;
    return fieldsAt(m, IMF_AT, year);
  }
  m = ASCTIME.exec(text);
  if (m) return fieldsAt(m, ASCTIME_AT);
  return undefined;
}

/** Epoch milliseconds of an HTTP date, or undefined when `text` is not a valid one. */
function parseHttpDate(text: string, now: number): number | undefined {
  const f = dateFields(text, now);
  if (!f) return undefined;
  const [year, month, day, h, min, s] = f as [number, number, number, number, number, number];
  if (h > 23 || min > 59 || s > 60) return undefined;
  const at = Date.UTC(year, month, day, h, min, s);
  // Date.UTC rolls 30 Feb over into March; refuse days the month does not have.
  if (!Number.isFinite(at) || new Date(at).getUTCDate() !== day) return undefined;
  return at;
}

/** Milliseconds from one `retry-after` value: delta-seconds, or an HTTP date (0 once passed). */
function retryAfterValue(text: string, now: number): number | undefined {
  if (DELTA.test(text)) return finiteCeil(Number(text) * 1000);
  const at = parseHttpDate(text, now);
  return at === undefined ? undefined : Math.max(0, at - now);
}

/** Milliseconds from one `retry-after-ms` value: a non-negative number. */
function retryAfterMsValue(text: string): number | undefined {
  return DELTA.test(text) ? finiteCeil(Number(text)) : undefined;
}

/**
 * Longest delay a header is read as, in milliseconds: `Number.MAX_SAFE_INTEGER`. A longer one
 * (a 400-digit `Retry-After`) is a valid, very long delay, read as this; callers cap it further
 * (`maxPauseMs`).
 */
const LONGEST_MS = Number.MAX_SAFE_INTEGER;

/** A delay the header grammar accepted, rounded up, and capped rather than dropped when huge. */
function finiteCeil(ms: number): number | undefined {
  if (Number.isNaN(ms) || ms < 0) return undefined;
  return Math.min(Math.ceil(ms), LONGEST_MS);
}

/**
 * The first value of a header that `parse` accepts. A header repeated and joined with ", " (as
 * `Headers.get` joins them) is split again; an HTTP date's own comma is put back.
 */
function firstParsed(
  values: readonly string[],
  parse: (text: string) => number | undefined,
): number | undefined {
  for (const raw of values) {
    const whole = parse(raw.trim());
    if (whole !== undefined) return whole;
    const parts = raw.split(",").map((p) => p.trim());
    if (parts.length < 2) continue;
    for (let i = 0; i < parts.length; i++) {
      const single = parse(parts[i]!);
      if (single !== undefined) return single;
      if (i + 1 < parts.length) {
        const dated = parse(`${parts[i]}, ${parts[i + 1]}`);
        if (dated !== undefined) return dated;
      }
    }
  }
  return undefined;
}

/**
 * How long a response asks the client to wait, in milliseconds, or `undefined` when it does not
 * say (or says something unreadable).
 *
 * Reads, in this order:
 * - `retry-after-ms`: milliseconds, a non-negative number (`"1500"`, `"21.5"`);
 * - `retry-after` as delta-seconds: a non-negative number of seconds (`"120"`);
 * - `retry-after` as an HTTP date (IMF-fixdate `Sun, 06 Nov 1994 08:49:37 GMT`, or the obsolete
 *   RFC 850 and asctime forms), as the time from `now` to that date; a date already passed gives
 *   `0` (the server allows a retry now).
 *
 * Malformed or negative values are ignored: an unreadable `retry-after-ms` falls back to
 * `retry-after`, and with neither readable the result is `undefined`. Fractions round up to the
 * next whole millisecond. A well-formed value too large to hold (hundreds of digits) is read as
 * `Number.MAX_SAFE_INTEGER` milliseconds, which `maxPauseMs` then caps. Never throws for any
 * header content.
 *
 * @param headers a fetch `Headers` or a plain record of header values (string, string[] or undefined).
 * @param now wall-clock time in epoch milliseconds, used only for the HTTP-date form.
 *   @default `Date.now()`, read at each call
 */
export function parseRetryAfter(
  headers: HeadersLike | null | undefined,
  now: number = Date.now(),
): number | undefined {
  if (headers === null || typeof headers !== "object") return undefined;
  const ms = firstParsed(headerValues(headers, "retry-after-ms"), retryAfterMsValue);
  if (ms !== undefined) return ms;
  return firstParsed(headerValues(headers, "retry-after"), (text) => retryAfterValue(text, now));
}
