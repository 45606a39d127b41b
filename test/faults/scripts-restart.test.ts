import { Gate } from "floodgate";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { connectedClient, randomPrefix, sleep, until } from "../redis/helpers.js";
import { dropAny, isIoredisFamily, isReady, LIBRARIES } from "../redis/libraries.js";
import { freePort, type RedisProcess } from "../setup/redis-server.js";
import {
  describeError,
  expectExactPermits,
  faultBackend,
  Load,
  noscriptReplies,
  offlineQueueLength,
  recordUnhandled,
  SLACK_MS,
  spread,
  startRedis,
} from "./harness.js";

const LIMIT = 3;
/** Short, so the quarantine after each restart (Redis came back empty) is short too. */
const LEASE_MS = 1_000;
/** The library's default: a slow reply on a busy machine is not what this file is about. */
const COMMAND_TIMEOUT_MS = 2_000;
const CALLERS = 6;
/** On ioredis; the other clients, whose scripts meet the same code in floodgate, get 2 s and 2 restarts. */
const FLUSH_PHASE_MS = 3_000;
const RESTARTS = 3;
/** Redis is down this long on each restart. */
const DOWN_MS = 300;

/** Every error in `error`'s cause chain, as text. */
function chain(error: unknown): string {
  const parts: string[] = [];
  for (let e = error, depth = 0; e !== undefined && depth < 5; depth++) {
    parts.push(describeError(e));
    e = e instanceof Error ? e.cause : undefined;
  }
  return parts.join(" <- ");
}

/**
 * Scripts vanish under a running fleet: `SCRIPT FLUSH` again and again, and redis-server stopped
 * (SIGKILL) and started again on the same port, empty, while callers keep going through a Gate of
 * every kind of Redis stage. A missing script must never reach a caller. On a client of each
 * library that reconnects every 50 ms (the offline queues are read on ioredis and iovalkey).
 */
