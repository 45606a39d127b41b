import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type Clock, Gate, isFloodgateError, type Stage, type Ticket } from "floodgate";
import { redis, stageKey } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import type { Redis } from "ioredis";
import { afterEach, describe, expect, it } from "vitest";
import { commandName, type ScriptName } from "../../src/redis/scripts.js";
import { freePort, haveRedisServer, INSTALL_HINT, RedisProcess } from "../setup/redis-server.js";
import { connectedClient, randomPrefix, rejectionOf, until, within } from "./helpers.js";

type Backend = ReturnType<typeof redis>;

/** The ticket `stage.tryAdmit()` gives once it admits, trying for up to 3 s; fails with `message`. */
async function admittedSoon(stage: Stage, message: string): Promise<Ticket> {
  let ticket: Ticket | undefined;
  await until(
    async () => {
      ticket = await stage.tryAdmit();
      return ticket !== undefined;
    },
    { timeoutMs: 3_000, message },
  );
  return ticket!;
}

/**
 * Hold back the client's next command for `script` (as a client holds a command it will send
 * again by itself): the caller sees no reply; `send()` sends it then and resolves with its reply.
 * With `lose`, the caller never sees that reply either: once Redis has run the command, it is
 * failed to the caller as a closed connection would fail it (a client that sent it again after
 * its connection closed, and gave up on it before the reply was read).
 */
function holdBack(client: Redis, script: ScriptName, lose = false): { send(): Promise<unknown> } {
  const command = commandName(script);
  const commands = client as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
  const original = commands[command]!.bind(client);
  let send: (() => Promise<unknown>) | undefined;
  commands[command] = (...args: unknown[]) => {
    commands[command] = original;
    return new Promise((resolve, reject) => {
      send = () => {
        const sent = original(...args);
        if (lose) sent.then(() => reject(new Error("Connection is closed.")), reject);
        else sent.then(resolve, reject);
        return sent;
      };
    });
  };
  return {
    send: () => {
      if (send === undefined) throw new Error(`no ${script} command was held back`);
      return send();
    },
  };
}

/**
 * Hold back every command for `script` the client sends from now on, until `sendAll()` sends them
 * in order (and sends later ones at once); `count()` says how many it holds.
 */
function holdBackAll(client: Redis, script: ScriptName): { count(): number; sendAll(): Promise<unknown[]> } {
  const command = commandName(script);
  const commands = client as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
  const original = commands[command]!.bind(client);
  const held: (() => Promise<unknown>)[] = [];
  commands[command] = (...args: unknown[]) =>
    new Promise((resolve, reject) => {
      held.push(() => {
        const sent = original(...args);
        sent.then(resolve, reject);
        return sent;
      });
    });
  return {
    count: () => held.length,
    sendAll: () => {
      commands[command] = original;
      return Promise.all(held.map((send) => send()));
    },
  };
}

/**
 * `call` (`stage.tryAdmit()` unless given) with its `script` call held back by `client` until the
 * caller has failed closed, then sent: Redis runs it after the caller's give-back (which found
 * nothing to give back) and it admits. What it took must then come back: the next `tryAdmit` is
 * admitted (fails with `message` if not), and its ticket released.
 */
async function ranLate(
  client: Redis,
  stage: Stage,
  script: ScriptName,
  message: string,
  call: () => Promise<unknown> = () => stage.tryAdmit(),
): Promise<void> {
  const held = holdBack(client, script);
  const error = await within(rejectionOf(call()), 3_000, `a call with its ${script} held back`);
  expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
  expect(Number(((await held.send()) as unknown[])[0])).toBe(1);
  const ticket = await admittedSoon(stage, message);
  await ticket.release("success");
}

/**
 * What `what` took came back: the permit stages' `holders` (their keys) empty, and `stage`
 * admitting the next call (whose ticket is released).
 */
async function allBack(raw: Redis, holders: readonly string[], stage: Stage, what: string): Promise<void> {
  await until(
    async () => {
      for (const key of holders) if ((await raw.zcard(key)) !== 0) return false;
      return true;
    },
    { timeoutMs: 3_000, message: `the permits of ${what} stayed held` },
  );
  const ticket = await admittedSoon(stage, `the tokens or the slot of ${what} did not come back`);
  await ticket.release("success");
}

