import {
  BackendUnavailableError,
  type Clock,
  Gate,
  InvalidOptionsError,
  type MemoryAimd,
  type MemoryTokenBucket,
  memory,
  type Ticket,
} from "floodgate";
import { type FetchGate, wrapFetch } from "floodgate/fetch";
import { FakeClock } from "floodgate/testing";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { coreBackends, useBackend } from "../contract/backends.js";
import { type Respond, reply, sequence, TestServer } from "./server.js";

let server: TestServer;
let clock: FakeClock;

beforeEach(async () => {
  server = await new TestServer().start();
  clock = new FakeClock();
});

afterEach(async () => {
  await server.close();
});

/** A completion endpoint: says how many tokens the call used in a header and in its JSON body. */
const completion =
  (used: number): Respond =>
  (_req, res) =>
    res
      .writeHead(200, { "content-type": "application/json", "x-usage-tokens": String(used) })
      .end(JSON.stringify({ text: "hello", usage: { total_tokens: used } }));

const usageHeader = (res: Response) => {
  const used = res.headers.get("x-usage-tokens");
  return used === null ? undefined : { tpm: Number(used) };
};

/** Requests-per-minute and tokens-per-minute buckets that barely refill during a test. */
function llmGate() {
  const backend = memory({ clock });
  const rpm = backend.tokenBucket("rpm", {
    keyed: true,
    capacity: 10,
    refillPerSecond: 0.001,
  }) as MemoryTokenBucket;
  const tpm = backend.tokenBucket("tpm", {
    keyed: true,
    capacity: 1_000,
    refillPerSecond: 0.001,
  }) as MemoryTokenBucket;
  return { gate: new Gate([rpm, tpm], { clock }), rpm, tpm };
}

