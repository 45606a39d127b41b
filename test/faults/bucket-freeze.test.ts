import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { redis } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterEach, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { BUCKET_CLASSES } from "../redis/fixtures/fixture.js";
import { Child, closeClient, connectedClient, randomPrefix, sleep } from "../redis/helpers.js";

const RATE = 10;
const CAPACITY = 4;
/**
 * Tokens of slack in the replay: a request's way from its admission to the provider (an event
 * loop held up on a busy two-core machine bunches arrivals). Measured: a third of a token at
 * most; with the resumed process sending its overdue calls at once, the replay went 3 below zero.
 */
const SLACK_TOKENS = 1.5;

/**
 * A process whose callers hold places in a Redis token bucket's line is frozen (SIGSTOP) past
 * their time, then resumed, while another keeps calling: a local provider replays every request
 * it received through a bucket of the same shape. A caller that wakes too late for its place
 * asks again rather than go, so the resumed process does not send its overdue calls at once.
 *
 * The same with classes (the frozen process's callers bulk, the live one's interactive): there
 * the frozen callers wait in their class's line, grants made to them while frozen come too late
 * to be taken (they ask again), and a killed process's callers leave the line once its sign of
 * life has lapsed.
 */
describe.each([
  { name: "without classes", classes: false },
  { name: "with classes", classes: true },
])("a Redis token bucket's caller process frozen with callers waiting, $name", ({ classes }) => {
  const clients: Redis[] = [];
  const children: Child[] = [];
  let server: Server | undefined;
  afterEach(async () => {
    for (const child of children) child.process.kill("SIGCONT");
    await Promise.all(children.splice(0).map((child) => child.kill()));
    await Promise.all(clients.splice(0).map(closeClient));
    await new Promise<void>((resolve) => (server ? server.close(() => resolve()) : resolve()));
  });

  /**
   * The scenario: a child process with 6 callers and this one with 2 share the bucket; at 1.5 s
   * the child is `fault`ed (frozen for 1.5 s, or killed). Returns what the provider replayed.
   */
  async function run(fault: "freeze" | "kill") {
    const arrivals: number[] = [];
    server = createServer((_req, res) => {
      arrivals.push(performance.now());
      res.end("ok");
    });
    await new Promise<void>((resolve) => server!.listen(0, "127.0.0.1", resolve));
    const provider = `http://127.0.0.1:${(server.address() as AddressInfo).port}/`;
    const prefix = randomPrefix(`faults-bucket-${fault}${classes ? "-classes" : ""}`);
    const endAt = Date.now() + 6_000;
    const child = new Child("bucket-caller.ts", {
      REDIS_URL: redisUrl(),
      PREFIX: prefix,
      PROVIDER: provider,
      CALLERS: "6",
      RATE: String(RATE),
      CAPACITY: String(CAPACITY),
      END_AT: String(endAt),
      ...(classes ? { CLASS: "bulk" } : {}),
    });
    children.push(child);
    await child.message("ready", 15_000);

    const client = await connectedClient(redisUrl());
    clients.push(client);
    const backend = redis(client, { prefix });
    const bucket = backend.tokenBucket("rate", {
      capacity: CAPACITY,
      refillPerSecond: RATE,
      ...(classes ? { classes: BUCKET_CLASSES } : {}),
    });
    const call = classes ? { class: "interactive" } : {};
    let ours = 0;
    const callers = Array.from({ length: 2 }, async () => {
      while (Date.now() < endAt) {
        await bucket.admit(call);
        if (Date.now() >= endAt) break;
        await (await fetch(provider)).text();
        ours++;
      }
    });
    // At fault time its callers hold places (8 callers at 10 a second: each waits about 0.8 s).
    await sleep(1_500);
    const faultAt = performance.now();
    if (fault === "freeze") {
      child.process.kill("SIGSTOP");
      await sleep(1_500);
      child.process.kill("SIGCONT");
    } else {
      await child.kill();
    }
    await Promise.all(callers);
    const theirs = fault === "freeze" ? Number((await child.message("done", 15_000)).sent) : undefined;
    await backend.close();

    // Every request replayed through a bucket of the same shape, full at the start, with
    // SLACK_TOKENS for the way from admission to the provider.
    arrivals.sort((a, b) => a - b);
    let level = CAPACITY;
    let at = arrivals[0]!;
    let lowest = level;
    for (const t of arrivals) {
      level = Math.min(CAPACITY, level + ((t - at) * RATE) / 1000) - 1;
      at = t;
      lowest = Math.min(lowest, level);
    }
    const afterFault = arrivals.filter((t) => t > faultAt + 2_000).length;
    return { arrivals, ours, theirs, lowest, afterFault, seconds: (arrivals.at(-1)! - arrivals[0]!) / 1000 };
  }

  it("SIGSTOP past its callers' time, then SIGCONT: the provider never sees more than the bucket allows", async () => {
    const r = await run("freeze");
    console.log(
      `token bucket ${RATE}/s, capacity ${CAPACITY}${classes ? " with classes" : ""}, a caller process frozen 1.5 s with callers waiting: ` +
        `${r.arrivals.length} requests (${r.ours} from the live process, ${r.theirs} from the frozen one) ` +
        `in ${r.seconds.toFixed(1)} s; lowest replayed level ${r.lowest.toFixed(2)} tokens`,
    );
    expect(r.lowest).toBeGreaterThanOrEqual(-SLACK_TOKENS);
    expect(r.theirs).toBeGreaterThan(0);
    expect(r.arrivals.length).toBe(r.ours + r.theirs!);
  });

  it("SIGKILL with its callers' places reserved: they go unused, the cap holds, and the live process goes on", async () => {
    const r = await run("kill");
    console.log(
      `token bucket ${RATE}/s, capacity ${CAPACITY}${classes ? " with classes" : ""}, a caller process killed with callers waiting: ` +
        `${r.arrivals.length} requests in ${r.seconds.toFixed(1)} s; lowest replayed level ` +
        `${r.lowest.toFixed(2)} tokens; ${r.afterFault} requests from 2 s after the kill on ` +
        `(the live process alone, at the bucket's rate: ${(r.afterFault / 2.5).toFixed(1)}/s)`,
    );
    expect(r.lowest).toBeGreaterThanOrEqual(-SLACK_TOKENS);
    // From 2 s after the kill the dead process's places have passed: the live one has the rate.
    expect(r.afterFault).toBeGreaterThanOrEqual(Math.floor(RATE * 2.5 * 0.5));
  });
});
