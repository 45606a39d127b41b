import { InvalidOptionsError, memory } from "floodgate";
import { instrument } from "floodgate/otel";
import { describe, expect, it } from "vitest";
import { TestMetrics } from "./reader.js";

/**
 * What a new user might hand `instrument`, and the field the error must name. Each row throws
 * `InvalidOptionsError` naming the field, with the value received, and instruments nothing.
 */
const sem = memory().semaphore("sem", { limit: 1 });
const provider = new TestMetrics().provider;
const throwing = new Proxy(
  {},
  {
    get() {
      throw new Error("trap");
    },
  },
);

const ROWS: [string, () => unknown, string, RegExp][] = [
  [
    "no targets",
    () => instrument(undefined as never),
    "targets",
    /targets must be a gate or a stage, got undefined/,
  ],
  ["null", () => instrument(null as never), "targets", /got null/],
  ["a string", () => instrument("sem" as never), "targets", /got "sem" \(string\)/],
  ["an empty list", () => instrument([]), "targets", /at least one gate or stage/],
  [
    "a list with a non-stage",
    () => instrument([sem, {} as never]),
    "targets.1",
    /targets\.1 must be a gate or a stage, got \{\}/,
  ],
  ["a Proxy whose traps throw", () => instrument(throwing as never), "targets", /must be a gate or a stage/],
  [
    "a stage whose snapshot throws",
    () =>
      instrument({
        snapshot() {
          throw new Error("broken");
        },
      } as never),
    "targets",
    /targets\.snapshot\(\) threw \(broken\)/,
  ],
  ["options null", () => instrument(sem, null as never), "options", /options must be an object, got null/],
  ["an unknown option", () => instrument(sem, { metre: {} } as never), "metre", /unknown option "metre"/],
  [
    "a meter that is no meter",
    () => instrument(sem, { meter: {} as never }),
    "meter",
    /meter must be an OpenTelemetry Meter, got \{\}/,
  ],
  ["a meter of the wrong type", () => instrument(sem, { meter: 42 as never }), "meter", /got 42 \(number\)/],
  [
    "a meterProvider that is no provider",
    () => instrument(sem, { meterProvider: "global" as never }),
    "meterProvider",
    /meterProvider must be an OpenTelemetry MeterProvider, got "global" \(string\)/,
  ],
  [
    "histograms not a boolean",
    () => instrument(sem, { histograms: "no" as never }),
    "histograms",
    /histograms must be true or false, got "no" \(string\)/,
  ],
  [
    "both a meter and a meterProvider",
    () => instrument(sem, { meter: provider.getMeter("x"), meterProvider: provider }),
    "meterProvider",
    /must not be given with meter/,
  ],
  [
    "a provider whose getMeter throws",
    () =>
      instrument(sem, {
        meterProvider: {
          getMeter() {
            throw new Error("no meter");
          },
        },
      }),
    "meterProvider",
    /getMeter\(\) threw \(no meter\)/,
  ],
  [
    "a provider whose getMeter gives no meter",
    () => instrument(sem, { meterProvider: { getMeter: () => ({}) as never } }),
    "meterProvider",
    /getMeter\(\) must return an OpenTelemetry Meter, got \{\}/,
  ],
];

describe("instrument with bad input", () => {
  it.each(ROWS)("refuses %s with InvalidOptionsError", (_, call, field, message) => {
    let thrown: unknown;
    try {
      call();
    } catch (error) {
      thrown = error;
    }
    expect(thrown).toBeInstanceOf(InvalidOptionsError);
    expect((thrown as InvalidOptionsError).field).toBe(field);
    expect((thrown as Error).message).toMatch(message);
  });
});
