/**
 * The first pass of a gate call (lua/gate-first.lua) decides exactly as the rest of the script
 * would have: over seeded random sequences of tries (alone and in bursts), releases with every
 * outcome, refunds, settles and clock steps, every script call a fused gate made is run again,
 * in the same order, on keys of their own through the gate script without its first pass; each
 * reply and the whole state left in Redis must be the same.
 */
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { Gate, type Ticket } from "floodgate";
import { redis } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import type { Redis } from "ioredis";
import { describe, expect, it } from "vitest";
import { scriptSha, scriptSource } from "../../src/redis/scripts.js";
import { useClients } from "./clients.js";
import { ROOT, randomPrefix, scriptsKnowVersion, seeded, until, within } from "./helpers.js";

/**
 * The gate script as it was before its first pass: the same text with that pass left out, but
 * for the call it hands on decoded (none: the rest decodes every call itself).
 */
const FIRST = readFileSync(join(ROOT, "lua", "gate-first.lua"), "utf8");
const WITHOUT_FIRST = scriptSource("gate").replace(FIRST, "local gate_first_calls = nil\n");

/**
 * `source` with each key's expiry also written down: every PEXPIRE made (by the gate itself or a
 * step) also sets the key's field of `<the gate's line>:ttls` to the ms it was given, and each
 * script call that sets it counts itself once in the key's field there after a "#", so that two
 * replays' states compare expiries too, exactly (read back, a key's time to live has moved on),
 * and in which calls each was set. (Once per call: the calls of a turn share one instant, so the
 * first pass sets an expiry once for a turn where the rest sets the same one call after call.)
 */
function withTtls(source: string): string {
  const calls = source.split("redis.call('PEXPIRE', ");
  expect(calls.length, "the script sets expiries").toBeGreaterThan(5);
  return (
    "local floodgate_ttl_set = {}\n" +
    "local function floodgate_ttl_of(key, ttl)\n" +
    "  redis.call('HSET', KEYS[1] .. ':ttls', key, ttl)\n" +
    "  if not floodgate_ttl_set[key] then\n" +
    "    floodgate_ttl_set[key] = true\n" +
    "    redis.call('HINCRBY', KEYS[1] .. ':ttls', '#' .. key, 1)\n" +
    "  end\n" +
    "  return redis.call('PEXPIRE', key, ttl)\n" +
    "end\n" +
    calls.join("floodgate_ttl_of(")
  );
}

/** The gate script whose first pass answers "handed" for a release it hands on to a waiter itself. */
const HANDED = "  return { { 1, -1, 0, { message }, replies } }\n";
const SAYS_HANDED = scriptSource("gate").replace(HANDED, "  do return 'handed' end\n");

/** The gate script whose first pass answers "joined" for a first try it puts behind the line's first. */
const JOINED =
  "    out[c] = { 0, -1, 1, 0, replies, gate_first_calls[c][2] == 'hold' and 1 or 0, now, passed, key }\n";
const SAYS_JOINED = scriptSource("gate").replace(JOINED, "    do return 'joined' end\n");

/** The gate script whose first pass answers "laned" for a first try it puts at the back of a lane. */
const LANED = "  return { reply }\n";
const SAYS_LANED = scriptSource("gate").replace(LANED, "  do return 'laned' end\n");

/** The gate script whose first pass answers "left" for a lane's first it admits. */
const LEFT = "  return { { 1, -1, 0, woken, floodgate_admitted(names, flat, now), 0, now } }\n";
const SAYS_LEFT = scriptSource("gate").replace(LEFT, "  do return 'left' end\n");
for (const [what, whole] of [
  ["LANED", LANED],
  ["LEFT", LEFT],
  ["JOINED", JOINED],
  ["HANDED", HANDED],
] as const) {
  if (!scriptSource("gate").includes(whole)) throw new Error(`${what} is no longer in the gate script`);
}

/** One command a client sent, with the reply Redis gave it. */
interface Sent {
  name: string;
  args: string[];
  reply: unknown;
}

/** Every command sent on `client` from now on, with its reply, in the order Redis ran them. */
function record(client: Redis): Sent[] {
  const sent: Sent[] = [];
  const send = client.sendCommand.bind(client);
  (client as any).sendCommand = (command: any, ...rest: any[]) => {
    const entry: Sent = { name: "", args: [], reply: undefined };
    sent.push(entry);
    // (Read once answered: ioredis turns a script's first EVALSHA on a connection into EVAL as
    // it writes it.)
    const answered = (reply: unknown) => {
      entry.name = String(command.name).toLowerCase();
      entry.args = command.args.map((a: unknown) => String(a));
      entry.reply = reply;
    };
    const result = send(command, ...(rest as [undefined]));
    command.promise.then(answered, (error: unknown) => answered({ error: String(error) }));
    return result;
  };
  return sent;
}

/**
 * The first script call in `sent` from `from` on, once its reply has been read: what it did can
 * show on another connection (a line's length, say) before this one reads that reply.
 */
function scriptCallFrom(sent: readonly Sent[], from: number): Promise<Sent> {
  return until(() => sent.slice(from).find((x) => x.name === "evalsha" || x.name === "eval"), {
    timeoutMs: 5_000,
    message: "the script call's reply",
  });
}

/** Every key under `prefix` and what it holds (its name and content with `prefix` taken out). */
async function state(client: Redis, prefix: string): Promise<Record<string, unknown>> {
  const keys = (await client.keys(`${prefix}*`)).sort();
  const out: Record<string, unknown> = {};
  for (const key of keys) {
    const type = await client.type(key);
    const value =
      type === "hash"
        ? await client.hgetall(key)
        : type === "zset"
          ? await client.zrange(key, 0, -1, "WITHSCORES")
          : type === "string"
            ? await client.get(key)
            : type;
    out[key.slice(prefix.length)] = JSON.parse(JSON.stringify(value).replaceAll(prefix, "<p>"));
  }
  return out;
}

/**
 * The script calls of `sent` before the one at `at` run again on `client`, in order, on keys of
 * their own (`prefix` made `own`).
 */
async function replayBefore(client: Redis, sent: Sent[], at: number, prefix: string, own: string) {
  for (const { name, args } of sent.slice(0, at)) {
    if (name !== "evalsha" && name !== "eval") continue;
    // (A first call of a script goes as EVAL: it runs here as EVALSHA of the same text.)
    const digest = name === "eval" ? ((await client.script("LOAD", args[0]!)) as string) : args[0]!;
    await client.call("EVALSHA", digest, ...args.slice(1).map((a) => a.replaceAll(prefix, own)));
  }
}