/** A token bucket with classes of one token, none back for an hour, its one class the default. */
function oneToken(backend: ReturnType<typeof redis>): Stage {
  return backend.tokenBucket("rate", {
    capacity: 1,
    refillPerSecond: 1 / 3_600,
    classes: { only: { share: 1 } },
    defaultClass: "only",
  });
}

const COMMAND_TIMEOUT_MS = 300;

/**
 * Each test runs its own redis-server on a free loopback port, so it can stop, freeze and restart
 * it without disturbing the other suites.
 */
describe("a Redis outage", () => {
  const servers: RedisProcess[] = [];
  const clients: Redis[] = [];
  const backends: Backend[] = [];
  const dirs: string[] = [];

  afterEach(async () => {
    for (const server of servers) server.child?.kill("SIGCONT");
    await Promise.all(backends.splice(0).map((backend) => within(backend.close(), 5_000, "backend.close()")));
    for (const client of clients.splice(0)) client.disconnect();
    await Promise.all(servers.splice(0).map((server) => server.stop()));
    await Promise.all(dirs.splice(0).map((dir) => rm(dir, { recursive: true, force: true })));
  });

  async function startServer(port: number, extraArgs: string[] = []): Promise<RedisProcess> {
    // These tests stop and restart a server of their own, so they need the binary even with REDIS_URL.
    if (!haveRedisServer()) throw new Error(`redis-server was not found on the PATH. ${INSTALL_HINT}`);
    const server = new RedisProcess(port, extraArgs);
    servers.push(server);
    await server.start();
    return server;
  }

  /** A fail-fast client that reconnects every 50 ms while Redis is away. */
  async function client(url: string): Promise<Redis> {
    const c = await connectedClient(url, { retryStrategy: () => 50 });
    clients.push(c);
    return c;
  }

  /** A server of the test's own, and `setup` on it under a fresh prefix named `name`. */
  async function onOwnServer(name: string, pollMs?: number) {
    const server = await startServer(await freePort());
    const prefix = randomPrefix(name);
    return { prefix, ...(await setup(server.url, prefix, pollMs)) };
  }

  async function setup(url: string, prefix: string, pollMs = 100, claimMs?: number) {
    const [main, subscriber, raw] = await Promise.all([client(url), client(url), client(url)]);
    const backend = redis(main, {
      prefix,
      subscriber,
      commandTimeoutMs: COMMAND_TIMEOUT_MS,
      pollMs,
      claimMs,
    });
    backends.push(backend);
    return { main, subscriber, raw, backend };
  }

  function reconnected(...connections: Redis[]): Promise<true> {
    return until(() => connections.every((c) => c.status === "ready"), {
      timeoutMs: 10_000,
      message: "the clients did not reconnect to the restarted Redis",
    });
  }

  /** Take `n` permits, each within a bounded wait. */
  async function take(sem: ReturnType<Backend["semaphore"]>, n: number): Promise<Ticket[]> {
    const tickets: Ticket[] = [];
    for (let i = 0; i < n; i++) tickets.push(await sem.admit({ timeoutMs: 5_000 }));
    return tickets;
  }

  it("fails callers closed while Redis is down, then admits again with no permit leaked once it is back", async () => {
    const port = await freePort();
    const server = await startServer(port);
    const prefix = randomPrefix("outage-down");
    const { main, subscriber, raw, backend } = await setup(server.url, prefix);
    const leaseMs = 1_000;
    const sem = backend.semaphore("sem", { limit: 3, leaseMs });

    const held = await take(sem, 3);
    const signals = held.map((t) => t.signal);
    const waiting = sem.admit();
    waiting.catch(() => {});
    await until(async () => (await raw.zcard(stageKey(prefix, "sem", "queue"))) === 1, {
      timeoutMs: 3_000,
      message: "the fourth caller never queued",
    });

    await server.stop(); // SIGKILL: no goodbye, no data kept (persistence is off)

    // The caller already waiting is not left hanging.
    const waitError = await within(rejectionOf(waiting), 3_000, "the waiting caller");
    expect(isFloodgateError(waitError, "BACKEND_UNAVAILABLE")).toBe(true);
    // New callers fail closed at once (the client is not ready, or the command times out).
    const admitError = await within(rejectionOf(sem.admit()), 3_000, "admit() during the outage");
    expect(isFloodgateError(admitError, "BACKEND_UNAVAILABLE")).toBe(true);
    const tryError = await within(rejectionOf(sem.tryAdmit()), 3_000, "tryAdmit() during the outage");
    expect(isFloodgateError(tryError, "BACKEND_UNAVAILABLE")).toBe(true);
    expect((tryError as Error).message).not.toBe("");

    // Holders learn their leases can no longer be renewed.
    await until(() => signals.every((s) => s.aborted), {
      timeoutMs: leaseMs + 3_000,
      message: "the holders were never told they lost their leases",
    });
    for (const s of signals) expect(isFloodgateError(s.reason, "LEASE_LOST")).toBe(true);
    // Releasing while Redis is away neither throws nor hangs.
    await within(Promise.all(held.map((t) => t.release("success"))), 3_000, "release() during the outage");

    // Back on the same port, empty: the data went with the process.
    await startServer(port);
    await reconnected(main, subscriber, raw);

    const again = await take(sem, 3);
    expect(await sem.tryAdmit()).toBeUndefined();
    expect(await raw.hget(stageKey(prefix, "sem", "meta"), "used")).toBe("3");
    await Promise.all(again.map((t) => t.release("success")));
    const full = await take(sem, 3);
    expect(await raw.zcard(stageKey(prefix, "sem", "holders"))).toBe(3);
    await Promise.all(full.map((t) => t.release("success")));
    expect(await raw.zcard(stageKey(prefix, "sem", "holders"))).toBe(0);
  });

  it("counts nothing twice when Redis comes back with its data (append-only file)", async () => {
    const port = await freePort();
    const dir = await mkdtemp(join(tmpdir(), "floodgate-outage-"));
    dirs.push(dir);
    const persistent = ["--appendonly", "yes", "--appendfsync", "always", "--dir", dir];
    const server = await startServer(port, persistent);
    const prefix = randomPrefix("outage-aof");
    const { main, subscriber, raw, backend } = await setup(server.url, prefix);
    const leaseMs = 1_000;
    const sem = backend.semaphore("sem", { limit: 3, leaseMs });
    const holders = stageKey(prefix, "sem", "holders");
    const meta = stageKey(prefix, "sem", "meta");

    const held = await take(sem, 2);
    const signals = held.map((t) => t.signal);
    await server.stop();
    await until(() => signals.every((s) => s.aborted), {
      timeoutMs: leaseMs + 3_000,
      message: "the holders were never told they lost their leases",
    });
    // These releases cannot reach Redis now; they are tried again for as long as the lease lasts.
    await within(Promise.all(held.map((t) => t.release("success"))), 3_000, "release() during the outage");

    await startServer(port, persistent);
    await reconnected(main, subscriber, raw);
    // The leases came back with the data, unless a retried release got there first: either way
    // `used` counts exactly the leases held.
    // (read in one MULTI: a retried release may land between two separate reads)
    const [[, back], [, used]] = (await raw.multi().zcard(holders).hget(meta, "used").exec()) as [
      [unknown, number],
      [unknown, string | null],
    ];
    expect(back).toBeLessThanOrEqual(2);
    expect(Number(used ?? 0)).toBe(back);

    // What is left runs out by itself: the whole limit is there again, counted once.
    const again = await take(sem, 3);
    expect(await sem.tryAdmit()).toBeUndefined();
    expect(await raw.zcard(holders)).toBe(3);
    expect(await raw.hget(meta, "used")).toBe("3");
    await Promise.all(again.map((t) => t.release("success")));
    expect(await raw.zcard(holders)).toBe(0);
    expect(await raw.hget(meta, "used")).toBe("0");
  });

  it("fails callers closed after commandTimeoutMs when Redis stops answering, and holds nothing once it answers", async () => {
    const port = await freePort();
    const server = await startServer(port);
    const prefix = randomPrefix("outage-frozen");
    const { raw, backend } = await setup(server.url, prefix);
    // A long lease: a permit granted to nobody would stay held long after the test's bounds.
    const sem = backend.semaphore("sem", { limit: 1, leaseMs: 30_000 });

    server.child!.kill("SIGSTOP");
    const tryError = await within(rejectionOf(sem.tryAdmit()), 3_000, "tryAdmit() against a frozen Redis");
    expect(isFloodgateError(tryError, "BACKEND_UNAVAILABLE")).toBe(true);
    const admitError = await within(rejectionOf(sem.admit()), 3_000, "admit() against a frozen Redis");
    expect(isFloodgateError(admitError, "BACKEND_UNAVAILABLE")).toBe(true);
    server.child!.kill("SIGCONT");

    // Redis now runs the acquires it was sent; each one granted must be given back.
    await until(async () => (await raw.zcard(stageKey(prefix, "sem", "holders"))) === 0, {
      timeoutMs: 3_000,
      message: "a permit asked for while Redis was frozen stayed held after it came back",
    });
    const ticket = await sem.tryAdmit();
    expect(ticket).toBeDefined();
    await ticket!.release("success");
  });

  it("times a call out at its own deadline after earlier calls were answered and the timer left running", async () => {
    // A clock whose timers can stop keeping the process alive, as Node's (no `track`: time moves
    // without waiting for Redis). Once its calls are answered, the link leaves its one timer to
    // run out, no longer keeping the process alive, and takes it up for the next call.
    const fake = new FakeClock();
    /** Each timer set, by its ms, and what was done with it. */
    const timers: { ms: number; ref: number; unref: number; cleared: boolean }[] = [];
    const clock: Clock = {
      now: () => fake.now(),
      setTimeout: (callback, ms) => {
        const t = { ms, ref: 0, unref: 0, cleared: false };
        timers.push(t);
        return { handle: fake.setTimeout(callback, ms), ref: () => t.ref++, unref: () => t.unref++, t };
      },
      clearTimeout: (timer) => {
        const { handle, t } = timer as { handle: unknown; t: { cleared: boolean } };
        t.cleared = true;
        fake.clearTimeout(handle);
      },
    };
    /** The timers set for the link's calls (the command timeout, or what is left of it). */
    const callTimers = () => timers.filter((t) => t.ms <= 1_000);
    const server = await startServer(await freePort());
    const backend = redis(await client(server.url), {
      prefix: randomPrefix("outage-timer"),
      clock,
      commandTimeoutMs: 1_000,
    });
    backends.push(backend);
    const bucket = backend.tokenBucket("b", { capacity: 100, refillPerSecond: 100 });
    expect(await bucket.tryAdmit()).toBeDefined();
    expect(await bucket.tryAdmit()).toBeDefined();
    // One timer for both calls: left to run out after each reply, taken up again for the second.
    expect(callTimers()).toEqual([{ ms: 1_000, ref: 1, unref: 2, cleared: false }]);

    // The timer runs out at 1,000; a call sent at 600 with Redis frozen fails at 1,600, not before.
    await fake.advance(600);
    server.child!.kill("SIGSTOP");
    let failed: unknown;
    bucket.tryAdmit().then(
      () => (failed = "admitted"),
      (error: unknown) => (failed = error),
    );
    await fake.advance(999);
    expect(failed).toBeUndefined();
    // (It ran out at 1,000, and was set again for what was left of the call's time.)
    expect(callTimers().map((t) => t.ms)).toEqual([1_000, 600]);
    await fake.advance(1);
    await until(() => failed !== undefined, {
      timeoutMs: 3_000,
      message: "the call was not failed at its deadline",
    });
    server.child!.kill("SIGCONT");
    expect(isFloodgateError(failed, "BACKEND_UNAVAILABLE"), String(failed)).toBe(true);
    expect(String(failed)).toMatch(/did not answer token-bucket-take within 1000 ms/);
  });

  // A Cluster client (ioredis, iovalkey) sends a command again by itself after its connection
  // closed, 100 ms later and again up to 16 times: it may run after floodgate gave up on it and
  // gave back what it would take, which then frees nothing. Here the client holds the acquire
  // back and sends it once the caller has failed closed; its late reply must give back the lease.
  // Such a client gives up on the command in the end and rejects it, though one of its sends may
  // have run: so too when the client fails it instead of answering ("then failed").
  for (const [mode, lose] of [
    ["tryAdmit", false],
    ["admit", false],
    ["tryAdmit", true],
    ["admit", true],
  ] as const) {
    it(`gives back a permit whose acquire the client ran after the caller failed closed${lose ? ", then failed" : ""} (${mode})`, async () => {
      const { prefix, main, raw, backend } = await onOwnServer("outage-late");
      const sem = backend.semaphore("sem", { limit: 1, leaseMs: 30_000 });
      const held = holdBack(main, "semaphore-acquire", lose);
      const error = await within(
        rejectionOf(mode === "admit" ? sem.admit({ timeoutMs: 5_000 }) : sem.tryAdmit()),
        3_000,
        `${mode}() with its acquire held back`,
      );
      expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
      // The caller gave up and gave back its lease, which was not there yet (that give-back went
      // out before the caller heard): now the client sends the acquire, and Redis runs it after.
      // (It took the permit: its reply says granted, whether or not the caller's side sees it.)
      expect(((await held.send()) as unknown[])[0]).toBe(1);
      await until(
        async () =>
          (await raw.zcard(stageKey(prefix, "sem", "holders"))) === 0 &&
          (await raw.zcard(stageKey(prefix, "sem", "queue"))) === 0,
        {
          timeoutMs: 3_000,
          message: "a lease taken by an acquire that ran after its caller failed closed stayed held",
        },
      );
      const ticket = await sem.tryAdmit();
      expect(ticket).toBeDefined();
      await ticket!.release("success");
    });
  }

  // A turn's tries go in one acquire: each of its members is given back.
  it("gives back every permit of a turn's acquire the client ran after its callers failed closed", async () => {
    const { prefix, main, raw, backend } = await onOwnServer("outage-late-turn");
    const sem = backend.semaphore("sem", { limit: 2, leaseMs: 30_000 });
    const held = holdBack(main, "semaphore-acquire");
    const errors = await within(
      Promise.all([rejectionOf(sem.tryAdmit()), rejectionOf(sem.tryAdmit())]),
      3_000,
      "two tryAdmit() in one turn with their acquire held back",
    );
    for (const error of errors)
      expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
    // Sent now: both members take a permit (one reply each).
    expect(((await held.send()) as unknown[][]).map((reply) => Number(reply[0]))).toEqual([1, 1]);
    await until(async () => (await raw.zcard(stageKey(prefix, "sem", "holders"))) === 0, {
      timeoutMs: 3_000,
      message: "a permit taken by a turn's acquire that ran after its callers failed closed stayed held",
    });
    const tickets = [await sem.tryAdmit(), await sem.tryAdmit()];
    expect(tickets.every((t) => t !== undefined)).toBe(true);
    for (const t of tickets) await t!.release("success");
  });

  // The same through a fused gate: its one script call takes every stage's permit at once, and
  // the token and the host's slot.
  it("gives back the permits, tokens and slot a fused gate's admission took when the client ran it after the caller failed closed", async () => {
    const { prefix, main, raw, backend } = await onOwnServer("outage-late-gate");
    const gate = new Gate(
      [
        // Two tokens, none back for an hour: one for the first call, one for the late one.
        backend.tokenBucket("rate", { capacity: 2, refillPerSecond: 1 / 3_600 }),
        // A call an hour: the first call's slot is handed back by its refund, the late one's
        // must be too.
        backend.intervalGate("hosts", { minIntervalMs: 3_600_000, defaultHost: "api.example" }),
        backend.semaphore("sem", { limit: 1, leaseMs: 30_000 }),
        backend.aimd("aimd", { initial: 1, min: 1, max: 1, leaseMs: 30_000 }),
      ],
      { name: "late", fuse: true },
    );
    await (await gate.admit({ timeoutMs: 5_000 })).refund(); // scripts known, lines heard
    const held = holdBack(main, "gate");
    const error = await within(
      rejectionOf(gate.tryAdmit()),
      3_000,
      "gate.tryAdmit() with its call held back",
    );
    expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
    // Now the client sends it, and Redis runs it after the caller's give-backs: it admits (its
    // reply says so, one call admitted in one pass), takes both stages' permits and the token.
    expect(((await held.send()) as unknown[])[0]).toBe(1);
    // The token must come back too (the refill brings none), and the host's slot (the next is an
    // hour away): the next call is admitted.
    await allBack(
      raw,
      ["sem", "aimd"].map((stage) => stageKey(prefix, stage, "holders")),
      gate,
      "a fused gate's call that ran after its caller failed closed",
    );
  });

  // A fused gate's try run so may put its caller, who has gone, in the gate's line, with its steps
  // kept for a release to admit: it leaves the line once the late reply says so.
  // So too when the client then fails the try instead of answering ("then failed": see the
  // acquire's case): without a reply to say where it went, the caller leaves the gate's lines.
  for (const lose of [false, true]) {
    it(`takes out of the gate's line a caller a fused gate's try put there when the client ran it after the caller failed closed${lose ? ", then failed it" : ""}`, async () => {
      // (A waiter's place in line lasts 3 × pollMs without asking: here far longer than the test.)
      const { prefix, main, raw, backend } = await onOwnServer("outage-late-gate-line", 60_000);
      const stages = [
        backend.tokenBucket("rate", { capacity: 100, refillPerSecond: 100 }),
        backend.semaphore("sem", { limit: 1, leaseMs: 30_000 }),
      ];
      const gate = new Gate(stages, { name: "late-line", fuse: true });
      const line = stageKey(prefix, "gate:late-line|rate|sem", "line");
      const holder = await gate.admit({ timeoutMs: 5_000 });
      // Two callers in one turn: their tries go in one held-back call.
      const held = holdBack(main, "gate", lose);
      const errors = await within(
        Promise.all([
          rejectionOf(gate.admit({ timeoutMs: 5_000 })),
          rejectionOf(gate.admit({ timeoutMs: 5_000 })),
        ]),
        3_000,
        "two gate.admit() with their tries held back",
      );
      for (const error of errors)
        expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
      // Sent now: the semaphore is full, so each try takes its place in the permit line (inLine 1).
      const reply = (await held.send()) as unknown[][];
      expect(reply.map((r) => Number(r[2]))).toEqual([1, 1]);
      await until(async () => (await raw.zcard(line)) === 0, {
        timeoutMs: 3_000,
        message: "a caller a try run late put in the gate's line stayed there",
      });
      // The holder's release admits nobody that has gone: the permit is free for the next call.
      await holder.release("success");
      const ticket = await admittedSoon(gate, "the permit went to a caller that had gone");
      await ticket.release("success");
    });
  }

  // A waiter's next try run so may collect the grant a release made to its kept steps, after the
  // waiter gave up and its leave found nothing left to give back: the grant's permits and tokens
  // come back once the late reply says so, not when the grant's claim window ends.
  it("gives back the grant a fused gate's try collected when the client ran it after the caller failed closed", async () => {
    const server = await startServer(await freePort());
    const prefix = randomPrefix("outage-late-collect");
    // The holder's process and the waiter's, on one server; a grant unclaimed for a minute stays
    // held as long (claimMs), far longer than the test.
    const [holding, waiting] = await Promise.all([
      setup(server.url, prefix, 500, 60_000),
      setup(server.url, prefix, 500, 60_000),
    ]);
    const gateOf = (backend: Backend) =>
      new Gate(
        [
          // Two tokens, none back for an hour: the holder's, and the one granted to the waiter.
          backend.tokenBucket("rate", { capacity: 2, refillPerSecond: 1 / 3_600 }),
          backend.semaphore("sem", { limit: 1, leaseMs: 60_000 }),
        ],
        { name: "late-collect", fuse: true },
      );
    const [holderGate, waiterGate] = [gateOf(holding.backend), gateOf(waiting.backend)];
    const kept = stageKey(prefix, "gate:late-collect|rate|sem", "held");
    const holder = await holderGate.admit({ timeoutMs: 5_000 });
    const waiter = rejectionOf(waiterGate.admit({ timeoutMs: 30_000 }));
    await until(async () => (await holding.raw.hkeys(kept)).some((field) => field.startsWith("s:")), {
      timeoutMs: 5_000,
      message: "the waiter's steps were never kept in the gate's line",
    });
    // The waiter's process hears no grant (its subscriber reads nothing), and its client holds
    // back every gate call: its next try, then its leave once it has failed closed.
    waiting.subscriber.stream.pause();
    const held = holdBackAll(waiting.main, "gate");
    await holder.release("success");
    expect(await holding.raw.hkeys(kept)).toEqual(expect.arrayContaining([expect.stringMatching(/^g:/)]));
    const error = await within(waiter, 5_000, "the waiter's admit() with its calls held back");
    expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
    await until(() => held.count() >= 2, { timeoutMs: 3_000, message: "the waiter's leave was never sent" });
    // Sent in order: the try collects the grant (status 2), so the leave finds none to give back.
    const [tried] = (await held.sendAll()) as unknown[][][];
    expect(Number(tried![0]![0])).toBe(2);
    // The token must come back too (the refill brings none): the next call is admitted.
    await allBack(
      holding.raw,
      [stageKey(prefix, "sem", "holders")],
      holderGate,
      "a grant collected by a try run late",
    );
    waiting.subscriber.stream.resume();
  });

  // An interval gate's take run so claims a slot of nobody's: it is handed back while it is the
  // host's latest, as the caller's own refund would have been.
  it("hands back the slot an interval gate's take claimed when the client ran it after the caller failed closed", async () => {
    const { main, backend } = await onOwnServer("outage-late-host");
    const hosts = backend.intervalGate("hosts", { minIntervalMs: 3_600_000, defaultHost: "api.example" });
    // (It claims the host's slot, the next an hour away.)
    await ranLate(
      main,
      hosts,
      "interval-gate-take",
      "the slot claimed by a take that ran after its caller failed closed was not handed back",
    );
    // Used by a call that went, the slot stays claimed.
    expect(await hosts.tryAdmit()).toBeUndefined();
  });

  // A gate that spaces nothing asks for its line's first waiters in one take: run so, each slot it
  // claimed is handed back, latest first, leaving the host's slot as the pause left it.
  it("hands back the slots a turn of an interval gate's takes claimed when the client ran it after their callers failed closed", async () => {
    const { main, raw, backend, prefix } = await onOwnServer("outage-late-hosts");
    const hosts = backend.intervalGate("hosts", { minIntervalMs: 0, defaultHost: "api.example" });
    const key = stageKey(prefix, "hosts", "h:api.example");
    await hosts.pause("api.example", 400);
    const paused = await raw.hget(key, "nextAt");
    // The line's takes: its head's (refused: the others wait behind it), then all three's as the
    // pause ends, which is held back until its callers have failed closed.
    const commands = main as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
    const command = commandName("interval-gate-take");
    const take = commands[command]!.bind(main);
    let calls = 0;
    let send: (() => Promise<unknown>) | undefined;
    commands[command] = (...args: unknown[]) => {
      if (++calls < 2) return take(...args);
      commands[command] = take;
      return new Promise((resolve, reject) => {
        send = () => {
          const sent = take(...args);
          sent.then(resolve, reject);
          return sent;
        };
      });
    };
    const errors = await within(
      Promise.all([1, 2, 3].map(() => rejectionOf(hosts.admit({ timeoutMs: 10_000 })))),
      5_000,
      "three admit() with their take held back",
    );
    for (const error of errors)
      expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
    expect(send, "no turn's take was held back").toBeDefined();
    const replies = (await send!()) as unknown[][];
    // (Each claimed the host's slot after the pause: what must go back.)
    expect(replies.map((r) => Number(r[0]))).toEqual([1, 1, 1]);
    await until(async () => (await raw.hget(key, "nextAt")) === paused, {
      timeoutMs: 3_000,
      message:
        "the slots claimed by a turn's takes run after their callers failed closed were not handed back",
    });
  });

  // A token bucket's take run so spends a token of nobody's: it is given back while it is the
  // key's latest grant, as the caller's own refund would have been.
  it("gives back the tokens a token bucket's take took when the client ran it after the caller failed closed", async () => {
    const { main, backend } = await onOwnServer("outage-late-bucket");
    const bucket = backend.tokenBucket("rate", { capacity: 1, refillPerSecond: 1 / 3_600 });
    await ranLate(
      main,
      bucket,
      "token-bucket-take",
      "the token taken by a take that ran after its caller failed closed was not given back",
    );
  });

  // A token bucket with classes asks its own script: a try run so gives its tokens back the same
  // way, and so does a waiting caller's ask, which its caller had left by then.
  it("gives back the tokens a bucket with classes granted to a try the client ran after the caller failed closed", async () => {
    const { main, backend } = await onOwnServer("outage-late-classes-try");
    const bucket = oneToken(backend);
    await ranLate(
      main,
      bucket,
      "token-bucket-classes",
      "the token granted to a try that ran late was not given back",
    );
  });

  it("gives back the tokens a bucket with classes granted to an ask the client ran after its caller failed closed", async () => {
    const { main, backend } = await onOwnServer("outage-late-classes-ask");
    const bucket = oneToken(backend);
    // (The token is there, so the ask takes it for its member, whose caller has gone.)
    await ranLate(
      main,
      bucket,
      "token-bucket-classes",
      "the token granted to an ask that ran late was not given back",
      () => bucket.admit({ timeoutMs: 2_000 }),
    );
  });

  it("takes out of line the member an ask of a bucket with classes put there when the client ran it after its caller failed closed", async () => {
    const { prefix, main, raw, backend } = await onOwnServer("outage-late-classes-line");
    const bucket = oneToken(backend);
    const taken = await bucket.admit();
    const held = holdBack(main, "token-bucket-classes");
    const error = await within(
      rejectionOf(bucket.admit({ timeoutMs: 2_000 })),
      3_000,
      "admit() with its ask held back",
    );
    expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
    // Sent now: no token, so it puts its member in line, for a caller that has gone.
    expect(Number(((await held.send()) as unknown[])[0])).toBe(0);
    await until(async () => (await raw.zcard(stageKey(prefix, "rate", "cq:default"))) === 0, {
      timeoutMs: 3_000,
      message: "the member an ask run late put in line stayed there",
    });
    // The token a refund brings back goes to the bucket, not to that member.
    await taken.refund();
    const ticket = await admittedSoon(bucket, "the refunded token went to a member whose caller had gone");
    await ticket.release("success");
  });

  // A turn's takes go in one take-many: one stretch of the key's line. While the last that took
  // is the key's latest grant, every take's tokens come back (one refund of their sum); a take
  // that took nothing gives nothing back.
  it.each([
    { capacity: 2, taken: [1, 1], back: 2, left: "both tokens come back" },
    { capacity: 3, taken: [1, 1], back: 2, left: "two of three come back, one was never taken" },
    { capacity: 1, taken: [1, 0], back: 1, left: "the second took nothing" },
  ])(
    "gives back every token of a turn's takes the client ran after their callers failed closed (capacity $capacity: $left)",
    async ({ capacity, taken, back }) => {
      const { main, backend } = await onOwnServer("outage-late-takes");
      const bucket = backend.tokenBucket("rate", { capacity, refillPerSecond: 1 / 3_600 });
      // (With three tokens, one is taken first, by a caller that keeps it.)
      const kept = capacity === 3 ? await bucket.tryAdmit() : undefined;
      if (capacity === 3) expect(kept).toBeDefined();
      const held = holdBack(main, "token-bucket-take-many");
      const errors = await within(
        Promise.all([rejectionOf(bucket.tryAdmit()), rejectionOf(bucket.tryAdmit())]),
        3_000,
        "two tryAdmit() in one turn with their takes held back",
      );
      for (const error of errors)
        expect(isFloodgateError(error, "BACKEND_UNAVAILABLE"), String(error)).toBe(true);
      // Sent now (three figures each, taken first).
      const replies = (await held.send()) as unknown[];
      expect([Number(replies[0]), Number(replies[3])]).toEqual(taken);
      const tickets = [await admittedSoon(bucket, "the turn's tokens were not given back")];
      for (let i = 1; i < back; i++) {
        const ticket = await bucket.tryAdmit();
        expect(ticket, `token ${i + 1} of the ${back} the turn took did not come back`).toBeDefined();
        tickets.push(ticket!);
      }
      // No more than the turn took: the token kept before it stays spent.
      expect(await bucket.tryAdmit()).toBeUndefined();
      for (const ticket of tickets) await ticket.release("success");
      await kept?.release("success");
    },
  );

  it("gives back a permit granted after its caller stopped waiting while Redis was frozen", async () => {
    const port = await freePort();
    const server = await startServer(port);
    const prefix = randomPrefix("outage-gaveup");
    const { raw, backend } = await setup(server.url, prefix);
    const sem = backend.semaphore("sem", { limit: 1, leaseMs: 30_000 });

    server.child!.kill("SIGSTOP");
    // The caller's own timeout (100 ms) runs out before the command's (300 ms).
    const error = await within(
      rejectionOf(sem.admit({ timeoutMs: 100 })),
      3_000,
      "admit({ timeoutMs: 100 })",
    );
    expect(isFloodgateError(error, "ADMIT_TIMEOUT")).toBe(true);
    await new Promise((resolve) => setTimeout(resolve, COMMAND_TIMEOUT_MS * 2)); // the command times out too
    server.child!.kill("SIGCONT");

    await until(async () => (await raw.zcard(stageKey(prefix, "sem", "holders"))) === 0, {
      timeoutMs: 3_000,
      message:
        "a permit granted after its caller gave up stayed held (it would block the stage for the whole leaseMs)",
    });
    const ticket = await sem.tryAdmit();
    expect(ticket).toBeDefined();
    await ticket!.release("success");
  });
});
