import { parseRetryAfter, wrapFetch } from "floodgate/fetch";
import { FakeClock } from "floodgate/testing";
import { floodgateInterceptor } from "floodgate/undici";
import { Agent, request } from "undici";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { hostsGate, reply, TestServer } from "./server.js";

/** A Retry-After of 400 digits: well formed, far too long, and capped rather than ignored. */
const HUGE = "9".repeat(400);

let server: TestServer;
let clock: FakeClock;

beforeEach(async () => {
  server = await new TestServer().start();
  clock = new FakeClock();
});

afterEach(async () => {
  await server.close();
});

describe("a Retry-After too large to hold", () => {
  it.each([
    ["retry-after", HUGE],
    ["retry-after-ms", HUGE],
    ["retry-after", `${HUGE}.5`],
  ])("is read from %s as the longest delay, not ignored", (name, value) => {
    expect(parseRetryAfter({ [name]: value }, 0)).toBe(Number.MAX_SAFE_INTEGER);
  });

  it("pauses the host for maxPauseMs through wrapFetch", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(429, { "retry-after": HUGE });
    const res = await wrapFetch(gate, undefined, { maxPauseMs: 60_000 })(server.url);
    expect(res.status).toBe(429);
    expect(hosts.delayFor(server.host)).toBe(60_000);
  });

  it("pauses the host for maxPauseMs through the undici interceptor", async () => {
    const { gate, hosts } = hostsGate(clock);
    server.respond = reply(503, { "retry-after": HUGE });
    const agent = new Agent();
    try {
      const dispatcher = agent.compose(floodgateInterceptor(gate, { maxPauseMs: 30_000 }));
      const res = await request(server.url, { dispatcher });
      await res.body.text();
      expect(res.statusCode).toBe(503);
      await clock.flush();
      expect(hosts.delayFor(server.host)).toBe(30_000);
    } finally {
      await agent.close();
    }
  });
});