/**
 * `again`, commands recorded (plain ones run as they were, script calls by their digest, the
 * gate's through `sha`), run again on `replay` in order, on keys of their own (`prefix` made
 * `own`), `before(at)` awaited ahead of the one at `at`. Returns each reply as JSON, `own` written
 * "<p>" ("" for a plain command).
 */
async function rerun(
  replay: Redis,
  again: readonly Sent[],
  prefix: string,
  own: string,
  sha: string,
  before?: (at: number) => Promise<void>,
): Promise<string[]> {
  const gateSha = scriptSha("gate");
  const replies: string[] = [];
  for (const [at, { name, args }] of again.entries()) {
    await before?.(at);
    if (name !== "evalsha" && name !== "eval") {
      await replay.call(name, ...args.map((x) => x.replaceAll(prefix, own)));
      replies.push("");
      continue;
    }
    let digest = name === "eval" ? ((await replay.script("LOAD", args[0]!)) as string) : args[0]!;
    if (digest === gateSha) digest = sha;
    const reply = await replay
      .call("EVALSHA", digest, ...args.slice(1).map((x) => x.replaceAll(prefix, own)))
      .catch((e: unknown) => ({ error: String(e) }));
    replies.push(JSON.stringify(reply).replaceAll(own, "<p>"));
  }
  return replies;
}

/**
 * `replayed` run through the whole gate script and through the script without its first pass,
 * each writing its expiries down (`withTtls`): the same reply (its own prefix aside) and the same
 * state, expiries included. Returns the first's.
 */
async function alike<T extends { reply: unknown; state: unknown; own: string }>(
  client: Redis,
  replayed: (sha: string) => Promise<T>,
): Promise<T> {
  const general = (await client.script("LOAD", withTtls(WITHOUT_FIRST))) as string;
  const whole = await replayed((await client.script("LOAD", withTtls(scriptSource("gate")))) as string);
  const rest = await replayed(general);
  expect(JSON.stringify(whole.reply).replaceAll(whole.own, "<p>")).toBe(
    JSON.stringify(rest.reply).replaceAll(rest.own, "<p>"),
  );
  expect(whole.state).toEqual(rest.state);
  return whole;
}

/**
 * A gate call's calls (its ARGV from the sixth on) as lists of fields: a call that came as its
 * name alone, the repeat before it with that name wherever that one had its own (lua/gate.lua).
 */
function decoded(argv: readonly string[]): string[][] {
  const calls: string[][] = [];
  for (const arg of argv) {
    if (arg.startsWith("[")) calls.push(JSON.parse(arg) as string[]);
    else {
      const before = calls[calls.length - 1]!;
      calls.push(before.map((f) => (f === before[0] ? arg : f)));
    }
  }
  return calls;
}

/**
 * A four-stage gate with room for all (a bucket, an interval gate, a semaphore, an AIMD limiter)
 * on `client`, every command recorded, its script loaded by a first call; then `size` tries at one
 * instant, every one admitted.
 */
async function roomyGate(client: Redis, label: string, size: number) {
  const clock = new FakeClock(10_000);
  const prefix = randomPrefix(label);
  const sent = record(client);
  const b = redis(client, { prefix, clock, time: "clock" });
  const gate = new Gate(
    [
      b.tokenBucket("rpm", { capacity: 100, refillPerSecond: 10 }),
      b.intervalGate("hosts", { minIntervalMs: 0 }),
      b.semaphore("inflight", { limit: 20 }),
      b.aimd("adaptive", { initial: 10, max: 20 }),
    ],
    { clock },
  );
  // (A first call loads the script: the turn then goes as EVALSHA.)
  await (await gate.admit({ host: "x" })).release("success");
  const tickets = await Promise.all(Array.from({ length: size }, () => gate.tryAdmit({ host: "x" })));
  expect(tickets.every((t) => t !== undefined)).toBe(true);
  return { prefix, client, sent, b, tickets };
}

