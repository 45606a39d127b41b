// The runs wrapFetch and floodgateInterceptor share: the same calls, the same assertions, once
// through each.
import type { Gate } from "floodgate";
import { wrapFetch } from "floodgate/fetch";
import { FakeClock } from "floodgate/testing";
import { floodgateInterceptor } from "floodgate/undici";
import { Agent, type Dispatcher, request } from "undici";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { adaptiveGateOn, reply, TestServer } from "./server.js";

let server: TestServer;
let clock: FakeClock;
let agent: Agent;

beforeEach(async () => {
  server = await new TestServer().start();
  clock = new FakeClock();
  agent = new Agent();
});

afterEach(async () => {
  await agent.destroy();
  await server.close();
});

/** A gate of an interval gate (no spacing) and an AIMD limiter, on the fake clock. */
const adaptiveGate = (aimd?: { initial: number; max: number }) => adaptiveGateOn(clock, aimd);

/** A response as a test reads it: its status, and `ended`, which resolves once the call is over. */
interface Sent {
  status: number;
  /** wrapFetch releases at the response's headers; the interceptor once the body is read. */
  ended: () => Promise<unknown>;
}

type Options = { now?: () => number };

/** Builds a sender through `gate`, as each wrapper does it. */
const clients: Array<[string, (gate: Gate, options?: Options) => (url: string) => Promise<Sent>]> = [
  [
    "wrapFetch",
    (gate, options) => {
      const gatedFetch = wrapFetch(gate, undefined, options);
      return async (url) => {
        const res = await gatedFetch(url);
        return { status: res.status, ended: async () => {} };
      };
    },
  ],
  [
    "floodgateInterceptor",
    (gate, options) => {
      const dispatcher: Dispatcher = agent.compose(floodgateInterceptor(gate, options));
      return async (url) => {
        const res = await request(url, { dispatcher });
        return { status: res.statusCode, ended: () => res.body.dump() };
      };
    },
  ],
];

describe.each(clients)("%s", (_name, client) => {
  it.each([429, 503])("releases a %i response as dropped", async (status) => {
    const { gate, adaptive } = adaptiveGate();
    server.respond = reply(status);
    const res = await client(gate)(server.url);
    expect(res.status).toBe(status);
    await res.ended();
    expect(adaptive.snapshot().limit).toBe(2);
    expect(gate.snapshot().inFlight).toBe(0);
  });

  describe("Retry-After", () => {
    const wall = Date.UTC(2026, 2, 1, 12, 0, 0);
    const cases: Array<[string, Record<string, string>, number]> = [
      ["seconds", { "retry-after": "7" }, 7_000],
      ["an HTTP date", { "retry-after": new Date(wall + 30_000).toUTCString() }, 30_000],
      ["retry-after-ms", { "retry-after-ms": "1500" }, 1_500],
    ];

    it.each(cases)(
      "pauses the host for Retry-After as %s before the response is seen",
      async (_form, headers, ms) => {
        const { gate, hosts } = adaptiveGate();
        server.respond = reply(429, headers);
        const res = await client(gate, { now: () => wall })(`${server.url}/x`);
        expect(res.status).toBe(429);
        expect(hosts.delayFor(server.host)).toBe(ms);
        expect(hosts.delayFor("other.example")).toBe(0);
        await res.ended();
      },
    );

    it.each(["soon", "Tomorrow-ish"])("ignores a malformed Retry-After (%s)", async (value) => {
      const { gate, hosts, adaptive } = adaptiveGate();
      server.respond = reply(429, { "retry-after": value });
      const res = await client(gate)(server.url);
      await res.ended();
      expect(res.status).toBe(429);
      expect(hosts.delayFor(server.host)).toBe(0);
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it.each([429, 503])(
      "holds the next call to a host paused by a %i until the pause has passed",
      async (status) => {
        const { gate } = adaptiveGate();
        const send = client(gate);
        server.respond = reply(status, { "retry-after": "2" });
        await (await send(server.url)).ended();
        server.respond = reply(200);

        const next = send(`${server.url}/next`);
        await clock.advance(1_999);
        expect(gate.snapshot().waiting).toBe(1);
        expect(server.received).toHaveLength(1);

        await clock.advance(1);
        const res = await next;
        expect(res.status).toBe(200);
        await res.ended();
        expect(server.received).toHaveLength(2);
      },
    );
  });
});
