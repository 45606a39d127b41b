import { Gate, InvalidOptionsError } from "floodgate";
import { parseRateLimit, parseResetMs, type RateLimitWindow, wrapFetch } from "floodgate/fetch";
import { FakeClock } from "floodgate/testing";
import { floodgateInterceptor } from "floodgate/undici";
import { Agent, request } from "undici";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { coreBackends, track, useBackend } from "../contract/backends.js";
import { hostsGate, reply, TestServer } from "./server.js";

const NOW = Date.UTC(2026, 2, 1, 12, 0, 0);

describe("parseResetMs", () => {
  const table: Array<[string, number | undefined]> = [
    ["1s", 1_000],
    ["6m0s", 360_000],
    ["20ms", 20],
    ["1m30.5s", 90_500],
    ["2h", 7_200_000],
    ["1h2m3s", 3_723_000],
    ["0.5s", 500],
    ["7.66s", 7_660],
    ["0s", 0],
    ["1.2ms", 2],
    ["1500us", 2],
    ["1500µs", 2],
    ["10ns", 1],
    [" 3s ", 3_000],
    ["30", 30_000],
    ["0.25", 250],
    ["0", 0],
    [String(NOW / 1000 + 42), 42_000],
    [String(NOW / 1000 - 42), 0],
    [String(NOW + 1_500), 1_500],
    ["", undefined],
    ["soon", undefined],
    ["-1s", undefined],
    ["-5", undefined],
    ["1x", undefined],
    ["s", undefined],
    ["1s2", undefined],
    ["1 s", undefined],
    ["1m 30s", undefined],
    ["1e3", undefined],
    ["0x10", undefined],
    ["NaN", undefined],
    ["Infinity", undefined],
    [".5s", undefined],
    ["1.s", undefined],
    ["9".repeat(400), undefined],
    [`${"1h".repeat(40)}`, undefined],
  ];

  it.each(table)("reads %j as %s", (text, ms) => {
    expect(parseResetMs(text, NOW)).toBe(ms);
  });
});

describe("parseRateLimit", () => {
  it("reads OpenAI's requests and tokens windows", () => {
    const headers = new Headers({
      "x-ratelimit-limit-requests": "500",
      "x-ratelimit-remaining-requests": "499",
      "x-ratelimit-reset-requests": "120ms",
      "x-ratelimit-limit-tokens": "30000",
      "x-ratelimit-remaining-tokens": "29500",
      "x-ratelimit-reset-tokens": "1m0.5s",
    });
    expect(parseRateLimit(headers, NOW)).toEqual([
      { name: "requests", limit: 500, remaining: 499, resetMs: 120 },
      { name: "tokens", limit: 30_000, remaining: 29_500, resetMs: 60_500 },
    ]);
  });

  it("reads the general x-ratelimit-* headers, with a reset in epoch seconds", () => {
    const headers = {
      "x-ratelimit-limit": "60",
      "x-ratelimit-remaining": "3",
      "x-ratelimit-reset": String(NOW / 1000 + 30),
    };
    expect(parseRateLimit(headers, NOW)).toEqual([
      { name: "general", limit: 60, remaining: 3, resetMs: 30_000 },
    ]);
  });

  it("reads the ratelimit-* headers, with a limit that names its window", () => {
    const headers = {
      "ratelimit-limit": "100, 100;w=60",
      "ratelimit-remaining": "7",
      "ratelimit-reset": "12",
    };
    expect(parseRateLimit(headers, NOW)).toEqual([
      { name: "general", limit: 100, remaining: 7, resetMs: 12_000 },
    ]);
  });

  it("leaves out a window whose remaining is missing or malformed, and a limit or reset it cannot read", () => {
    const headers = {
      "x-ratelimit-remaining-requests": "many",
      "x-ratelimit-reset-requests": "1s",
      "x-ratelimit-remaining-tokens": "10",
      "x-ratelimit-limit-tokens": "-3",
      "x-ratelimit-reset-tokens": "later",
    };
    expect(parseRateLimit(headers, NOW)).toEqual([
      { name: "tokens", limit: undefined, remaining: 10, resetMs: undefined },
    ]);
  });

  it("takes the first readable value of a repeated header", () => {
    const headers = {
      "x-ratelimit-remaining-requests": ["4", "9"],
      "x-ratelimit-reset-requests": "junk, 2s",
    };
    expect(parseRateLimit(headers, NOW)).toEqual([
      { name: "requests", limit: undefined, remaining: 4, resetMs: 2_000 },
    ]);
  });

  it("reads nothing from no headers", () => {
    expect(parseRateLimit({}, NOW)).toEqual([]);
    expect(parseRateLimit(undefined, NOW)).toEqual([]);
  });
});