describe("the first pass of a gate call", () => {
  const { connect } = useClients();

  // (Seeds 7 and 8 leave room enough for whole turns to be admitted.)
  for (const seed of [1, 2, 3, 4, 5, 6, 7, 8]) {
    it(`decides every call as the rest of the script would (seed ${seed})`, async () => {
      const rnd = seeded(seed);
      const clock = new FakeClock(seed % 2 === 0 ? -5_000 : 10_000);
      const prefix = randomPrefix("first");
      const again = randomPrefix("again");
      const client = await connect();
      const sent = record(client);
      const b = redis(client, { prefix, clock, time: "clock" });
      const roomy = seed > 6;
      const tight = !roomy && seed % 3 !== 0;
      const gate = new Gate(
        [
          b.tokenBucket("rpm", { capacity: tight ? 6 : roomy ? 400 : 40, refillPerSecond: tight ? 5 : 30 }),
          b.intervalGate("hosts", { minIntervalMs: tight ? 60 : 0, jitterMs: tight ? 20 : 0 }),
          b.semaphore("inflight", { limit: tight ? 3 : roomy ? 80 : 8 }),
          b.aimd("adaptive", {
            initial: roomy ? 60 : 3,
            min: roomy ? 40 : 1,
            max: roomy ? 80 : 6,
            backoffRatio: 0.5,
            slowCallMs: 150,
          }),
          b.tokenBucket("tpm", { keyed: true, capacity: roomy ? 2000 : 50, refillPerSecond: 40 }),
        ],
        { clock },
      );
      expect(gate.fused).toBe(true);
      const open: Ticket[] = [];
      let admitted = 0;
      let refused = 0;
      for (let step = 0; step < 300; step++) {
        const r = rnd();
        if (r < 0.45) {
          // Mostly one call alone; now and then a burst of up to five, whose calls share their
          // key and host (a turn the first pass decides whole) or each pick their own.
          const many = rnd() < 0.65 ? 1 : 2 + Math.floor(rnd() * 4);
          const alike = rnd() < 0.6;
          // (Calls alike in their costs too differ in their names alone: from the third on, each
          // goes as its name.)
          const same = alike && rnd() < 0.5 ? 1 + Math.floor(rnd() * 29) : 0;
          const key = rnd() < 0.5 ? "a" : "b";
          const host = rnd() < 0.5 ? "x" : "y";
          const tickets = await Promise.all(
            Array.from({ length: many }, () =>
              gate.tryAdmit({
                costs: same
                  ? { rpm: 1, tpm: same, inflight: 1 }
                  : {
                      rpm: 1 + Math.floor(rnd() * 2),
                      // (A cost of 0 leaves the step out: such a call repeats no other.)
                      tpm: alike ? 1 + Math.floor(rnd() * 29) : Math.floor(rnd() * 30),
                      inflight: rnd() < 0.2 ? 2 : 1,
                    },
                key: alike ? key : rnd() < 0.5 ? "a" : "b",
                host: alike ? host : rnd() < 0.5 ? "x" : "y",
              }),
            ),
          );
          for (const t of tickets) {
            if (t) {
              open.push(t);
              admitted++;
            } else refused++;
          }
        } else if (r < 0.62 && open.length > 1) {
          // A burst of releases at once, each with its outcome (a turn's, one step per stage).
          const many = Math.min(open.length, 2 + Math.floor(rnd() * 4));
          const burst = open.splice(0, many);
          await Promise.all(
            burst.map((t) => {
              const how = rnd();
              return t.release(how < 0.2 ? "dropped" : how < 0.3 ? "ignored" : "success");
            }),
          );
        } else if (r < 0.8 && open.length > 0) {
          const t = open.splice(Math.floor(rnd() * open.length), 1)[0]!;
          const how = rnd();
          if (how < 0.1) await t.refund();
          else if (how < 0.2) {
            await t.settle({ tpm: Math.floor(rnd() * 40) });
            await t.release("success");
          } else await t.release(how < 0.4 ? "dropped" : how < 0.5 ? "ignored" : "success");
        } else {
          await clock.advance(Math.floor(rnd() * 250));
        }
      }
      for (const t of open) await t.release("success");
      expect(admitted).toBeGreaterThan(10);
      expect(refused).toBeGreaterThan(tight ? 5 : -1);

      // Every command again, in order, on keys of their own, the gate's through the script
      // without its first pass (loaded under its own digest): the same replies and state. Then
      // again through the whole script: the same expiries too (both write them down: withTtls).
      const replay = await connect();
      const original = await state(replay, prefix);
      const gateSha = scriptSha("gate");
      let firstAdmits = 0;
      let firstReleases = 0;
      let firstTurns = 0;
      let releaseTurns = 0;
      let named = 0;
      const replayAll = async (gateScript: string, own: string, count: boolean) => {
        const digest = (await replay.script("LOAD", gateScript)) as string;
        for (const { name, args, reply } of sent) {
          if (name !== "evalsha" && name !== "eval") continue;
          let sha = args[0]!;
          if (name === "eval") {
            sha = createHash("sha1").update(sha).digest("hex");
            await replay.script("LOAD", args[0]!);
          }
          if (sha === gateSha) {
            sha = digest;
            const argv = args.slice(2 + Number(args[1]));
            const turn = Number(argv[4]);
            if (count) {
              // (A lone admission admitted, or a lone release, while nobody waits anywhere: the
              // first pass's to decide.)
              if (argv[4] === "1" && argv[1] === "all" && (reply as unknown[])[0] === 1) firstAdmits++;
              // (A turn of admissions all admitted at once, each call repeating the one before it.)
              if (
                argv[1] === "all" &&
                turn > 1 &&
                (reply as unknown[]).slice(0, turn).every((r) => r === 1) &&
                decoded(argv.slice(5, 5 + turn))
                  .slice(1)
                  .every((call) => call[4] === "*")
              )
                firstTurns++;
              // (Calls that went as their names alone, admitted or not.)
              if (argv[1] === "all")
                named += argv.slice(5, 5 + turn).filter((c) => !c.startsWith("[")).length;
              if (
                argv[4] === "1" &&
                argv[1] === "each" &&
                /^\["\w+","try","","","[12]","(aimd|semaphore)-release"/.test(argv[5]!)
              ) {
                firstReleases++;
                // (A turn's releases of a stage as one step: more arguments than one release has.)
                const sizes = [...argv[5]!.matchAll(/"(aimd|semaphore)-release","5","(\d+)"/g)];
                if (sizes.some((m) => Number(m[2]) > (m[1] === "aimd" ? 13 : 8))) releaseTurns++;
              }
            }
          }
          const rest = args.slice(1).map((a) => a.replaceAll(prefix, own));
          const answer = await replay
            .call("EVALSHA", sha, ...rest)
            .catch((e: unknown) => ({ error: String(e) }));
          expect(
            JSON.stringify(answer).replaceAll(own, prefix),
            `${JSON.stringify(args).slice(0, 200)}`,
          ).toBe(JSON.stringify(reply));
        }
        return state(replay, own);
      };
      const rest = await replayAll(withTtls(WITHOUT_FIRST), again, true);
      const whole = await replayAll(withTtls(scriptSource("gate")), randomPrefix("again"), false);
      expect(firstAdmits).toBeGreaterThan(10);
      if (roomy) expect(firstTurns).toBeGreaterThan(5);
      expect(named, "calls that went as their names").toBeGreaterThan(5);
      expect(releaseTurns).toBeGreaterThan(roomy ? 10 : 1);
      expect(firstReleases).toBeGreaterThan(10);
      expect(whole).toEqual(rest);
      const ttls = Object.keys(rest).find((key) => key.endsWith(":line:ttls"));
      expect(ttls, "the replays wrote their expiries down").toBeDefined();
      const { [ttls!]: written, ...kept } = rest as Record<string, unknown>;
      // The replay's state is the run's: every key both have, the same; a key only one of them
      // has is one the replay wrote an expiry for, which ran out in real time in one and not yet
      // in the other (a token bucket's, a host's: their expiries are real milliseconds, and the
      // run, waiting for each call, takes longer than its replay).
      const expiring = new Set(
        Object.keys(written as Record<string, string>).map((k) => k.replace("<p>", "")),
      );
      for (const key of new Set([...Object.keys(original), ...Object.keys(kept)])) {
        if (key in original && key in kept) expect(kept[key], key).toEqual(original[key]);
        else expect(expiring.has(key), `${key}: in one state only, with no expiry`).toBe(true);
      }
      await b.close();
    });
  }

  // A call may go as its name alone only after a repeat: as the first call, or after a call sent
  // whole, it is refused with nothing written, by the first pass and by the rest alike.
  for (const [how, calls] of [
    ["the first call", ["0abc-1"]],
    ["after a call sent whole", ['["0abc-1","try","1","","0"]', "0abc-2"]],
  ] as const) {
    it(`refuses a call that goes as its name ${how}, writing nothing`, async () => {
      const client = await connect();
      const own = randomPrefix("first-named");
      const keys = ["line", "lexp", "gmeta", "held", "hexp", "lane:", "lexp:"].map((k) => `${own}{g}:${k}`);
      const argv = ["", "all", "3000", `${own}{g}:gwake`, String(calls.length), ...calls];
      for (const script of [scriptSource("gate"), WITHOUT_FIRST]) {
        await expect(client.eval(script, keys.length, ...keys, ...argv)).rejects.toThrow(
          /gate: a call comes as a name with no repeat before it/,
        );
      }
      expect(await client.keys(`${own}*`)).toEqual([]);
    });
  }

  // A turn whose leases are not all new goes on whole, with nothing written: the rest then takes
  // its leases one by one and counts one that is there already once (as a stage's script does).
  // (A lone call whose lease is there already is decided by the first pass itself, its lease not
  // counted again, as the rest decides it.)
  for (const [how, size] of [
    ["a lease of it is held already", 3],
    ["a lease comes twice in it", 3],
    ["a lease of it is held already", 1],
  ] as const) {
    const title =
      size === 1
        ? "decides a lone call whose lease is held already as the rest would, counting it once"
        : `sends a turn of alike calls on to the rest, writing nothing, when ${how}`;
    it(title, async () => {
      const { prefix, client, sent, b, tickets } = await roomyGate(await connect(), "first-turn", size);
      const gateSha = scriptSha("gate");
      const argvOf = (args: string[]) => args.slice(2 + Number(args[1]));
      const at = sent.findIndex(
        ({ name, args }) =>
          name === "evalsha" &&
          args[0] === gateSha &&
          argvOf(args)[1] === "all" &&
          argvOf(args)[4] === String(size),
      );
      expect(at, "the tries went as one script call").toBeGreaterThanOrEqual(0);
      const turn = sent[at]!;
      const calls = decoded(argvOf(turn.args).slice(5));
      expect(calls.slice(1).every((c) => c[4] === "*")).toBe(true);
      // From the third on, each goes as its name alone.
      for (const c of argvOf(turn.args).slice(7)) expect(c).toMatch(/^[0-9a-f]+-\d+$/);
      expect(turn.reply).toEqual([...tickets.map(() => 1), expect.any(Array)]);
      // The semaphore's lease of call 2, or of the lone call: a first try's leases take its
      // name. (A call's steps: the bucket's, the host's, then the semaphore's; a repeat's own
      // arguments: the bucket's three, the host's one, then the semaphore's lease.)
      const lease = (c: string[]) => (c[4] === "*" ? 9 : c.indexOf("semaphore-acquire") + 3);
      const first = calls[size === 1 ? 0 : 1]!;
      const second = first[lease(first)]!;
      expect(second).toBe(first[0]);

      // Each script call before the turn again, on keys of their own, then the turn (changed so),
      // through the whole script and through the script without its first pass.
      const replayed = async (sha: string) => {
        const own = randomPrefix("first-turn-again");
        await replayBefore(client, sent, at, prefix, own);
        const args = turn.args.map((a) => a.replaceAll(prefix, own));
        const holders = `${own}{inflight}:holders`;
        if (how === "a lease of it is held already") {
          await client.zadd(holders, 60_000 + 10_000, second);
          await client.hincrby(`${own}{inflight}:meta`, "used", 1);
        } else {
          // (Call 3's semaphore lease made call 2's, the call sent whole.)
          const third = 2 + Number(args[1]) + 5 + 2;
          const fields = [...calls[2]!];
          fields[lease(fields)] = second;
          args[third] = JSON.stringify(fields);
        }
        const reply = await client.call("EVALSHA", sha, ...args.slice(1));
        const [members, used] = await Promise.all([
          client.zrange(holders, 0, -1),
          client.hget(`${own}{inflight}:meta`, "used"),
        ]);
        return { reply, members, used, state: await state(client, own), own };
      };
      const whole = await alike(client, replayed);
      // Each lease counted once: the count is the leases held (each of cost 1).
      expect(Number(whole.used)).toBe(whole.members.length);
      expect(whole.members).toContain(second);
      for (const t of tickets) await t!.release("success");
      await b.close();
    });
  }
  // A turn's releases of a stage's leases, given back in one go (one ZMSCORE, one ZREM), answer
  // and count as the rest would take them one by one: a lease no longer there (it ended and was
  // reaped) frees nothing, and one named twice frees once.
  for (const how of ["one of its leases is gone", "a lease comes twice in it"] as const) {
    it(`gives back a turn's releases as the rest would when ${how}`, async () => {
      const { prefix, client, sent, b, tickets } = await roomyGate(await connect(), "first-release", 4);
      await Promise.all(tickets.map((t, i) => t!.release(i === 1 ? "dropped" : "success")));
      const gateSha = scriptSha("gate");
      const argvOf = (args: string[]) => args.slice(2 + Number(args[1]));
      const at = sent.findLastIndex(
        ({ name, args }) => name === "evalsha" && args[0] === gateSha && argvOf(args)[1] === "each",
      );
      expect(at, "the releases went as one script call").toBeGreaterThanOrEqual(0);
      const turn = sent[at]!;
      const call = JSON.parse(argvOf(turn.args)[5]!) as string[];
      // Each stage's four leases as one step (a semaphore's release has 8 arguments alone).
      expect(call[5]).toBe("aimd-release");
      expect(call.indexOf("semaphore-release")).toBeGreaterThan(0);
      expect(call[call.indexOf("semaphore-release") + 2]).toBe(String(8 + 2 * 3));
      // Each stage's leases, where its step names them: its first lease after its first
      // arguments, each other's among its own (a member and what it gives back, "lease", for a
      // semaphore; a member, outcome, epoch and slow flag for an AIMD limiter).
      const leasesOf = (fields: string[], script: string) => {
        const at = fields.indexOf(script) + 3;
        const [first, own] = script === "semaphore-release" ? [7, 2] : [12, 4];
        const places = [at];
        for (let x = at + first; x < at + Number(fields[at - 1]) - 1; x += own) places.push(x);
        return places;
      };
      const stages = [
        { name: "inflight", script: "semaphore-release" },
        { name: "adaptive", script: "aimd-release" },
      ];

      // Each script call before the releases again, on keys of their own, then the releases
      // (changed so), through the whole script and through the script without its first pass.
      const replayed = async (sha: string) => {
        const own = randomPrefix("first-release-again");
        await replayBefore(client, sent, at, prefix, own);
        const args = turn.args.map((a) => a.replaceAll(prefix, own));
        const fields = JSON.parse(args[2 + Number(args[1]) + 5]!) as string[];
        for (const { name, script } of stages) {
          const places = leasesOf(fields, script);
          const mine = places.map((x) => fields[x]!);
          expect(mine).toEqual(tickets.map(() => expect.stringMatching(/^[0-9a-f]+-\d+$/)));
          expect(new Set(mine).size).toBe(4);
          if (how === "one of its leases is gone") {
            // (Its lease ended and a try reaped it: out of the holders, its permit counted no more.)
            await client.zrem(`${own}{${name}}:holders`, mine[2]!);
            await client.hincrby(`${own}{${name}}:meta`, "used", -1);
          } else fields[places[2]!] = mine[1]!;
        }
        args[2 + Number(args[1]) + 5] = JSON.stringify(fields);
        const reply = await client.call("EVALSHA", sha, ...args.slice(1));
        const counts = [];
        for (const { name } of stages) {
          counts.push({
            held: await client.zcard(`${own}{${name}}:holders`),
            used: Number(await client.hget(`${own}{${name}}:meta`, "used")),
          });
        }
        return { reply, counts, state: await state(client, own), own };
      };
      const whole = await alike(client, replayed);
      // Every lease given back freed its permit once: a lease still held is the one left out of
      // the turn (named twice, its neighbour's instead), still counted.
      const left = how === "one of its leases is gone" ? 0 : 1;
      expect(whole.counts).toEqual(stages.map(() => ({ held: left, used: left })));
      await b.close();
    });
  }
  // A lone release while callers wait in the gate's permit line: the first pass hands its
  // permits to the first waiter itself (first_handoff) when nothing else is in the way, exactly as
  // the rest would (its reply, its grant message, the state left), both when the next waiter then
  // waits for a permit stage left full and when nobody is next. When the release leaves room for
  // the next waiter too (it frees two permits, or a dead holder's lease there has ended), it goes
  // on to the rest, which admits both; and so when the next waiter takes no permit at the stages
  // the grant leaves full (a cost of 0 there: none of its kept steps is theirs). When the next
  // waiter's process no longer listens (its steps kept, its subscription gone), it goes on to the
  // rest too, which passes that waiter over.
  for (const how of [
    "one permit",
    "one permit, its lease ended",
    "one permit, the next waiter's process not listening",
    "one permit, the next waiter taking none",
    "two permits",
    "a dead holder's lease ended",
  ] as const) {
    it(`hands a release's permits to the first waiter as the rest would (${how})`, async () => {
      const roomy = !how.startsWith("one permit");
      const clock = new FakeClock(10_000);
      const prefix = randomPrefix("first-handoff");
      const client = await connect();
      const sent = record(client);
      // Three processes' gates (each its own token and wake channel) on one connection, so that
      // what they sent is recorded in the order Redis ran it.
      const gates = [0, 1, 2].map(() => {
        const b = redis(client, { prefix, clock, time: "clock" });
        return {
          b,
          gate: new Gate(
            [
              b.tokenBucket("rpm", { capacity: 100, refillPerSecond: 10 }),
              b.tokenBucket("tpm", { capacity: 10_000, refillPerSecond: 1_000 }),
              b.semaphore("inflight", { limit: roomy ? 2 : 1 }),
              b.aimd("adaptive", { initial: roomy ? 2 : 1, max: 2 }),
              b.intervalGate("hosts", { minIntervalMs: 0, defaultHost: "x" }),
            ],
            { clock, name: "llm" },
          ),
        };
      });
      const look = await connect();
      const line = `${prefix}{gate:llm|rpm|tpm|inflight|adaptive|hosts}:line`;
      // (n callers in the permit line, each with its steps kept: its process listens, and a
      // release can hand it permits.)
      const held = line.replace(/:line$/, ":held");
      const waiting = (n: number) =>
        until(
          async () => {
            const members = await look.zrange(line, 0, -1);
            const kept = await Promise.all(members.map((m) => look.hexists(held, `s:${m}`)));
            return members.length === n && kept.every((k) => k === 1);
          },
          { timeoutMs: 5_000, message: `${n} in line, their steps kept` },
        );
      // (The script call of each release that hands its permits on in the first pass.)
      const handing: Sent[] = [];
      const releaseOf = async (t: Ticket, handsOn: boolean) => {
        const before = sent.length;
        await t.release("success");
        const call = sent.slice(before).find((x) => x.name === "evalsha");
        if (handsOn) handing.push(call!);
      };
      // The third process waits once first, so that it listens for grants when its caller comes
      // (its steps are then kept as it waits): a release hands it the permits, nobody next.
      const first = await gates[0]!.gate.admit({ costs: { tpm: 300, inflight: roomy ? 2 : 1 } });
      const warm = gates[2]!.gate.admit({ costs: { tpm: 100 } });
      await waiting(1);
      await releaseOf(first, true);
      await (await within(warm, 5_000, "the first wait's grant")).release("success");
      const a = await gates[0]!.gate.admit({
        costs: { tpm: 300, inflight: how === "two permits" ? 2 : 1 },
      });
      const dead = how === "a dead holder's lease ended";
      // (A holder of a process that died, at each permit stage: its lease far off at first, so
      // that nobody waits for its end, then ended just before the release.)
      for (const stage of dead ? ["inflight", "adaptive"] : []) {
        await client.zadd(`${prefix}{${stage}}:holders`, clock.now() + 1_000_000, "dead00-1:1");
        await client.hincrby(`${prefix}{${stage}}:meta`, "used", 1);
      }
      const b = gates[1]!.gate.admit({ costs: { tpm: 200 } });
      await waiting(1);
      const joining = sent.length;
      const none = how === "one permit, the next waiter taking none";
      const c = gates[2]!.gate.admit({
        costs: none ? { tpm: 100, inflight: 0, adaptive: 0 } : { tpm: 100 },
      });
      await waiting(2);
      // (The process of the caller next in line, by the token its member begins with.)
      const next = (await look.zrange(line, 0, -1))[1]!.split("-")[0]!;
      const deaf = how === "one permit, the next waiter's process not listening";
      for (const stage of dead ? ["inflight", "adaptive"] : []) {
        await client.zadd(`${prefix}{${stage}}:holders`, "XX", clock.now() - 1, "dead00-1:1");
      }
      const gate = `${prefix}{gate:llm|rpm|tpm|inflight|adaptive|hosts}`;
      if (how === "one permit") {
        // (A grant record nobody collected, its time over: swept as the rest sweeps it.)
        await client.hset(`${gate}:held`, "g:ghost0-1", "1|[]");
        await client.zadd(`${gate}:hexp`, clock.now() - 1, "ghost0-1");
      }
      if (how === "one permit, its lease ended") {
        // (The releasing caller's own leases ended, not yet taken by anyone: given back all the same.)
        for (const stage of ["inflight", "adaptive"]) {
          const [lease] = await client.zrange(`${prefix}{${stage}}:holders`, 0, 0);
          await client.zadd(`${prefix}{${stage}}:holders`, "XX", clock.now() - 1, lease!);
        }
      }
      const releaseA = sent.length;
      await releaseOf(a, !roomy && !deaf && !none);
      const tb = await within(b, 5_000, "the first waiter's grant");
      await releaseOf(tb, !roomy && !none);
      const tc = await within(c, 5_000, "the second waiter's grant");
      expect(await look.zcard(line)).toBe(0);
      const channels = (await look.pubsub("CHANNELS", `${prefix}*`)) as string[];

      // Every script call (and the dead holder's lease) again, in order, on keys of their own,
      // with a listener on each wake channel that listened, through the whole script, the script
      // without its first pass, and the whole script answering "handed" where its first pass
      // hands a release on itself.
      const again = sent.filter((x) => ["evalsha", "eval", "zadd", "hincrby", "hset"].includes(x.name));
      // (The third caller's first try, behind the second in the permit line.)
      const third = again.indexOf(sent.slice(joining).find((x) => x.name === "evalsha")!);
      // (The first caller's release, before which the next waiter's process stops listening.)
      const deafAt = again.indexOf(sent.slice(releaseA).find((x) => x.name === "evalsha")!);
      const replay = await connect();
      const replayed = async (gateScript: string) => {
        const own = randomPrefix("first-handoff-again");
        const listener = await connect();
        await listener.subscribe(...channels.map((ch) => ch.replaceAll(prefix, own)));
        const sha = (await replay.script("LOAD", gateScript)) as string;
        // (The state right after that try: its next try, once its process listens, would write
        // its place again.)
        let joined: unknown;
        const replies = await rerun(replay, again, prefix, own, sha, async (at) => {
          if (at === third + 1) joined = await state(replay, own);
          if (deaf && at === deafAt) {
            await listener.unsubscribe(
              ...channels.filter((ch) => ch.endsWith(`:${next}`)).map((ch) => ch.replaceAll(prefix, own)),
            );
          }
        });
        await listener.quit();
        return { replies, state: await state(replay, own), joined };
      };
      const whole = await replayed(withTtls(scriptSource("gate")));
      const rest = await replayed(withTtls(WITHOUT_FIRST));
      const says = await replayed(SAYS_HANDED);
      const saysJoined = await replayed(SAYS_JOINED);
      expect(whole.replies).toEqual(rest.replies);
      expect(whole.state).toEqual(rest.state);
      expect(whole.joined).toEqual(rest.joined);
      // The releases handed on by the first pass (and no other call); their replies carry the
      // grant message to the waiter.
      const handed = says.replies.flatMap((r, i) => (r === '"handed"' ? [i] : []));
      // (The next waiter's process not listening, the first caller's release goes on to the rest,
      // which passes that waiter over: the second's release then has nobody to hand on to.)
      expect(handed).toEqual(handing.slice(0, deaf ? 1 : undefined).map((call) => again.indexOf(call)));
      if (deaf) expect(handed).not.toContain(deafAt);
      for (const i of handed) expect(whole.replies[i]).toMatch(/"g\|/);
      // That try put in line by the first pass (and no other call).
      const joined = saysJoined.replies.flatMap((r, i) => (r === '"joined"' ? [i] : []));
      expect(joined).toEqual([third]);
      await tc.release("success");
      for (const { b } of gates) await b.close();
    });
  }
  // A first try while someone else is first in its lane (nobody in the permit line): the first
  // pass puts it at the back of the lane itself (first_lane), exactly as the rest would; a lane
  // whose first stopped asking (its expiry passed) goes on to the rest, which takes that one out.
  // And a later try of the lane's first, whose wait is over: the first pass admits it, takes it
  // out of the lane and tells the next there to ask (first_lane_head, first_lane_leave).
  it("puts a first try at the back of its lane, and admits the lane's first, as the rest would", async () => {
    const clock = new FakeClock(10_000);
    const prefix = randomPrefix("first-lane");
    const client = await connect();
    const sent = record(client);
    // Two processes' gates (each its own token) on one connection, so that what they sent is
    // recorded in the order Redis ran it. One token, then one every 100 ms: callers wait in the
    // lane of their key.
    const gates = [0, 1].map(() => {
      const b = redis(client, { prefix, clock, time: "clock" });
      return {
        b,
        gate: new Gate(
          [
            b.tokenBucket("rpm", { capacity: 1, refillPerSecond: 10, keyed: true }),
            b.semaphore("inflight", { limit: 8 }),
          ],
          { clock, name: "lanes" },
        ),
      };
    });
    const look = await connect();
    const lane = `${prefix}{gate:lanes|rpm|inflight}:lane:a|`;
    const inLane = (n: number) =>
      until(async () => (await look.zcard(lane)) === n, { timeoutMs: 5_000, message: `${n} in the lane` });
    // (The script call each caller's first try made, by where it starts in what was sent.)
    const firstTry = (from: number) => scriptCallFrom(sent, from);
    const calls = (g: number) => gates[g]!.gate.admit({ key: "a", timeoutMs: 60_000 });
    await (await calls(0)).release("success");
    const b = calls(1);
    await inLane(1);
    const laning: Sent[] = [];
    // (The lane: b's process, then that one, the other, the other: its first admitted, the next is
    // told in its own process's reply or on the other's channel.)
    for (const [g, n] of [
      [1, 2],
      [0, 3],
      [0, 4],
    ] as const) {
      const from = sent.length;
      const waiting = calls(g);
      await inLane(n);
      laning.push(await firstTry(from));
      void waiting.then((t) => t.release("success"));
    }
    // The lane's first stops asking (its expiry passed): the next first try goes on to the rest.
    const dead = "dead00-1";
    await client.zadd(lane, 0, dead);
    await client.zadd(lane.replace(":lane:", ":lexp:"), clock.now() - 1, dead);
    const from = sent.length;
    const after = calls(1);
    await until(async () => (await look.zscore(lane, dead)) === null, {
      timeoutMs: 5_000,
      message: "the lane's first that stopped asking was taken out",
    });
    const passedOn = await firstTry(from);
    // A waiter second in the lane stops asking too: the first's admission, whose next it is, goes
    // on to the rest, which takes it out and tells the one after it.
    const [, firstScore, , secondScore] = await look.zrange(lane, 0, 1, "WITHSCORES");
    await client.zadd(lane, (Number(firstScore) + Number(secondScore)) / 2, "dead01-1");
    await client.zadd(lane.replace(":lane:", ":lexp:"), clock.now() - 1, "dead01-1");
    for (let i = 0; i < 100 && (await look.zcard(lane)) > 0; i++) await clock.advance(50);
    const tickets = [
      await within(b, 5_000, "the lane's first caller"),
      await within(after, 5_000, "the caller behind the one that stopped asking"),
    ];
    expect(await look.zcard(lane)).toBe(0);
    for (const t of tickets) await t.release("success");

    // Every script call (and the dead waiter) again, in order, on keys of their own, through the
    // whole script, the script without its first pass, and the whole script answering "laned"
    // where its first pass puts a try at the back of a lane.
    const again = sent.filter((x) => ["evalsha", "eval", "zadd"].includes(x.name));
    const replay = await connect();
    const replayed = async (gateScript: string) => {
      const own = randomPrefix("first-lane-again");
      // (What the calls publish, in order: a lane's next told to ask, on its process's channel.)
      const listener = await connect();
      const told: string[] = [];
      listener.on("pmessage", (_p: string, channel: string, message: string) =>
        told.push(`${channel} ${message}`.replaceAll(own, "<p>")),
      );
      await listener.psubscribe(`${own}*`);
      const sha = (await replay.script("LOAD", gateScript)) as string;
      const replies = await rerun(replay, again, prefix, own, sha);
      // (A message published is read on the listener's connection after the calls' replies.)
      await listener.ping();
      await listener.quit();
      return { replies, state: await state(replay, own), told };
    };
    const whole = await replayed(withTtls(scriptSource("gate")));
    const rest = await replayed(withTtls(WITHOUT_FIRST));
    const says = await replayed(SAYS_LANED);
    const saysLeft = await replayed(SAYS_LEFT);
    expect(whole.replies).toEqual(rest.replies);
    expect(whole.state).toEqual(rest.state);
    expect(whole.told).toEqual(rest.told);
    expect(whole.told.length, "a lane's next in the other process was told").toBeGreaterThan(0);
    // Every later try admitted as its lane's first by the first pass (and no other call).
    const later = again.flatMap(({ name, args, reply }, i) => {
      if (name === "zadd") return [];
      const argv = args.slice(2 + Number(args[1]));
      const tryNo = Number((JSON.parse(argv[5]!) as string[])[2]);
      const r = (reply as unknown[][])[0];
      return argv[1] === "all" && argv[4] === "1" && tryNo > 1 && Array.isArray(r) && r[0] === 1 ? [i] : [];
    });
    expect(later.length).toBeGreaterThanOrEqual(4);
    // (But the first admitted after the waiter second in line stopped asking: the rest's.)
    const deadAt = again.findIndex(({ name, args }) => name === "zadd" && args.includes("dead01-1"));
    const toRest = later.find((i) => i > deadAt)!;
    expect(toRest).toBeDefined();
    expect(saysLeft.replies.flatMap((r, i) => (r === '"left"' ? [i] : []))).toEqual(
      later.filter((i) => i !== toRest),
    );
    // Those three first tries put at the back of the lane by the first pass, and no other call:
    // not the one behind a first that had stopped asking.
    const laned = says.replies.flatMap((r, i) => (r === '"laned"' ? [i] : []));
    expect(laned).toEqual(laning.map((call) => again.indexOf(call)));
    expect(laned).not.toContain(again.indexOf(passedOn));
    for (const { b } of gates) await b.close();
  });

  // A lane's first that the permit line took with its lane since its latest try (a `j:` record in
  // `held`, see admit() in lua/gate.lua) is the rest's to admit: its reply says when it moved.
  // (The gate's own calls never leave such a record on a lane's first: it is made here.)
  it("hands on a lane's first that the permit line took with its lane, as the rest would", async () => {
    const clock = new FakeClock(10_000);
    const prefix = randomPrefix("first-lane-moved");
    const client = await connect();
    const sent = record(client);
    const b = redis(client, { prefix, clock, time: "clock" });
    const gate = new Gate(
      [
        b.tokenBucket("rpm", { capacity: 1, refillPerSecond: 10, keyed: true }),
        b.semaphore("inflight", { limit: 8 }),
      ],
      { clock, name: "moved" },
    );
    const lane = `${prefix}{gate:moved|rpm|inflight}:lane:a|`;
    const held = await gate.admit({ key: "a" });
    const waiting = gate.admit({ key: "a", timeoutMs: 60_000 });
    await until(async () => (await client.zcard(lane)) === 1, {
      timeoutMs: 5_000,
      message: "one in the lane",
    });
    for (let i = 0; i < 50 && (await client.zcard(lane)) > 0; i++) await clock.advance(50);
    await (await within(waiting, 5_000, "the lane's first")).release("success");
    await held.release("success");
    // Its later try, admitted as its lane's first by the first pass.
    const argvOf = (args: string[]) => args.slice(2 + Number(args[1]));
    const at = sent.findIndex(({ name, args, reply }) => {
      const argv = argvOf(args);
      return (
        name === "evalsha" &&
        argv[1] === "all" &&
        argv[4] === "1" &&
        Number((JSON.parse(argv[5]!) as string[])[2]) > 1 &&
        (reply as unknown[][])[0]?.[0] === 1
      );
    });
    expect(at, "the lane's first was admitted on a later try").toBeGreaterThanOrEqual(0);
    const later = sent[at]!;
    const member = (JSON.parse(argvOf(later.args)[5]!) as string[])[0]!;
    const replayed = async (sha: string) => {
      const own = randomPrefix("first-lane-moved-again");
      await replayBefore(client, sent, at, prefix, own);
      await client.hset(`${own}{gate:moved|rpm|inflight}:held`, `j:${member}`, `${clock.now() - 40}|0|x`);
      const reply = await client.call(
        "EVALSHA",
        sha,
        ...later.args.slice(1).map((a) => a.replaceAll(prefix, own)),
      );
      return { reply, state: await state(client, own), own };
    };
    const whole = await alike(client, replayed);
    // Admitted, its reply saying when it moved, and the record gone.
    const reply = (whole.reply as unknown[][])[0]!;
    expect(reply[0]).toBe(1);
    expect(reply[9]).toBe(`${clock.now() - 40}|0|x`);
    expect(JSON.stringify(whole.state)).not.toContain(`j:${member}`);
    await b.close();
  });

  // A turn of first tries while someone else is first in the permit line: the first pass puts
  // them all at its back itself (first_join), in turn, exactly as the rest would, their steps kept
  // (each with its own arguments) when their process listens, not kept when it does not yet; a
  // turn with a try that does not wait goes on to the rest.
  it("puts a turn of first tries at the back of the permit line, each as the rest would", async () => {
    const clock = new FakeClock(10_000);
    const prefix = randomPrefix("first-join-turn");
    const client = await connect();
    const sent = record(client);
    // Four processes' gates (each its own token and wake channel) on one connection, so that what
    // they sent is recorded in the order Redis ran it.
    const gates = [0, 1, 2, 3].map(() => {
      const b = redis(client, { prefix, clock, time: "clock" });
      return {
        b,
        gate: new Gate(
          [
            b.tokenBucket("rpm", { capacity: 100, refillPerSecond: 10 }),
            b.tokenBucket("tpm", { capacity: 10_000, refillPerSecond: 1_000 }),
            b.semaphore("inflight", { limit: 1 }),
            b.aimd("adaptive", { initial: 1, max: 2 }),
            b.intervalGate("hosts", { minIntervalMs: 0, defaultHost: "x" }),
          ],
          { clock, name: "llm" },
        ),
      };
    });
    const look = await connect();
    const line = `${prefix}{gate:llm|rpm|tpm|inflight|adaptive|hosts}:line`;
    const inLine = (n: number) =>
      until(async () => (await look.zcard(line)) === n, { timeoutMs: 5_000, message: `${n} in line` });
    const admit = (g: number, tpm: number) => gates[g]!.gate.admit({ costs: { tpm } });
    // The third process waits once first, so that it listens for grants when its turn comes.
    const warm = await admit(0, 100);
    const warming = admit(2, 100);
    await inLine(1);
    await warm.release("success");
    await (await within(warming, 5_000, "the first wait's grant")).release("success");
    const a = await admit(0, 100);
    const waiting: Promise<Ticket>[] = [admit(1, 100)];
    await inLine(1);
    // Each turn: its calls in one tick, so in one `gate` call (the script call that follows).
    const turns: { call: Sent; joins: boolean }[] = [];
    const turn = async (calls: () => Promise<Ticket | undefined>[], inLineAfter: number, joins: boolean) => {
      const from = sent.length;
      const made = calls();
      await inLine(inLineAfter);
      const call = await scriptCallFrom(sent, from);
      const argv = call.args.slice(2 + Number(call.args[1]));
      expect(argv[4], "the turn went as one gate call").toBe(String(made.length));
      turns.push({ call, joins });
      return made;
    };
    // A listening process's turn of three, each with a cost of its own (steps kept); a new
    // process's turn of two (it listens only once it waits: steps not kept); a turn with a try
    // that does not wait (refused), which goes on to the rest.
    waiting.push(
      ...((await turn(() => [100, 200, 300].map((tpm) => admit(2, tpm)), 4, true)) as Promise<Ticket>[]),
    );
    waiting.push(...((await turn(() => [50, 60].map((tpm) => admit(3, tpm)), 6, true)) as Promise<Ticket>[]));
    const mixed = await turn(() => [admit(1, 70), gates[1]!.gate.tryAdmit({ costs: { tpm: 80 } })], 7, false);
    expect(await mixed[1]).toBeUndefined();
    waiting.push(mixed[0] as Promise<Ticket>);
    // A listening process's turn of three alike calls: the third goes as its name alone.
    waiting.push(
      ...((await turn(() => [90, 90, 90].map((tpm) => admit(2, tpm)), 10, true)) as Promise<Ticket>[]),
    );
    const named = turns[3]!.call.args.slice(2 + Number(turns[3]!.call.args[1]));
    expect(named.slice(5).map((c) => c.startsWith("["))).toEqual([true, true, false]);
    const channels = (await look.pubsub("CHANNELS", `${prefix}*`)) as string[];
    // Everyone admitted in line order, one at a time, each released once in.
    await a.release("success");
    for (const [i, w] of waiting.entries()) await (await within(w, 5_000, `waiter ${i}`)).release("success");
    expect(await look.zcard(line)).toBe(0);

    // Every script call again, in order, on keys of their own, with a listener on each wake
    // channel that listened, through the whole script, the script without its first pass, and
    // the whole script answering "joined" where its first pass puts calls in line itself.
    const again = sent.filter((x) => x.name === "evalsha" || x.name === "eval");
    // (The first turn's call run twice, as a client that sends a command again by itself would:
    // its calls are in line already the second time, which the rest decides.)
    const resent = again.indexOf(turns[0]!.call) + 1;
    again.splice(resent, 0, turns[0]!.call);
    // (And the second turn again, made one member's twice, behind the mixed turn: no client sends
    // that, and the rest keeps a member's place once, so the first pass hands it on.)
    const twice = structuredClone(turns[1]!.call);
    const firstCall = 2 + Number(twice.args[1]) + 5;
    for (const at of [firstCall, firstCall + 1]) {
      const fields = JSON.parse(twice.args[at]!) as string[];
      fields[0] = "feed00-1";
      twice.args[at] = JSON.stringify(fields);
    }
    const doubled = again.indexOf(turns[2]!.call) + 1;
    again.splice(doubled, 0, twice);
    const replay = await connect();
    const replayed = async (gateScript: string) => {
      const own = randomPrefix("first-join-turn-again");
      const listener = await connect();
      await listener.subscribe(...channels.map((ch) => ch.replaceAll(prefix, own)));
      const sha = (await replay.script("LOAD", gateScript)) as string;
      const replies = await rerun(replay, again, prefix, own, sha);
      await listener.quit();
      return { replies, state: await state(replay, own) };
    };
    const whole = await replayed(withTtls(scriptSource("gate")));
    const rest = await replayed(withTtls(WITHOUT_FIRST));
    const says = await replayed(SAYS_JOINED);
    expect(whole.replies).toEqual(rest.replies);
    expect(whole.state).toEqual(rest.state);
    // Each turn of first tries that wait, put in line by the first pass (kept steps or not); not
    // the turn with a try in it. (Before Redis 7.0 a script cannot tell whether the server has
    // ZMSCORE, and the first pass takes lone calls only: every turn goes on to the rest.)
    const turnsFirst = await scriptsKnowVersion(look);
    const joined = says.replies.flatMap((r, i) => (r === '"joined"' ? [i] : []));
    for (const t of turns) expect(joined.includes(again.indexOf(t.call))).toBe(t.joins && turnsFirst);
    expect(joined).not.toContain(resent);
    expect(joined).not.toContain(doubled);
    expect(JSON.parse(whole.replies[doubled]!)).toHaveLength(2);
    // (The first turn's steps kept, each call's with its own cost; the second's not kept.)
    const kept = (t: number) =>
      (JSON.parse(whole.replies[again.indexOf(turns[t]!.call)]!) as unknown[][]).map((r) => r[5]);
    expect(kept(0)).toEqual([1, 1, 1]);
    expect(kept(1)).toEqual([0, 0]);
    expect(kept(3)).toEqual([1, 1, 1]);
    for (const { b } of gates) await b.close();
  });
});