describe.each(LIBRARIES)("SCRIPT FLUSH and Redis restarts under load, on $name", (library) => {
  let server: RedisProcess;
  let port: number;
  const cleanups: (() => Promise<unknown> | unknown)[] = [];

  beforeAll(async () => {
    port = await freePort();
    server = await startRedis(port);
  });

  afterAll(async () => {
    await server?.stop();
  });

  afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
  });

  it("loses no call to a missing script, and fails calls only with BackendUnavailableError while Redis is down", async () => {
    const flushPhaseMs = library.name === "ioredis" ? FLUSH_PHASE_MS : 2_000;
    const restarts = library.name === "ioredis" ? RESTARTS : 2;
    const unhandled = recordUnhandled();
    cleanups.push(() => unhandled.stop());
    const connect = async () => {
      const client = await connectedClient(server.url, { retryStrategy: () => 50 });
      cleanups.push(() => client.disconnect());
      return client;
    };
    const connectLibrary = async () => {
      const client = await library.connect(server.url, { reconnect: true });
      cleanups.push(() => dropAny(client));
      return client;
    };
    const [main, subscriber, admin] = await Promise.all([connectLibrary(), connectLibrary(), connect()]);
    const prefix = randomPrefix("faults-scripts");
    const backend = faultBackend(main, subscriber, prefix, cleanups, COMMAND_TIMEOUT_MS);
    const sem = backend.semaphore("sem", { limit: LIMIT, leaseMs: LEASE_MS });
    const gate = new Gate([
      backend.tokenBucket("rate", { capacity: 10, refillPerSecond: 500 }),
      backend.intervalGate("hosts", { minIntervalMs: 2 }),
      sem,
      backend.aimd("adaptive", { initial: LIMIT, max: LIMIT, leaseMs: LEASE_MS }),
    ]);
    // Calls hold their permits past 80% of the lease now and then, so renewals run too.
    let n = 0;
    const load = new Load(
      (work) =>
        gate.run(
          async (ticket) => {
            await work(ticket);
            if (++n % 40 === 0) await sleep(LEASE_MS * 0.9);
          },
          { host: "provider.test", timeoutMs: 15_000 },
        ),
      CALLERS,
      10,
    );
    cleanups.push(() => load.stop());

    // Each script the load runs first, once, so that only a flush makes the client send it again.
    await gate.run(async () => {}, { host: "provider.test", timeoutMs: 15_000 });
    const noscriptBefore = await noscriptReplies(admin);
    let flushes = 0;
    let flushing = true;
    const flusher = (async () => {
      while (flushing) {
        await sleep(30 + Math.random() * 50);
        try {
          await admin.script("FLUSH");
          flushes++;
        } catch {
          // Redis is restarting; the admin connection comes back by itself.
        }
      }
    })();
    cleanups.push(async () => {
      flushing = false;
      await flusher;
    });
    let offline = 0;
    const sampler = setInterval(() => {
      for (const c of [main, subscriber])
        if (isIoredisFamily(c)) offline = Math.max(offline, offlineQueueLength(c));
    }, 10);
    cleanups.push(() => clearInterval(sampler));

    // Scripts flushed again and again, Redis up throughout: every call succeeds.
    const startedAt = performance.now();
    load.start();
    await sleep(flushPhaseMs);
    const flushPhaseEnd = performance.now();
    const flushPhase = load.between(startedAt, flushPhaseEnd);
    const flushPhaseFlushes = flushes;
    const noscript = (await noscriptReplies(admin)) - noscriptBefore;
    expect(flushPhase.filter((c) => !c.ok).map((c) => chain(c.error))).toEqual([]);
    expect(flushPhase.length).toBeGreaterThan(20);
    // The flushes did bite: Redis answered NOSCRIPT, and the client sent the script again.
    expect(noscript).toBeGreaterThan(0);

    // Restarts, flushes still going: down windows fail closed, typed; everything else succeeds.
    const windows: { down: number; up: number }[] = [];
    const recoveries: number[] = [];
    for (let i = 0; i < restarts; i++) {
      const down = performance.now();
      await server.stop();
      await sleep(DOWN_MS);
      await server.start();
      const up = performance.now();
      windows.push({ down, up });
      await until(() => isReady(main) && isReady(subscriber), {
        timeoutMs: 5_000,
        message: "the clients did not reconnect to the restarted Redis",
      });
      // Redis came back empty, so each permit stage holds grants back for one lease (quarantine);
      // the Gate meets its two permit stages one after the other.
      recoveries.push((await load.firstSuccessAfter(up, 2 * LEASE_MS + 5_000)) - up);
      await sleep(300);
    }
    flushing = false;
    await flusher;
    await load.stop();
    clearInterval(sampler);

    const failed = load.calls.filter((c) => !c.ok);
    const untyped = load.otherFailures().map((c) => chain(c.error));
    expect(untyped, "calls that failed other than with BackendUnavailableError").toEqual([]);
    expect(failed.map((c) => chain(c.error)).filter((m) => /NOSCRIPT/i.test(m))).toEqual([]);
    // A failure overlaps a down window (stop, then until the clients are back, plus slack).
    const inWindow = (c: { startedAt: number; endedAt: number }) =>
      windows.some((w) => c.endedAt >= w.down && c.startedAt <= w.up + SLACK_MS);
    expect(failed.filter((c) => !inWindow(c)).map((c) => chain(c.error))).toEqual([]);
    expect(failed.length).toBeGreaterThan(0); // the restarts did bite
    expect(offline).toBe(0);
    expect(load.oracle.peak).toBeLessThanOrEqual(LIMIT);
    expect(Math.max(...recoveries)).toBeLessThan(2 * LEASE_MS + 3_000);
    const raw = await connect();
    await expectExactPermits(raw, prefix, "sem", sem, LIMIT, 2 * LEASE_MS + 2_000);
    expect(gate.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    expect(unhandled.seen.map(describeError)).toEqual([]);

    console.log(
      `${library.name}: SCRIPT FLUSH ×${flushes} (${flushPhaseFlushes} with Redis up, ${noscript} NOSCRIPT replies sent again ` +
        `transparently) and ${restarts} restarts: ${load.calls.length} calls, ${failed.length} failed closed ` +
        `(all BackendUnavailableError, all in a down window), 0 NOSCRIPT; restart → first success ` +
        `${spread(recoveries)} (the quarantines of the gate's two permit stages, ${LEASE_MS} ms each and run together in the fused gate, included); peak ${load.oracle.peak}/${LIMIT}`,
    );
  });
});