let server: TestServer;
let clock: FakeClock;

beforeEach(async () => {
  server = await new TestServer().start();
  clock = new FakeClock();
});

afterEach(async () => {
  await server.close();
});

const openai = (remaining: number, reset = "6m0s"): Record<string, string> => ({
  "x-ratelimit-limit-requests": "100",
  "x-ratelimit-remaining-requests": String(remaining),
  "x-ratelimit-reset-requests": reset,
});

describe("wrapFetch reserve", () => {
  it("pauses the host until the reset once the window is down to its share", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, openai(20));
    const res = await wrapFetch(gate, undefined, { reserve: { share: 0.2 } })(server.url);
    expect(res.status).toBe(200);
    expect(hosts.delayFor(server.host)).toBe(360_000);
    expect(hosts.delayFor("other.example")).toBe(0);
  });

  it("leaves the host alone while more than the share remains", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, openai(21));
    await wrapFetch(gate, undefined, { reserve: { share: 0.2 } })(server.url);
    expect(hosts.delayFor(server.host)).toBe(0);
  });

  it("leaves the host alone without the option", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, openai(0));
    await wrapFetch(gate)(server.url);
    expect(hosts.delayFor(server.host)).toBe(0);
  });

  it("keeps a share of the tokens window too, pausing for the longest reset that applies", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, {
      ...openai(90, "1s"),
      "x-ratelimit-limit-tokens": "10000",
      "x-ratelimit-remaining-tokens": "1500",
      "x-ratelimit-reset-tokens": "1m30.5s",
    });
    await wrapFetch(gate, undefined, { reserve: { share: 0.2 } })(server.url);
    expect(hosts.delayFor(server.host)).toBe(90_500);
  });

  it("keeps a share only of windows whose limit it knows", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, { "x-ratelimit-remaining": "0", "x-ratelimit-reset": "5" });
    await wrapFetch(gate, undefined, { reserve: { share: 0.5 } })(server.url);
    expect(hosts.delayFor(server.host)).toBe(0);
  });

  it("keeps a fixed count with reserve.remaining", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, { "ratelimit-remaining": "10", "ratelimit-reset": "4" });
    await wrapFetch(gate, undefined, { reserve: { remaining: 10 } })(server.url);
    expect(hosts.delayFor(server.host)).toBe(4_000);
  });

  it("asks reserve.remaining, given as a function, for each window", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, {
      ...openai(50, "2s"),
      "x-ratelimit-remaining-tokens": "3000",
      "x-ratelimit-reset-tokens": "9s",
    });
    const seen: RateLimitWindow[] = [];
    const remaining = vi.fn((w: Readonly<RateLimitWindow>) => {
      seen.push({ ...w });
      return w.name === "tokens" ? 5_000 : 10;
    });
    await wrapFetch(gate, undefined, { reserve: { remaining } })(server.url);
    expect(seen).toEqual([
      { name: "requests", limit: 100, remaining: 50, resetMs: 2_000 },
      { name: "tokens", limit: undefined, remaining: 3_000, resetMs: 9_000 },
    ]);
    expect(hosts.delayFor(server.host)).toBe(9_000);
  });

  it("keeps no reserve for a window whose function throws or returns no count", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, openai(0));
    const gatedFetch = (remaining: () => number) => wrapFetch(gate, undefined, { reserve: { remaining } });
    const res = await gatedFetch(() => {
      throw new Error("bug");
    })(server.url);
    expect(res.status).toBe(200);
    await gatedFetch(() => Number.NaN)(server.url);
    await gatedFetch(() => -1)(server.url);
    expect(hosts.delayFor(server.host)).toBe(0);
  });

  it("ignores a window down to its reserve whose reset is garbage", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, openai(0, "whenever"));
    await wrapFetch(gate, undefined, { reserve: { share: 0.2 } })(server.url);
    expect(hosts.delayFor(server.host)).toBe(0);
  });

  it("cuts the pause to maxPauseMs, and pauses nothing with maxPauseMs: 0", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, openai(0, "2h"));
    await wrapFetch(gate, undefined, { reserve: { share: 0 }, maxPauseMs: 0 })(server.url);
    expect(hosts.delayFor(server.host)).toBe(0);
    await wrapFetch(gate, undefined, { reserve: { share: 0 }, maxPauseMs: 60_000 })(server.url);
    expect(hosts.delayFor(server.host)).toBe(60_000);
  });

  it("pauses for the longer of Retry-After and the reserve's reset", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(429, { ...openai(0, "3s"), "retry-after": "1" });
    await wrapFetch(gate, undefined, { reserve: { share: 0.1 } })(server.url);
    expect(hosts.delayFor(server.host)).toBe(3_000);
  });

  it.each([
    ["reserve", { reserve: 0.2 }],
    ["reserve", { reserve: {} }],
    ["reserve", { reserve: { share: 0.2, remaining: 5 } }],
    ["reserve.share", { reserve: { share: 1.5 } }],
    ["reserve.share", { reserve: { share: "20%" } }],
    ["reserve.remaining", { reserve: { remaining: -1 } }],
    ["reserve.remaining", { reserve: { remaining: Number.POSITIVE_INFINITY } }],
    ["reserve.part", { reserve: { share: 0.1, part: 1 } }],
  ])("refuses an invalid %s with an InvalidOptionsError naming it", (field, options) => {
    const { gate } = hostsGate(clock);
    let error: unknown;
    try {
      wrapFetch(gate, undefined, options as never);
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect(error).toMatchObject({ field });
    expect((error as Error).message).toContain(field);
  });
});

