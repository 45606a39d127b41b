import {
  AdmitTimeoutError,
  Gate,
  InvalidOptionsError,
  type MemorySemaphore,
  type MemoryTokenBucket,
  memory,
} from "floodgate";
import { wrapFetch } from "floodgate/fetch";
import { FakeClock } from "floodgate/testing";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { adaptiveGateOn, closedPort, reply, TestServer } from "./server.js";

let server: TestServer;
let clock: FakeClock;

beforeEach(async () => {
  server = await new TestServer().start();
  clock = new FakeClock();
});

afterEach(async () => {
  vi.unstubAllGlobals();
  await server.close();
});

/** A gate of an interval gate (no spacing) and an AIMD limiter, on the fake clock. */
const adaptiveGate = (aimd?: { initial: number; max: number }) => adaptiveGateOn(clock, aimd);

describe("wrapFetch", () => {
  it("sends a call through the gate and releases it as success", async () => {
    const { gate, adaptive } = adaptiveGate({ initial: 2, max: 4 });
    const gatedFetch = wrapFetch(gate);
    const res = await gatedFetch(`${server.url}/a`);
    expect(res.status).toBe(200);
    expect(await res.text()).toBe("ok");
    expect(gate.snapshot()).toMatchObject({ admitted: 1, inFlight: 0, waiting: 0 });
    // A success with at least half the limit in use raises an AIMD limit by one.
    expect(adaptive.snapshot().limit).toBe(3);
  });

  it("releases other error statuses as success", async () => {
    const { gate, adaptive } = adaptiveGate({ initial: 2, max: 4 });
    server.respond = reply(500);
    expect((await wrapFetch(gate)(server.url)).status).toBe(500);
    expect(adaptive.snapshot().limit).toBe(3);
  });

  describe("Retry-After", () => {
    it("pauses the host on a successful response that carries Retry-After", async () => {
      const { gate, hosts } = adaptiveGate();
      server.respond = reply(200, { "retry-after": "3" });
      await wrapFetch(gate)(server.url);
      expect(hosts.delayFor(server.host)).toBe(3_000);
    });

    it("cuts a pause to maxPauseMs", async () => {
      const { gate, hosts } = adaptiveGate();
      server.respond = reply(429, { "retry-after": "3600" });
      await wrapFetch(gate, undefined, { maxPauseMs: 1_000 })(server.url);
      expect(hosts.delayFor(server.host)).toBe(1_000);
    });

    it("pauses the host named by init.floodgate.host", async () => {
      const { gate, hosts } = adaptiveGate();
      server.respond = reply(429, { "retry-after": "4" });
      await wrapFetch(gate)(server.url, { floodgate: { host: "api.example" } });
      expect(hosts.delayFor("api.example")).toBe(4_000);
      expect(hosts.delayFor(server.host)).toBe(0);
    });
  });

  describe("aborting", () => {
    it("stops waiting for admission on abort and leaves nothing held", async () => {
      const backend = memory({ clock });
      const permits = backend.semaphore("permits", { limit: 1 });
      const gate = new Gate([permits], { clock });
      const held = await gate.admit();
      const controller = new AbortController();
      const call = wrapFetch(gate)(server.url, { signal: controller.signal });
      await clock.flush();
      expect(gate.snapshot().waiting).toBe(1);

      const reason = new Error("caller gave up");
      controller.abort(reason);
      await expect(call).rejects.toBe(reason);
      expect(gate.snapshot()).toMatchObject({ waiting: 0, inFlight: 1, aborted: 1 });
      expect((permits as MemorySemaphore).held).toBe(1);
      expect(server.received).toHaveLength(0);

      await held.release("success");
      expect((permits as MemorySemaphore).held).toBe(0);
    });

    it("aborts a call in flight, rejects with the signal's reason and releases it as ignored", async () => {
      const { gate, adaptive } = adaptiveGate({ initial: 2, max: 4 });
      server.respond = () => {}; // never answers
      const controller = new AbortController();
      const call = wrapFetch(gate)(server.url, { signal: controller.signal });
      await server.receivedCount(1);
      expect(gate.snapshot().inFlight).toBe(1);

      controller.abort();
      await expect(call).rejects.toMatchObject({ name: "AbortError" });
      expect(gate.snapshot().inFlight).toBe(0);
      // Neither raised (success) nor cut (dropped).
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it("rejects at once with the reason of a signal already aborted, sending nothing", async () => {
      const { gate } = adaptiveGate();
      const reason = new Error("already");
      await expect(wrapFetch(gate)(server.url, { signal: AbortSignal.abort(reason) })).rejects.toBe(reason);
      expect(gate.snapshot()).toMatchObject({ admitted: 0, inFlight: 0, waiting: 0 });
      expect(server.received).toHaveLength(0);
    });

    it("honours the signal of a Request", async () => {
      const { gate } = adaptiveGate();
      const reason = new Error("request aborted");
      const request = new Request(server.url, { signal: AbortSignal.abort(reason) });
      await expect(wrapFetch(gate)(request)).rejects.toBe(reason);
      expect(server.received).toHaveLength(0);
    });
  });

  describe("errors", () => {
    it("releases a refused connection as dropped", async () => {
      const { gate, adaptive } = adaptiveGate();
      const port = await closedPort();
      await expect(wrapFetch(gate)(`http://127.0.0.1:${port}/`)).rejects.toThrow(TypeError);
      expect(gate.snapshot().inFlight).toBe(0);
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it("releases a timeout as dropped", async () => {
      const { gate, adaptive } = adaptiveGate();
      const timeout = new DOMException("The operation timed out.", "TimeoutError");
      const fetchImpl = vi.fn(async (_input: string): Promise<Response> => {
        throw timeout;
      });
      await expect(wrapFetch(gate, fetchImpl)(server.url)).rejects.toBe(timeout);
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it("leaves no permit held when the fetch function throws, and learns nothing from it", async () => {
      const backend = memory({ clock });
      const permits = backend.semaphore("permits", { limit: 1 }) as MemorySemaphore;
      const adaptive = backend.aimd("adaptive", { initial: 2, min: 1, max: 4 });
      const gate = new Gate([permits, adaptive], { clock });
      const boom = new Error("boom");
      const throwing = (_input: string): Promise<Response> => {
        throw boom;
      };
      await expect(wrapFetch(gate, throwing)(server.url)).rejects.toBe(boom);
      expect(permits.held).toBe(0);
      expect(gate.snapshot().inFlight).toBe(0);
      expect(adaptive.snapshot().limit).toBe(2);
    });

    it("learns nothing when a gate further in refuses the call", async () => {
      const { gate: outer, adaptive } = adaptiveGate();
      const inner = new Gate([memory({ clock }).semaphore("inner", { limit: 1 })], { clock });
      const held = await inner.admit();
      const innerFetch = wrapFetch(inner, undefined, { timeoutMs: 0 });
      await expect(wrapFetch(outer, innerFetch)(server.url)).rejects.toBeInstanceOf(AdmitTimeoutError);
      expect(adaptive.snapshot().limit).toBe(4);
      expect(outer.snapshot().inFlight).toBe(0);
      await held.release();
    });

    it("rejects with AdmitTimeoutError when admission takes longer than timeoutMs, sending nothing", async () => {
      const backend = memory({ clock });
      const gate = new Gate([backend.semaphore("permits", { limit: 1 })], { clock });
      const held = await gate.admit();
      const fetchImpl = vi.fn(globalThis.fetch);
      const call = wrapFetch(gate, fetchImpl, { timeoutMs: 500 })(server.url);
      const settled = expect(call).rejects.toBeInstanceOf(AdmitTimeoutError);
      await clock.advance(500);
      await settled;
      expect(fetchImpl).not.toHaveBeenCalled();
      await held.release();
    });
  });

  describe("per-call options", () => {
    it("names the option a misspelt one most likely meant, and the options taken there", async () => {
      const gate = new Gate([memory({ clock }).semaphore("s", { limit: 1 })], { clock });
      const refused = async (make: () => unknown) => {
        try {
          await make();
        } catch (error) {
          expect(error).toBeInstanceOf(InvalidOptionsError);
          return [(error as InvalidOptionsError).field, (error as Error).message];
        }
        throw new Error("not refused");
      };
      expect(await refused(() => wrapFetch(gate, fetch, { retyr: {} } as never))).toEqual([
        "retyr",
        'wrapFetch: unknown option "retyr" (did you mean "retry"?); wrapFetch takes key, timeoutMs, maxPauseMs, now, clock, retry, reserve, settle',
      ]);
      expect(await refused(() => wrapFetch(gate, fetch, { retry: { retrys: 2 } } as never))).toEqual([
        "retry.retrys",
        'wrapFetch: unknown option "retry.retrys" (did you mean "retry.retries"?); retry takes retries, baseMs, maxMs, methods, statuses, networkErrors, random, onRetry',
      ]);
      expect(await refused(() => wrapFetch(gate, fetch, { reserve: { shares: 0.1 } } as never))).toEqual([
        "reserve.shares",
        'wrapFetch: unknown option "reserve.shares" (did you mean "reserve.share"?); reserve takes share, remaining',
      ]);
      const call = () => wrapFetch(gate, fetch)(server.url, { floodgate: { kye: "a" } } as never);
      expect(await refused(call)).toEqual([
        "floodgate.kye",
        'wrapFetch: unknown option "floodgate.kye" (did you mean "floodgate.key"?); init.floodgate takes key, host, cost, costs, class, timeoutMs, retry',
      ]);
      expect(server.received).toHaveLength(0);
    });

    it("takes key, host and cost from init.floodgate and strips it before calling fetch", async () => {
      const backend = memory({ clock });
      const bucket = backend.tokenBucket("per-key", {
        keyed: true,
        capacity: 1,
        refillPerSecond: 0.001,
      }) as MemoryTokenBucket;
      const permits = backend.semaphore("permits", { limit: 3 }) as MemorySemaphore;
      const gate = new Gate([bucket, permits], { clock });
      let heldDuringCall = -1;
      const seen: unknown[] = [];
      const fetchImpl = vi.fn(async (input: string, init?: RequestInit) => {
        seen.push(init);
        heldDuringCall = permits.held;
        return fetch(input, init);
      });
      const gatedFetch = wrapFetch(gate, fetchImpl);
      const res = await gatedFetch(server.url, {
        method: "POST",
        body: "x",
        floodgate: { key: "tenant-a", cost: 1, costs: { permits: 3 } },
      });
      expect(res.status).toBe(200);
      expect(heldDuringCall).toBe(3);
      expect(seen[0]).toEqual({ method: "POST", body: "x" });
      expect(await bucket.tryAdmit({ key: "tenant-a" })).toBeUndefined();
      expect(await bucket.tryAdmit({ key: server.host })).toBeDefined();
    });

    it("keys a call by its host by default, or by options.key", async () => {
      const backend = memory({ clock });
      const bucket = backend.tokenBucket("per-key", {
        keyed: true,
        capacity: 1,
        refillPerSecond: 0.001,
      }) as MemoryTokenBucket;
      const gate = new Gate([bucket], { clock });
      await wrapFetch(gate)(server.url);
      expect(await bucket.tryAdmit({ key: server.host })).toBeUndefined();

      const keyOf = vi.fn((url: URL) => url.pathname.split("/")[1]);
      await wrapFetch(gate, undefined, { key: keyOf })(`${server.url}/tenant-b/items`);
      expect(keyOf).toHaveBeenCalledTimes(1);
      expect(await bucket.tryAdmit({ key: "tenant-b" })).toBeUndefined();
    });

    it("sends a call with floodgate: false without passing the gate", async () => {
      const { gate } = adaptiveGate();
      const res = await wrapFetch(gate)(server.url, { floodgate: false });
      expect(res.status).toBe(200);
      expect(gate.snapshot().admitted).toBe(0);
    });

    it("rejects an invalid init.floodgate with an error naming the field", async () => {
      const { gate } = adaptiveGate();
      const gatedFetch = wrapFetch(gate);
      await expect(gatedFetch(server.url, { floodgate: { key: 5 as never } })).rejects.toMatchObject({
        name: "InvalidOptionsError",
        field: "floodgate.key",
      });
      await expect(gatedFetch(server.url, { floodgate: { cots: 2 } as never })).rejects.toMatchObject({
        field: "floodgate.cots",
      });
      await expect(gatedFetch(server.url, { floodgate: { cost: -1 } })).rejects.toMatchObject({
        field: "cost",
      });
      expect(server.received).toHaveLength(0);
    });
  });

  it("looks the default fetch up at each call", async () => {
    const { gate } = adaptiveGate();
    const gatedFetch = wrapFetch(gate);
    const stub = vi.fn(async () => new Response("stubbed", { status: 200 }));
    vi.stubGlobal("fetch", stub);
    const res = await gatedFetch("https://api.example/v1");
    expect(await res.text()).toBe("stubbed");
    expect(stub).toHaveBeenCalledWith("https://api.example/v1");
  });

  it.each([
    ["gate", () => wrapFetch({} as never)],
    ["fetchImpl", () => wrapFetch(adaptiveGate().gate, 3 as never)],
    ["options", () => wrapFetch(adaptiveGate().gate, undefined, "fast" as never)],
    ["key", () => wrapFetch(adaptiveGate().gate, undefined, { key: "host" as never })],
    ["timeoutMs", () => wrapFetch(adaptiveGate().gate, undefined, { timeoutMs: -1 })],
    ["maxPauseMs", () => wrapFetch(adaptiveGate().gate, undefined, { maxPauseMs: Number.NaN })],
    ["now", () => wrapFetch(adaptiveGate().gate, undefined, { now: 5 as never })],
    ["timeoutMS", () => wrapFetch(adaptiveGate().gate, undefined, { timeoutMS: 5 } as never)],
  ])("refuses an invalid %s with an InvalidOptionsError naming it", (field, build) => {
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
