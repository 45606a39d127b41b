import {
  AdmitTimeoutError,
  type Clock,
  Gate,
  InvalidOptionsError,
  type MemorySemaphore,
  memory,
} from "floodgate";
import { backoffMs, RetryError, type RetryEvent, wrapFetch } from "floodgate/fetch";
import { FakeClock } from "floodgate/testing";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { adaptiveGateOn, closedPort, reply, sequence, TestServer } from "./server.js";

/** The retry events of a call, and a way to wait for the n-th. */
class Events {
  readonly list: RetryEvent[] = [];
  #waiters: Array<{ n: number; resolve: () => void }> = [];

  readonly onRetry = (event: RetryEvent): void => {
    this.list.push(event);
    this.#waiters = this.#waiters.filter((w) => {
      if (w.n > this.list.length) return true;
      w.resolve();
      return false;
    });
  };

  /** Resolves once `n` retries have been announced (their wait has then started). */
  count(n: number): Promise<void> {
    if (this.list.length >= n) return Promise.resolve();
    return new Promise((resolve) => this.#waiters.push({ n, resolve }));
  }
}

/** A clock whose timers fire on the next turn of the event loop, for tests where the wait does not matter. */
const instant: Clock = {
  now: () => 0,
  setTimeout: (callback) => setImmediate(callback),
  clearTimeout: (timer) => clearImmediate(timer as ReturnType<typeof setImmediate>),
};

let server: TestServer;
let clock: FakeClock;

beforeEach(async () => {
  server = await new TestServer().start();
  clock = new FakeClock();
});

afterEach(async () => {
  await server.close();
});

/** A gate of an interval gate and an AIMD limiter, on the fake clock. */
const adaptiveGate = (minIntervalMs = 0) => adaptiveGateOn(clock, { initial: 8, max: 8 }, minIntervalMs);

describe("backoffMs", () => {
  const policy = (random: number) => ({ baseMs: 100, maxMs: 1_000, random: () => random });
  const table: Array<[number, number, number]> = [
    // [retry n, random, ms]
    [0, 0.5, 50],
    [1, 0.5, 100],
    [2, 0.5, 200],
    [3, 0.5, 400],
    [4, 0.5, 500], // 1600 capped at maxMs 1000
    [10, 0.5, 500],
    [0, 0, 0],
    [3, 0.999, 800], // rounded up to a whole millisecond
    [0, 0.0001, 1],
  ];

  it.each(table)("waits random() * min(maxMs, baseMs * 2^%i) with random %d: %i ms", (n, random, ms) => {
    expect(backoffMs(n, policy(random))).toBe(ms);
  });

  it("keeps a random outside [0, 1] inside it", () => {
    expect(backoffMs(0, policy(-1))).toBe(0);
    expect(backoffMs(0, policy(7))).toBe(100);
    expect(backoffMs(0, policy(Number.NaN))).toBe(0);
  });
});

