import { EventEmitter } from "node:events";
import {
  AdmitTimeoutError,
  Gate,
  InvalidOptionsError,
  type MemoryIntervalGate,
  type MemorySemaphore,
  type MemoryTokenBucket,
  memory,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { floodgateInterceptor } from "floodgate/undici";
import { Agent, type Dispatcher, interceptors, request } from "undici";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { adaptiveGateOn, closedPort, type Respond, reply, TestServer } from "./server.js";

/** Answers with each status in turn, then repeats the last. */
const sequence =
  (...statuses: number[]): Respond =>
  (_req, res) => {
    const status = statuses.length > 1 ? statuses.shift()! : statuses[0]!;
    res.writeHead(status).end(String(status));
  };

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

/** A gate of an interval gate and an AIMD limiter, on the fake clock. */
const adaptiveGate = (aimd?: { initial: number; max: number }, minIntervalMs?: number) =>
  adaptiveGateOn(clock, aimd, minIntervalMs);

/** `request` with options undici's types do not know (`floodgate`, an EventEmitter signal). */
function send(url: string, dispatcher: Dispatcher, extra: Record<string, unknown> = {}) {
  return request(url, { dispatcher, ...extra } as Parameters<typeof request>[1]);
}

describe("floodgateInterceptor", () => {
  it("returns a named dispatch function of exactly two parameters", () => {
    const { gate } = adaptiveGate();
    const dispatch = floodgateInterceptor(gate)(() => true);
    expect(dispatch.length).toBe(2);
    expect(dispatch.name).toBe("floodgateInterceptor");
  });

  it("passes a request through the gate and releases it as success when the response ends", async () => {
    const { gate, adaptive } = adaptiveGate({ initial: 2, max: 4 });
    let finish = () => {};
    server.respond = (_req, res) => {
      res.writeHead(200).write("o");
      finish = () => res.end("k");
    };
    const dispatcher = agent.compose(floodgateInterceptor(gate));
    const res = await send(`${server.url}/a`, dispatcher);
    expect(res.statusCode).toBe(200);
    // Held while the body streams.
    expect(gate.snapshot().inFlight).toBe(1);
    finish();
    expect(await res.body.text()).toBe("ok");
    expect(gate.snapshot()).toMatchObject({ admitted: 1, inFlight: 0, waiting: 0 });
    expect(adaptive.snapshot().limit).toBe(3);
  });

  describe("aborting", () => {
    function permitGate() {
      const backend = memory({ clock });
      const permits = backend.semaphore("permits", { limit: 1 }) as MemorySemaphore;
      return { gate: new Gate([permits], { clock }), permits };
    }

    it("stops waiting for admission when opts.signal aborts and leaves nothing held", async () => {
      const { gate, permits } = permitGate();
      const held = await gate.admit();
      const controller = new AbortController();
      const call = send(server.url, agent.compose(floodgateInterceptor(gate)), { signal: controller.signal });
      await clock.flush();
      expect(gate.snapshot().waiting).toBe(1);

      const reason = new Error("caller gave up");
      controller.abort(reason);
      await expect(call).rejects.toBe(reason);
      expect(gate.snapshot()).toMatchObject({ waiting: 0, inFlight: 1, aborted: 1 });
      expect(server.received).toHaveLength(0);
      await held.release();
      expect(permits.held).toBe(0);
    });

    it("stops waiting when an EventEmitter signal emits abort, and removes its listener", async () => {
      const { gate } = permitGate();
      const held = await gate.admit();
      const emitter = new EventEmitter();
      const call = send(server.url, agent.compose(floodgateInterceptor(gate)), { signal: emitter });
      await clock.flush();
      expect(gate.snapshot().waiting).toBe(1);

      emitter.emit("abort");
      await expect(call).rejects.toMatchObject({ name: "AbortError" });
      expect(gate.snapshot()).toMatchObject({ waiting: 0, inFlight: 1 });
      expect(emitter.listenerCount("abort")).toBe(0);
      expect(server.received).toHaveLength(0);
      await held.release();
    });

    it("stops listening to an EventEmitter signal once admitted", async () => {
      const { gate } = adaptiveGate();
      const emitter = new EventEmitter();
      const listenersAtDispatch = new Promise<number>((resolve) => {
        const dispatch = floodgateInterceptor(gate)((_opts, handler) => {
          resolve(emitter.listenerCount("abort"));
          handler.onResponseError?.(null as never, new Error("not sent"));
          return true;
        });
        dispatch({ origin: server.url, path: "/", method: "GET", signal: emitter } as never, {
          onRequestStart: () => {},
          onResponseError: () => {},
        });
        expect(emitter.listenerCount("abort")).toBe(1);
      });
      expect(await listenersAtDispatch).toBe(0);
      expect(gate.snapshot().inFlight).toBe(0);
    });

    it("aborts a request in flight and releases it as ignored", async () => {
      const { gate, adaptive } = adaptiveGate({ initial: 2, max: 4 });
      server.respond = () => {}; // never answers
      const controller = new AbortController();
      const call = send(server.url, agent.compose(floodgateInterceptor(gate)), { signal: controller.signal });
      await server.receivedCount(1);
      expect(gate.snapshot().inFlight).toBe(1);

      const reason = new Error("stop");
      controller.abort(reason);
      await expect(call).rejects.toBe(reason);
      expect(gate.snapshot().inFlight).toBe(0);
      expect(adaptive.snapshot().limit).toBe(2);
    });
  });

  describe("errors", () => {
    it("releases a refused connection as dropped", async () => {
      const { gate, adaptive } = adaptiveGate();
      const port = await closedPort();
      await expect(
        send(`http://127.0.0.1:${port}/`, agent.compose(floodgateInterceptor(gate))),
      ).rejects.toMatchObject({
        code: "ECONNREFUSED",
      });
      expect(gate.snapshot().inFlight).toBe(0);
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it("leaves no permit held when the dispatcher below throws", async () => {
      const backend = memory({ clock });
      const permits = backend.semaphore("permits", { limit: 1 }) as MemorySemaphore;
      const adaptive = backend.aimd("adaptive", { initial: 2, min: 1, max: 4 });
      const gate = new Gate([permits, adaptive], { clock });
      const boom = new Error("boom");
      const dispatch = floodgateInterceptor(gate)(() => {
        throw boom;
      });
      const failed = new Promise<unknown>((resolve) => {
        dispatch(
          { origin: server.url, path: "/", method: "GET" },
          { onResponseError: (_c, err) => resolve(err) },
        );
      });
      expect(await failed).toBe(boom);
      expect(permits.held).toBe(0);
      expect(gate.snapshot().inFlight).toBe(0);
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it("leaves no permit held when reading the handler's callbacks throws", async () => {
      const backend = memory({ clock });
      const permits = backend.semaphore("permits", { limit: 1 }) as MemorySemaphore;
      const gate = new Gate([permits], { clock });
      const unreadable = new Error("onRequestStart cannot be read");
      const dispatch = floodgateInterceptor(gate)(agent.dispatch.bind(agent));
      const failed = new Promise<unknown>((resolve) => {
        let reads = 0;
        const handler = {
          // Throws the first time it is read (when the request is admitted), then reads as a callback.
          get onRequestStart() {
            if (reads++ === 0) throw unreadable;
            return () => {};
          },
          onResponseError: (_c: unknown, err: Error) => resolve(err),
        };
        dispatch({ origin: server.url, path: "/", method: "GET" }, handler as never);
      });
      expect(await failed).toBe(unreadable);
      expect(permits.held).toBe(0);
      expect(gate.snapshot().inFlight).toBe(0);
    });

    it("releases a request undici refuses (invalid options) and passes the error on", async () => {
      const { gate, adaptive } = adaptiveGate({ initial: 2, max: 4 });
      const dispatcher = agent.compose(floodgateInterceptor(gate));
      await expect(
        dispatcher.request({ origin: server.url, path: "/", method: "GET", headers: { "bad\nname": "x" } }),
      ).rejects.toMatchObject({ code: "UND_ERR_INVALID_ARG" });
      expect(gate.snapshot()).toMatchObject({ admitted: 1, inFlight: 0 });
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it("fails the request with AdmitTimeoutError when admission takes longer than timeoutMs", async () => {
      const backend = memory({ clock });
      const gate = new Gate([backend.semaphore("permits", { limit: 1 })], { clock });
      const held = await gate.admit();
      const call = send(server.url, agent.compose(floodgateInterceptor(gate, { timeoutMs: 250 })));
      const settled = expect(call).rejects.toBeInstanceOf(AdmitTimeoutError);
      await clock.advance(250);
      await settled;
      expect(server.received).toHaveLength(0);
      await held.release();
    });
  });

  describe("per-request options", () => {
    it("takes key, host and costs from opts.floodgate and strips it before dispatching", async () => {
      const backend = memory({ clock });
      const bucket = backend.tokenBucket("per-key", {
        keyed: true,
        capacity: 1,
        refillPerSecond: 0.001,
      }) as MemoryTokenBucket;
      const permits = backend.semaphore("permits", { limit: 3 }) as MemorySemaphore;
      const hosts = backend.intervalGate("hosts", { minIntervalMs: 0 }) as MemoryIntervalGate;
      const gate = new Gate([bucket, hosts, permits], { clock });
      const seen: Dispatcher.DispatchOptions[] = [];
      let heldDuringCall = -1;
      const spy: Dispatcher.DispatcherComposeInterceptor = (dispatch) =>
        function spy(opts, handler) {
          seen.push(opts);
          heldDuringCall = permits.held;
          return dispatch(opts, handler);
        };
      // compose calls the last interceptor first: the gate runs before the spy.
      const dispatcher = agent.compose(spy, floodgateInterceptor(gate));
      server.respond = reply(429, { "retry-after": "5" });
      const res = await send(server.url, dispatcher, {
        floodgate: { key: "tenant-a", host: "api.example", costs: { permits: 3 } },
      });
      await res.body.dump();
      expect(seen).toHaveLength(1);
      expect(seen[0]).not.toHaveProperty("floodgate");
      expect(heldDuringCall).toBe(3);
      expect(await bucket.tryAdmit({ key: "tenant-a" })).toBeUndefined();
      expect(hosts.delayFor("api.example")).toBe(5_000);
      expect(hosts.delayFor(server.host)).toBe(0);
    });

    it("keys a request by options.key", async () => {
      const backend = memory({ clock });
      const bucket = backend.tokenBucket("per-key", {
        keyed: true,
        capacity: 1,
        refillPerSecond: 0.001,
      }) as MemoryTokenBucket;
      const gate = new Gate([bucket], { clock });
      const key = vi.fn((opts: Dispatcher.DispatchOptions) => opts.path.split("/")[1]);
      const res = await send(`${server.url}/tenant-b/x`, agent.compose(floodgateInterceptor(gate, { key })));
      await res.body.dump();
      expect(key).toHaveBeenCalledTimes(1);
      expect(await bucket.tryAdmit({ key: "tenant-b" })).toBeUndefined();
      expect(await bucket.tryAdmit({ key: server.host })).toBeDefined();
    });

    it("dispatches a request with floodgate: false at once, without the gate", async () => {
      const { gate } = adaptiveGate();
      const res = await send(server.url, agent.compose(floodgateInterceptor(gate)), { floodgate: false });
      await res.body.dump();
      expect(res.statusCode).toBe(200);
      expect(gate.snapshot().admitted).toBe(0);
    });

    it("fails a request whose opts.floodgate is invalid with an error naming the field", async () => {
      const { gate } = adaptiveGate();
      await expect(
        send(server.url, agent.compose(floodgateInterceptor(gate)), { floodgate: { host: "" } }),
      ).rejects.toMatchObject({ name: "InvalidOptionsError", field: "floodgate.host" });
      expect(server.received).toHaveLength(0);
    });
  });

  describe("with interceptors.retry()", () => {
    const retry = () => interceptors.retry({ minTimeout: 1, maxTimeout: 1, timeoutFactor: 1, maxRetries: 3 });

    it("passes every retry attempt through the gate again", async () => {
      const { gate, adaptive } = adaptiveGate({ initial: 4, max: 8 });
      server.respond = sequence(503, 429, 200);
      const res = await send(server.url, agent.compose(floodgateInterceptor(gate), retry()));
      expect(res.statusCode).toBe(200);
      expect(await res.body.text()).toBe("200");
      expect(server.received).toHaveLength(3);
      expect(gate.snapshot()).toMatchObject({ admitted: 3, inFlight: 0 });
      // Two drops cut 4 → 2 → 1, the success raises it to 2.
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it("makes a retry attempt wait for the gate's spacing", async () => {
      const { gate } = adaptiveGate({ initial: 4, max: 4 }, 1_000);
      server.respond = sequence(503, 200);
      const call = send(server.url, agent.compose(floodgateInterceptor(gate), retry()));
      await server.receivedCount(1);
      await vi.waitFor(() => expect(gate.snapshot().waiting).toBe(1), { timeout: 10_000 });
      expect(server.received).toHaveLength(1);

      await clock.advance(1_000);
      const res = await call;
      expect(res.statusCode).toBe(200);
      await res.body.dump();
      expect(server.received).toHaveLength(2);
    });

    it("admits a request once for all its attempts when the gate comes last", async () => {
      const { gate } = adaptiveGate();
      server.respond = sequence(503, 200);
      const res = await send(server.url, agent.compose(retry(), floodgateInterceptor(gate)));
      await res.body.dump();
      expect(res.statusCode).toBe(200);
      expect(server.received).toHaveLength(2);
      expect(gate.snapshot()).toMatchObject({ admitted: 1, inFlight: 0 });
    });
  });

  describe("handlers of the older callback API", () => {
    it("forwards onConnect, onHeaders, onData and onComplete and releases the ticket", async () => {
      const { gate, hosts, adaptive } = adaptiveGate();
      server.respond = reply(429, { "retry-after": "3" });
      const dispatch = floodgateInterceptor(gate)(agent.dispatch.bind(agent));
      const events: string[] = [];
      const chunks: Buffer[] = [];
      await new Promise<void>((resolve, reject) => {
        dispatch(
          { origin: server.url, path: "/", method: "GET" },
          {
            onConnect: () => events.push("connect"),
            onHeaders: (status) => {
              events.push(`headers ${status}`);
              return true;
            },
            onData: (chunk) => {
              chunks.push(chunk);
              return true;
            },
            onComplete: () => {
              events.push("complete");
              resolve();
            },
            onError: reject,
          },
        );
      });
      expect(events).toEqual(["connect", "headers 429", "complete"]);
      expect(Buffer.concat(chunks).toString()).toBe("429");
      expect(hosts.delayFor(server.host)).toBe(3_000);
      expect(gate.snapshot().inFlight).toBe(0);
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it("calls onError when the wait for admission is aborted", async () => {
      const backend = memory({ clock });
      const gate = new Gate([backend.semaphore("permits", { limit: 1 })], { clock });
      const held = await gate.admit();
      const dispatch = floodgateInterceptor(gate)(agent.dispatch.bind(agent));
      const controller = new AbortController();
      const failed = new Promise<Error>((resolve) => {
        dispatch({ origin: server.url, path: "/", method: "GET", signal: controller.signal } as never, {
          onConnect: () => {},
          onHeaders: () => true,
          onData: () => true,
          onComplete: () => {},
          onError: resolve,
        });
      });
      const reason = new Error("gone");
      controller.abort(reason);
      expect(await failed).toBe(reason);
      expect(gate.snapshot()).toMatchObject({ waiting: 0, inFlight: 1 });
      await held.release();
    });
  });

  it.each([
    ["gate", () => floodgateInterceptor({} as never)],
    ["options", () => floodgateInterceptor(adaptiveGate().gate, 7 as never)],
    ["key", () => floodgateInterceptor(adaptiveGate().gate, { key: "host" as never })],
    ["timeoutMs", () => floodgateInterceptor(adaptiveGate().gate, { timeoutMs: Number.NaN })],
    ["maxPauseMs", () => floodgateInterceptor(adaptiveGate().gate, { maxPauseMs: -1 })],
    ["now", () => floodgateInterceptor(adaptiveGate().gate, { now: "now" as never })],
    ["retries", () => floodgateInterceptor(adaptiveGate().gate, { retries: 2 } as never)],
  ])("refuses an invalid %s once, in the outer factory, naming it", (field, build) => {
    let error: unknown;
    try {
      build();
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(InvalidOptionsError);
    expect(error).toMatchObject({ field });
    expect((error as Error).message).toContain(field);
  });
});