describe("wrapFetch settle", () => {
  it("gives back what a call reserved and did not use", async () => {
    const { gate, rpm, tpm } = llmGate();
    server.respond = completion(200);
    const gatedFetch = wrapFetch(gate, undefined, { settle: usageHeader });
    const res = await gatedFetch(server.url, {
      method: "POST",
      body: "{}",
      floodgate: { costs: { tpm: 800 } },
    });
    expect(res.status).toBe(200);
    // 800 reserved, 200 used: 600 back.
    expect(tpm.tokens(server.host)).toBe(800);
    expect(rpm.tokens(server.host)).toBe(9);
    expect(gate.snapshot().inFlight).toBe(0);
  });

  it("charges what a call used beyond its reserve", async () => {
    const { gate, tpm } = llmGate();
    server.respond = completion(300);
    await wrapFetch(gate, undefined, { settle: usageHeader })(server.url, {
      floodgate: { costs: { tpm: 100 } },
    });
    expect(tpm.tokens(server.host)).toBe(700);
  });

  it("reads the usage from a clone of the JSON body, leaving the body to the caller", async () => {
    const { gate, tpm } = llmGate();
    server.respond = completion(250);
    const gatedFetch = wrapFetch(gate, undefined, {
      settle: async (res) => {
        const body = (await res.clone().json()) as { usage: { total_tokens: number } };
        return { tpm: body.usage.total_tokens };
      },
    });
    const res = await gatedFetch(server.url, { floodgate: { costs: { tpm: 900 } } });
    expect(await res.json()).toEqual({ text: "hello", usage: { total_tokens: 250 } });
    expect(tpm.tokens(server.host)).toBe(750);
  });

  it("settles every stage with a number", async () => {
    const backend = memory({ clock });
    const tokens = backend.tokenBucket("tokens", {
      keyed: true,
      capacity: 100,
      refillPerSecond: 0.001,
    }) as MemoryTokenBucket;
    const gate = new Gate([tokens], { clock });
    server.respond = completion(7);
    await wrapFetch(gate, undefined, { settle: (res) => Number(res.headers.get("x-usage-tokens")) })(
      server.url,
      {
        floodgate: { cost: 40 },
      },
    );
    expect(tokens.tokens(server.host)).toBe(93);
  });

  it("keeps the estimate when settle returns undefined", async () => {
    const { gate, tpm } = llmGate();
    server.respond = reply(200);
    await wrapFetch(gate, undefined, { settle: usageHeader })(server.url, {
      floodgate: { costs: { tpm: 800 } },
    });
    expect(tpm.tokens(server.host)).toBe(200);
  });

  it("holds the ticket until settle resolves", async () => {
    const { gate } = llmGate();
    server.respond = completion(10);
    let finish: (value: { tpm: number }) => void = () => {};
    let called: () => void = () => {};
    const settling = new Promise<void>((resolve) => {
      called = resolve;
    });
    const call = wrapFetch(gate, undefined, {
      settle: () => {
        called();
        return new Promise<{ tpm: number }>((resolve) => {
          finish = resolve;
        });
      },
    })(server.url);
    await settling;
    expect(gate.snapshot().inFlight).toBe(1);
    finish({ tpm: 10 });
    expect((await call).status).toBe(200);
    expect(gate.snapshot().inFlight).toBe(0);
  });

  it("passes the response and the URL", async () => {
    const { gate } = llmGate();
    const seen: Array<[number, string]> = [];
    await wrapFetch(gate, undefined, {
      settle: (res, url) => {
        seen.push([res.status, url.pathname]);
        return undefined;
      },
    })(`${server.url}/v1/chat`);
    expect(seen).toEqual([[200, "/v1/chat"]]);
  });

  it("settles every attempt of a retried call", async () => {
    const { gate, tpm } = llmGate();
    server.respond = sequence(reply(429, { "x-usage-tokens": "0" }), completion(200));
    const instant: Clock = {
      now: () => 0,
      setTimeout: (callback) => setImmediate(callback),
      clearTimeout: (timer) => clearImmediate(timer as ReturnType<typeof setImmediate>),
    };
    const gatedFetch = wrapFetch(gate, undefined, { clock: instant, retry: {}, settle: usageHeader });
    const res = await gatedFetch(server.url, { floodgate: { costs: { tpm: 800 } } });
    expect(res.status).toBe(200);
    expect(server.received).toHaveLength(2);
    // The 429 used nothing and got its 800 back; the 200 used 200 of its 800.
    expect(tpm.tokens(server.host)).toBe(800);
  });

  describe("failures", () => {
    it.each([
      ["a negative count", -1, "-1 (number)"],
      ["a fraction", 12.5, "12.5 (number)"],
      ["a string", "200", '"200" (string)'],
      ["a record with a bad count", { tpm: Number.NaN }, "{ tpm: NaN }"],
      ["an array", [200], "[200] (array)"],
    ])("rejects the call with InvalidOptionsError when settle returns %s", async (_what, value, shown) => {
      const { gate, tpm } = llmGate();
      const backend = memory({ clock });
      const adaptive = backend.aimd("adaptive", { initial: 2, min: 1, max: 4 }) as MemoryAimd;
      const outer = new Gate([gate, adaptive], { clock });
      server.respond = completion(200);
      const error = await wrapFetch(outer, undefined, { settle: () => value as never })(server.url, {
        floodgate: { costs: { tpm: 800 } },
      }).catch((e) => e);
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect(error.field).toBe("settle");
      expect(error.message).toContain(`got ${shown}`);
      expect(outer.snapshot().inFlight).toBe(0);
      expect(tpm.tokens(server.host)).toBe(200);
      // Released with the response's outcome (success raised the limit), not as ignored.
      expect(adaptive.snapshot().limit).toBe(3);
    });

    it("rejects the call with the error settle throws, releasing the ticket", async () => {
      const { gate } = llmGate();
      server.respond = (_req, res) =>
        res.writeHead(502, { "content-type": "text/html" }).end("<html>bad gateway");
      const error = await wrapFetch(gate, undefined, {
        settle: async (res) => ((await res.clone().json()) as { n: number }).n,
      })(server.url).catch((e) => e);
      expect(error).toBeInstanceOf(SyntaxError);
      expect(gate.snapshot().inFlight).toBe(0);
    });

    it("rejects the call when settle names no stage of the gate, releasing the ticket", async () => {
      const { gate, tpm } = llmGate();
      server.respond = completion(200);
      const error = await wrapFetch(gate, undefined, { settle: () => ({ TPM: 200 }) })(server.url, {
        floodgate: { costs: { tpm: 800 } },
      }).catch((e) => e);
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect(error).toMatchObject({ field: "actual.TPM" });
      expect(gate.snapshot().inFlight).toBe(0);
      // The estimate stands: nothing was settled.
      expect(tpm.tokens(server.host)).toBe(200);
    });

    it("keeps the estimate and returns the response when the backend cannot settle", async () => {
      const { gate, tpm } = llmGate();
      const failing: FetchGate = {
        keyedBy: gate.keyedBy,
        pause: (host, ms) => gate.pause(host, ms),
        run: (fn, options) =>
          gate.run(
            (ticket) =>
              fn(
                new Proxy(ticket, {
                  get(target, prop) {
                    if (prop === "settle") {
                      return () => Promise.reject(new BackendUnavailableError("tpm", "redis is down"));
                    }
                    const value = Reflect.get(target, prop, target);
                    return typeof value === "function" ? value.bind(target) : value;
                  },
                }) as Ticket,
              ),
            options,
          ),
      };
      server.respond = completion(200);
      const res = await wrapFetch(failing, undefined, { settle: usageHeader })(server.url, {
        floodgate: { costs: { tpm: 800 } },
      });
      expect(res.status).toBe(200);
      expect(tpm.tokens(server.host)).toBe(200);
    });
  });

  it("refuses a settle that is not a function, naming it", () => {
    const { gate } = llmGate();
    expect(() => wrapFetch(gate, undefined, { settle: 200 as never })).toThrow(
      expect.objectContaining({ name: "InvalidOptionsError", field: "settle" }),
    );
  });
});

describe("reserve, then settle, on every backend", () => {
  for (const backend of coreBackends) {
    describe(backend.name, () => {
      useBackend(backend);

      it("admits at the estimate and settles the tokens the response reports", async () => {
        const b = backend.make(clock);
        const rpm = b.tokenBucket("rpm", { keyed: true, capacity: 10, refillPerSecond: 0.001 });
        const tpm = b.tokenBucket("tpm", { keyed: true, capacity: 1_000, refillPerSecond: 0.001 });
        const gate = new Gate([rpm, tpm], { clock });
        server.respond = completion(200);
        const gatedFetch = wrapFetch(gate, undefined, { settle: usageHeader });
        const res = await gatedFetch(server.url, { floodgate: { key: "acct", costs: { tpm: 800 } } });
        expect(res.status).toBe(200);
        // 1000 - 200 = 800 left: 801 does not fit, 800 does.
        expect(await tpm.tryAdmit({ key: "acct", cost: 801 })).toBeUndefined();
        expect(await tpm.tryAdmit({ key: "acct", cost: 800 })).toBeDefined();
        expect(await rpm.tryAdmit({ key: "acct", cost: 9 })).toBeDefined();
      });
    });
  }
});