describe("wrapFetch retries", () => {
  it("retries 503s with full-jitter exponential backoff on the given clock, each attempt through the gate", async () => {
    const { gate, adaptive } = adaptiveGate();
    const events = new Events();
    server.respond = sequence(503, 503, 200);
    const gatedFetch = wrapFetch(gate, undefined, {
      clock,
      retry: { baseMs: 100, maxMs: 10_000, random: () => 0.5, onRetry: events.onRetry },
    });
    const call = gatedFetch(`${server.url}/items`);

    await events.count(1);
    expect(events.list[0]).toEqual({ retry: 1, delayMs: 50, status: 503 });
    await clock.advance(49);
    expect(server.received).toHaveLength(1);
    await clock.advance(1);
    await server.receivedCount(2);

    await events.count(2);
    expect(events.list[1]).toEqual({ retry: 2, delayMs: 100, status: 503 });
    await clock.advance(99);
    expect(server.received).toHaveLength(2);
    await clock.advance(1);

    const res = await call;
    expect(res.status).toBe(200);
    expect(await res.text()).toBe("200");
    expect(server.received).toHaveLength(3);
    expect(gate.snapshot()).toMatchObject({ admitted: 3, inFlight: 0, waiting: 0 });
    // Each 503 was released as dropped (8 → 4 → 2), the 200 as success (2 → 3).
    expect(adaptive.snapshot().limit).toBe(3);
  });

  it("retries 429, 500, 502, 503 and 504 by default", async () => {
    const { gate } = adaptiveGate();
    server.respond = sequence(429, 500, 502, 503, 504, 200);
    const gatedFetch = wrapFetch(gate, undefined, { clock: instant, retry: { retries: 5 } });
    expect((await gatedFetch(server.url)).status).toBe(200);
    expect(server.received).toHaveLength(6);
  });

  it("does not retry other statuses", async () => {
    const { gate } = adaptiveGate();
    server.respond = reply(501);
    const res = await wrapFetch(gate, undefined, { clock: instant, retry: {} })(server.url);
    expect(res.status).toBe(501);
    expect(server.received).toHaveLength(1);
  });

  it("retries the statuses given in retry.statuses only", async () => {
    const { gate } = adaptiveGate();
    server.respond = sequence(409, 503, 200);
    const res = await wrapFetch(gate, undefined, { clock: instant, retry: { statuses: [409] } })(server.url);
    expect(res.status).toBe(503);
    expect(server.received).toHaveLength(2);
  });

  describe("Retry-After", () => {
    it("waits as long as Retry-After asks instead of the backoff", async () => {
      const { gate, hosts } = adaptiveGate();
      const events = new Events();
      server.respond = sequence((_req, res) => res.writeHead(429, { "retry-after": "2" }).end(), 200);
      const gatedFetch = wrapFetch(gate, undefined, {
        clock,
        retry: { random: () => 0.5, onRetry: events.onRetry },
      });
      const call = gatedFetch(server.url);

      await events.count(1);
      expect(events.list[0]).toEqual({ retry: 1, delayMs: 2_000, status: 429 });
      // The host is paused for everyone for as long.
      expect(hosts.delayFor(server.host)).toBe(2_000);
      await clock.advance(1_999);
      expect(server.received).toHaveLength(1);
      await clock.advance(1);
      expect((await call).status).toBe(200);
      expect(server.received).toHaveLength(2);
    });

    it.each([
      ["an HTTP date", { "retry-after": new Date(Date.UTC(2026, 2, 1, 12, 0, 30)).toUTCString() }, 30_000],
      ["retry-after-ms", { "retry-after-ms": "1500" }, 1_500],
      ["zero seconds", { "retry-after": "0" }, 0],
    ])("reads Retry-After as %s", async (_form, headers, ms) => {
      const { gate } = adaptiveGate();
      const events = new Events();
      server.respond = sequence((_req, res) => res.writeHead(503, headers).end(), 200);
      const gatedFetch = wrapFetch(gate, undefined, {
        clock,
        now: () => Date.UTC(2026, 2, 1, 12, 0, 0),
        retry: { random: () => 0.5, onRetry: events.onRetry },
      });
      const call = gatedFetch(server.url);
      await events.count(1);
      expect(events.list[0]!.delayMs).toBe(ms);
      await clock.advance(ms);
      expect((await call).status).toBe(200);
    });

    it("cuts the wait Retry-After asks for to maxPauseMs", async () => {
      const { gate } = adaptiveGate();
      const events = new Events();
      server.respond = sequence((_req, res) => res.writeHead(429, { "retry-after": "3600" }).end(), 200);
      const gatedFetch = wrapFetch(gate, undefined, {
        clock,
        maxPauseMs: 1_000,
        retry: { onRetry: events.onRetry },
      });
      const call = gatedFetch(server.url);
      await events.count(1);
      expect(events.list[0]!.delayMs).toBe(1_000);
      await clock.advance(1_000);
      expect((await call).status).toBe(200);
    });

    it("uses the backoff when a Retry-After is malformed", async () => {
      const { gate } = adaptiveGate();
      const events = new Events();
      server.respond = sequence((_req, res) => res.writeHead(429, { "retry-after": "soon" }).end(), 200);
      const gatedFetch = wrapFetch(gate, undefined, {
        clock,
        retry: { baseMs: 100, random: () => 0.25, onRetry: events.onRetry },
      });
      const call = gatedFetch(server.url);
      await events.count(1);
      expect(events.list[0]!.delayMs).toBe(25);
      await clock.advance(25);
      expect((await call).status).toBe(200);
    });
  });

  it("makes each attempt wait for the gate's spacing again", async () => {
    const { gate } = adaptiveGate(1_000);
    const events = new Events();
    server.respond = sequence(503, 200);
    const gatedFetch = wrapFetch(gate, undefined, {
      clock,
      retry: { random: () => 0, onRetry: events.onRetry },
    });
    const call = gatedFetch(server.url);
    await events.count(1);
    expect(events.list[0]!.delayMs).toBe(0);
    await clock.advance(0);
    expect(gate.snapshot().waiting).toBe(1);
    await clock.advance(999);
    expect(server.received).toHaveLength(1);
    await clock.advance(1);
    expect((await call).status).toBe(200);
    expect(gate.snapshot()).toMatchObject({ admitted: 2, inFlight: 0 });
  });

  it("holds no permit while it waits to retry", async () => {
    const backend = memory({ clock });
    const permits = backend.semaphore("permits", { limit: 1 }) as MemorySemaphore;
    const gate = new Gate([permits], { clock });
    const events = new Events();
    server.respond = sequence(503, 200);
    const call = wrapFetch(gate, undefined, {
      clock,
      retry: { baseMs: 1_000, random: () => 0.5, onRetry: events.onRetry },
    })(server.url);
    await events.count(1);
    expect(permits.held).toBe(0);
    await clock.advance(500);
    expect((await call).status).toBe(200);
    expect(permits.held).toBe(0);
  });

  describe("when every attempt fails", () => {
    it("rejects with RetryError listing every attempt's status and holding the last response", async () => {
      const { gate } = adaptiveGate();
      server.respond = sequence(503, 429, 502);
      const gatedFetch = wrapFetch(gate, undefined, {
        clock: instant,
        retry: { retries: 2, random: () => 0 },
      });
      const error = (await gatedFetch(`${server.url}/v1/items?key=secret`).catch((e) => e)) as RetryError;
      expect(error).toBeInstanceOf(RetryError);
      expect(error.name).toBe("RetryError");
      expect(error.attempts).toEqual([
        { status: 503, delayMs: 0 },
        { status: 429, delayMs: 0 },
        { status: 502 },
      ]);
      expect(error.status).toBe(502);
      expect(error.message).toBe(
        `wrapFetch: GET ${server.url}/v1/items failed after 3 attempts (503, 429, 502)`,
      );
      expect(await (error.response as Response).text()).toBe("502");
      expect(gate.snapshot()).toMatchObject({ admitted: 3, inFlight: 0 });
    });

    it("rejects with RetryError after a single attempt with retries: 0", async () => {
      const { gate } = adaptiveGate();
      server.respond = reply(503);
      const error = await wrapFetch(gate, undefined, { retry: { retries: 0 } })(server.url).catch((e) => e);
      expect(error).toBeInstanceOf(RetryError);
      expect(error.attempts).toEqual([{ status: 503 }]);
      expect(error.message).toContain("after 1 attempt (503)");
    });

    it("carries the last network error as its cause", async () => {
      const { gate, adaptive } = adaptiveGate();
      const port = await closedPort();
      const gatedFetch = wrapFetch(gate, undefined, {
        clock: instant,
        retry: { retries: 1, random: () => 0 },
      });
      const error = (await gatedFetch(`http://127.0.0.1:${port}/`).catch((e) => e)) as RetryError;
      expect(error).toBeInstanceOf(RetryError);
      expect(error.attempts).toHaveLength(2);
      expect(error.attempts[0]!.error).toBeInstanceOf(TypeError);
      expect(error.cause).toBe(error.attempts[1]!.error);
      expect(error.response).toBeUndefined();
      expect(error.message).toContain("(ECONNREFUSED, ECONNREFUSED)");
      expect(gate.snapshot().inFlight).toBe(0);
      // Both refusals were released as dropped: 8 → 4 → 2.
      expect(adaptive.snapshot().limit).toBe(2);
    });
  });

  describe("network errors", () => {
    it("retries a connection reset", async () => {
      const { gate } = adaptiveGate();
      server.respond = sequence((req) => req.socket.destroy(), 200);
      const res = await wrapFetch(gate, undefined, { clock: instant, retry: {} })(server.url);
      expect(res.status).toBe(200);
      expect(server.received).toHaveLength(2);
    });

    it("retries a timeout from the fetch function", async () => {
      const { gate } = adaptiveGate();
      const fetchImpl = vi
        .fn<(input: string) => Promise<Response>>()
        .mockRejectedValueOnce(new DOMException("The operation timed out.", "TimeoutError"))
        .mockImplementation((input) => fetch(input));
      const res = await wrapFetch(gate, fetchImpl, { clock: instant, retry: {} })(server.url);
      expect(res.status).toBe(200);
      expect(fetchImpl).toHaveBeenCalledTimes(2);
    });

    it("does not retry network errors with networkErrors: false", async () => {
      const { gate } = adaptiveGate();
      const port = await closedPort();
      const gatedFetch = wrapFetch(gate, undefined, { clock: instant, retry: { networkErrors: false } });
      await expect(gatedFetch(`http://127.0.0.1:${port}/`)).rejects.toThrow(TypeError);
    });

    it("does not retry an error that says nothing about the server", async () => {
      const { gate } = adaptiveGate();
      const boom = new Error("boom");
      const fetchImpl = vi.fn(async (_input: string): Promise<Response> => {
        throw boom;
      });
      await expect(wrapFetch(gate, fetchImpl, { clock: instant, retry: {} })(server.url)).rejects.toBe(boom);
      expect(fetchImpl).toHaveBeenCalledTimes(1);
    });
  });

  describe("which calls are retried", () => {
    it.each(["GET", "HEAD", "OPTIONS", "PUT", "DELETE"])("retries %s by default", async (method) => {
      const { gate } = adaptiveGate();
      server.respond = sequence(503, 204);
      const res = await wrapFetch(gate, undefined, { clock: instant, retry: {} })(server.url, { method });
      expect(res.status).toBe(204);
      expect(server.received).toHaveLength(2);
    });

    it.each(["POST", "PATCH"])("sends %s once by default and returns its response", async (method) => {
      const { gate } = adaptiveGate();
      server.respond = reply(503);
      const res = await wrapFetch(gate, undefined, { clock: instant, retry: {} })(server.url, {
        method,
        body: "x",
      });
      expect(res.status).toBe(503);
      expect(server.received).toHaveLength(1);
    });

    it("retries a POST listed in retry.methods, in any case, sending its body again", async () => {
      const { gate } = adaptiveGate();
      server.respond = sequence(429, 201);
      const gatedFetch = wrapFetch(gate, undefined, { clock: instant, retry: { methods: ["post"] } });
      const res = await gatedFetch(server.url, { method: "POST", body: '{"n":1}' });
      expect(res.status).toBe(201);
      expect(server.bodies).toEqual(['{"n":1}', '{"n":1}']);
    });

    const bodies: Array<[string, () => RequestInit["body"], string]> = [
      ["a string", () => "plain", "plain"],
      ["a Uint8Array", () => new TextEncoder().encode("bytes"), "bytes"],
      ["an ArrayBuffer", () => new TextEncoder().encode("buffer").buffer as ArrayBuffer, "buffer"],
      ["URLSearchParams", () => new URLSearchParams({ a: "1", b: "2" }), "a=1&b=2"],
      ["a Blob", () => new Blob(["blob"]), "blob"],
    ];

    it.each(bodies)("sends %s body again on retry", async (_kind, body, text) => {
      const { gate } = adaptiveGate();
      server.respond = sequence(503, 200);
      const res = await wrapFetch(gate, undefined, { clock: instant, retry: {} })(server.url, {
        method: "PUT",
        body: body(),
      });
      expect(res.status).toBe(200);
      expect(server.bodies).toEqual([text, text]);
    });

    it("sends a FormData body again on retry", async () => {
      const { gate } = adaptiveGate();
      server.respond = sequence(503, 200);
      const form = new FormData();
      form.set("field", "value-1");
      const res = await wrapFetch(gate, undefined, { clock: instant, retry: {} })(server.url, {
        method: "PUT",
        body: form,
      });
      expect(res.status).toBe(200);
      expect(server.bodies).toHaveLength(2);
      for (const b of server.bodies) expect(b).toContain("value-1");
    });

    it("sends a stream body once and returns its response", async () => {
      const { gate } = adaptiveGate();
      server.respond = reply(503);
      const stream = new ReadableStream<Uint8Array>({
        start(controller) {
          controller.enqueue(new TextEncoder().encode("streamed"));
          controller.close();
        },
      });
      const res = await wrapFetch(gate, undefined, { clock: instant, retry: {} })(server.url, {
        method: "PUT",
        body: stream,
        duplex: "half",
      } as RequestInit);
      expect(res.status).toBe(503);
      expect(server.bodies).toEqual(["streamed"]);
    });

    it("sends a Request carrying a body once, and retries one without", async () => {
      const { gate } = adaptiveGate();
      const gatedFetch = wrapFetch(gate, undefined, { clock: instant, retry: {} });
      server.respond = reply(503);
      const withBody = await gatedFetch(new Request(server.url, { method: "PUT", body: "once" }));
      expect(withBody.status).toBe(503);
      expect(server.received).toHaveLength(1);

      server.respond = sequence(503, 200);
      const without = await gatedFetch(new Request(server.url));
      expect(without.status).toBe(200);
      expect(server.received).toHaveLength(3);
    });

    it("retries a call that asks with init.floodgate.retry, fields over the wrapper's", async () => {
      const { gate } = adaptiveGate();
      server.respond = sequence(503, 503, 200);
      const plain = wrapFetch(gate, undefined, { clock: instant });
      const res = await plain(server.url, { floodgate: { retry: { retries: 1 } } }).catch((e) => e);
      expect(res).toBeInstanceOf(RetryError);
      expect(server.received).toHaveLength(2);
      expect((await plain(server.url, { floodgate: { retry: {} } })).status).toBe(200);
    });

    it("keeps the wrapper's retry fields that a call leaves out or undefined", async () => {
      const { gate } = adaptiveGate();
      server.respond = sequence(409, 409, 409, 200);
      const gatedFetch = wrapFetch(gate, undefined, {
        clock: instant,
        retry: { retries: 1, statuses: [409] },
      });
      const res = await gatedFetch(server.url, { floodgate: { retry: { retries: 3, statuses: undefined } } });
      expect(res.status).toBe(200);
      expect(server.received).toHaveLength(4);
    });

    it("sends a call with init.floodgate.retry: false once", async () => {
      const { gate } = adaptiveGate();
      server.respond = reply(503);
      const gatedFetch = wrapFetch(gate, undefined, { clock: instant, retry: {} });
      const res = await gatedFetch(server.url, { floodgate: { retry: false } });
      expect(res.status).toBe(503);
      expect(server.received).toHaveLength(1);
    });
  });

  describe("aborting and refusals", () => {
    it("stops waiting to retry when the signal aborts, leaving no timer and no listener", async () => {
      const { gate } = adaptiveGate();
      const events = new Events();
      const controller = new AbortController();
      const signal = controller.signal;
      let listeners = 0;
      const add = signal.addEventListener.bind(signal);
      const remove = signal.removeEventListener.bind(signal);
      signal.addEventListener = ((...args: Parameters<typeof add>) => {
        listeners++;
        add(...args);
      }) as typeof add;
      signal.removeEventListener = ((...args: Parameters<typeof remove>) => {
        listeners--;
        remove(...args);
      }) as typeof remove;
      // A fetch double that leaves the signal alone, so every listener counted is the wrapper's.
      const fetchImpl = vi.fn(
        async (_input: string, _init?: RequestInit) => new Response("busy", { status: 503 }),
      );
      const call = wrapFetch(gate, fetchImpl, {
        clock,
        retry: { baseMs: 1_000, random: () => 0.5, onRetry: events.onRetry },
      })(server.url, { signal });
      await events.count(1);
      const timers = clock.pendingTimers;
      expect(listeners).toBe(1);

      const reason = new Error("caller gave up");
      controller.abort(reason);
      await expect(call).rejects.toBe(reason);
      expect(clock.pendingTimers).toBe(timers - 1);
      expect(listeners).toBe(0);
      expect(fetchImpl).toHaveBeenCalledTimes(1);
      expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    });

    it("removes its listener once the wait is over", async () => {
      const { gate } = adaptiveGate();
      const events = new Events();
      const signal = new AbortController().signal;
      const removed = vi.spyOn(signal, "removeEventListener");
      const fetchImpl = vi
        .fn<(input: string, init?: RequestInit) => Promise<Response>>()
        .mockResolvedValueOnce(new Response("busy", { status: 503 }))
        .mockResolvedValueOnce(new Response("ok"));
      const call = wrapFetch(gate, fetchImpl, {
        clock,
        retry: { random: () => 0.5, onRetry: events.onRetry },
      })(server.url, { signal });
      await events.count(1);
      await clock.advance(50);
      expect((await call).status).toBe(200);
      expect(removed).toHaveBeenCalledWith("abort", expect.any(Function));
    });

    it("does not retry a call aborted in flight", async () => {
      const { gate } = adaptiveGate();
      server.respond = () => {}; // never answers
      const controller = new AbortController();
      const call = wrapFetch(gate, undefined, { clock: instant, retry: {} })(server.url, {
        signal: controller.signal,
      });
      await server.receivedCount(1);
      controller.abort();
      await expect(call).rejects.toMatchObject({ name: "AbortError" });
      expect(server.received).toHaveLength(1);
    });

    it("rejects with the gate's refusal of a later attempt unchanged", async () => {
      const backend = memory({ clock });
      const gate = new Gate([backend.semaphore("permits", { limit: 1 })], { clock });
      let held: Promise<unknown> | undefined;
      server.respond = reply(503);
      const gatedFetch = wrapFetch(gate, undefined, {
        clock: instant,
        timeoutMs: 0,
        retry: {
          onRetry: () => {
            held = gate.admit();
          },
        },
      });
      await expect(gatedFetch(server.url)).rejects.toBeInstanceOf(AdmitTimeoutError);
      expect(server.received).toHaveLength(1);
      expect(held).toBeDefined();
    });

    it("stops retrying when onRetry throws, rejecting with its error", async () => {
      const { gate } = adaptiveGate();
      server.respond = reply(503);
      const stop = new Error("enough");
      const gatedFetch = wrapFetch(gate, undefined, {
        clock: instant,
        retry: {
          onRetry: () => {
            throw stop;
          },
        },
      });
      await expect(gatedFetch(server.url)).rejects.toBe(stop);
      expect(server.received).toHaveLength(1);
    });
  });

  it.each([
    ["retry", { retry: 3 }],
    ["retry.retries", { retry: { retries: -1 } }],
    ["retry.retries", { retry: { retries: 1.5 } }],
    ["retry.baseMs", { retry: { baseMs: Number.POSITIVE_INFINITY } }],
    ["retry.maxMs", { retry: { maxMs: -5 } }],
    ["retry.methods", { retry: { methods: "GET" } }],
    ["retry.statuses", { retry: { statuses: [99] } }],
    ["retry.networkErrors", { retry: { networkErrors: "yes" } }],
    ["retry.random", { retry: { random: 0.5 } }],
    ["retry.onRetry", { retry: { onRetry: true } }],
    ["retry.tries", { retry: { tries: 2 } }],
    ["clock", { clock: { now: () => 0 } }],
  ])("refuses an invalid %s with an InvalidOptionsError naming it", (field, options) => {
    const { gate } = adaptiveGate();
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

  it("rejects a call whose init.floodgate.retry is invalid, sending nothing", async () => {
    const { gate } = adaptiveGate();
    await expect(
      wrapFetch(gate)(server.url, { floodgate: { retry: { retries: -1 } } }),
    ).rejects.toMatchObject({ name: "InvalidOptionsError", field: "floodgate.retry.retries" });
    expect(server.received).toHaveLength(0);
  });
});