describe("bulk traffic yields to interactive", () => {
  for (const backend of coreBackends) {
    describe(backend.name, () => {
      useBackend(backend);

      it("holds the next bulk call until the provider's window resets", async () => {
        const b = backend.make(clock);
        const bulk = new Gate([b.intervalGate("bulk-hosts", { minIntervalMs: 0 })], { clock });
        const gatedFetch = wrapFetch(bulk, undefined, { reserve: { share: 0.3 } });
        server.respond = reply(200, openai(25, "2s"));
        await gatedFetch(`${server.url}/import/1`);

        server.respond = reply(200, openai(99, "2s"));
        const next = track(gatedFetch(`${server.url}/import/2`));
        await clock.advance(1_999);
        expect(next.settled).toBe(false);
        expect(server.received).toHaveLength(1);

        await clock.advance(1);
        await server.receivedCount(2);
        await vi.waitFor(() => expect(next.settled).toBe(true));
        expect(next.error).toBeUndefined();
      });
    });
  }
});

describe("floodgateInterceptor reserve", () => {
  let agent: Agent;
  beforeEach(() => {
    agent = new Agent();
  });
  afterEach(async () => {
    await agent.destroy();
  });

  it("pauses the host until the reset once the window is down to the reserve", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, openai(10, "20ms"));
    const dispatcher = agent.compose(floodgateInterceptor(gate, { reserve: { share: 0.1 } }));
    const res = await request(server.url, { dispatcher });
    await res.body.dump();
    expect(hosts.delayFor(server.host)).toBe(20);
  });

  it("leaves the host alone while more than the reserve remains", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, openai(11, "20ms"));
    const dispatcher = agent.compose(floodgateInterceptor(gate, { reserve: { remaining: 10 } }));
    await (await request(server.url, { dispatcher })).body.dump();
    expect(hosts.delayFor(server.host)).toBe(0);
  });

  it("reads the reserve's headers for a handler of the older callback API", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(200, openai(0, "1m"));
    const dispatch = floodgateInterceptor(gate, { reserve: { share: 0 } })(agent.dispatch.bind(agent));
    await new Promise<void>((resolve, reject) => {
      dispatch(
        { origin: server.url, path: "/", method: "GET" },
        {
          onConnect: () => {},
          onHeaders: () => true,
          onData: () => true,
          onComplete: () => resolve(),
          onError: reject,
        },
      );
    });
    expect(hosts.delayFor(server.host)).toBe(60_000);
  });

  it("refuses an invalid reserve in the outer factory, naming it", () => {
    const { gate } = hostsGate(clock);
    expect(() => floodgateInterceptor(gate, { reserve: { share: -0.1 } })).toThrow(
      expect.objectContaining({ name: "InvalidOptionsError", field: "reserve.share" }),
    );
  });
});
