/**
 * Chaos for the Redis semaphore fleet: worker processes (test/redis/fixtures/chaos-worker.ts)
 * loop admit → fetch → release against a local provider capped at the semaphore's limit, through
 * phases of faults: SIGKILL churn, frozen holders, frozen waiters, CLIENT KILL, SCRIPT FLUSH and
 * redis-server restarts with persistence. The provider is the oracle: every arrival above its cap
 * is a breach. Figures per phase: calls/s, breaches (and what was in flight at each), the longest
 * stall, lost leases, sends on stale grants; at the end, what is left in Redis. With `gate`, the
 * workers call through a fused gate of the llm scenario's kinds (a token bucket, the semaphore,
 * an AIMD limiter, an interval gate), decided in one script call per admission and per release.
 * test/faults/chaos.test.ts runs a short form and asserts the bounds below.
 *
 *   npm run chaos -- --seconds 60     (seconds per phase; the test takes CHAOS_SECONDS, default 3)
 *   more flags: --workers --callers --limit --lease-ms --poll-ms --kill-every-ms, --phase <name>…,
 *   --classes, --gate
 *   (npm run chaos -- --help lists them with their defaults)
 */
import { randomUUID } from "node:crypto";
import { once } from "node:events";
import { setPriority } from "node:os";
import { pathToFileURL } from "node:url";
import type { Ticket } from "floodgate";
import { redis, stageKey } from "floodgate/redis";
import { Redis } from "ioredis";
import { command, parseOrExit } from "../examples/cli.js";
import { startProvider } from "../examples/provider.js";
import {
  epochNow,
  nextMessage,
  ProviderTap,
  restartRedis,
  startPersistentRedis,
} from "../test/faults/harness.js";
import { aimdOptions, chaosGateKey, GATE_STAGES } from "../test/redis/fixtures/chaos-gate.js";
import { Child, sleep } from "../test/redis/helpers.js";
import type { RedisProcess } from "../test/setup/redis-server.js";

/** Under kill churn the fleet keeps at least this share of its calm throughput. */
export const MIN_CHURN_RATIO = 0.7;
/**
 * No gap between two successful provider calls, fleet-wide, is longer than this past the longest
 * time Redis itself was away in the phase (a restart), ms (2 × leaseMs).
 */
export const STALL_BOUND_MS = 3_000;

/** The longest gap phase `p` may have between two successful calls, ms: see STALL_BOUND_MS. */
export function stallBound(p: PhaseFigures): number {
  return STALL_BOUND_MS + p.outageMs;
}

export const PHASES = [
  "calm",
  "kill churn",
  "frozen holders",
  "frozen waiters",
  "client kill",
  "script flush",
  "redis restart",
] as const;
export type PhaseName = (typeof PHASES)[number];

export const DEFAULTS = {
  workers: 10,
  callers: 3,
  limit: 6,
  leaseMs: 1_500,
  /** The library's default, as a fleet that did not tune it would run. */
  pollMs: 1_000,
  serviceMs: 30,
  /** A worker is SIGKILLed about this often under churn (a standby forked ahead takes its place), ms. */
  killEveryMs: 700,
  /** A frozen worker stays stopped this long: past its lease, and past any grant made to it, ms. */
  freezeMs: 2_500,
  /** A new freeze starts about this often, ms. */
  freezeEveryMs: 1_000,
  /** A caller asked to hold waits this long after admission before it checks its signal and sends, ms. */
  holdMs: 300,
  /** redis-server is down this long on each restart, ms. */
  downMs: 300,
  /** With `gate`: its token bucket's refill a second (the fleet could make about 190 calls a second). */
  gateRate: 150,
  /** With `gate`: its interval gate's spacing and jitter, ms (0: it spaces nothing). */
  gateSpacingMs: 0,
  gateJitterMs: 0,
};

export interface ChaosSettings extends Partial<typeof DEFAULTS> {
  /** A redis-server with persistence; "redis restart" restarts it on its port. */
  server: RedisProcess;
  /** Length of each phase, ms. */
  phaseMs: number;
  phases?: readonly PhaseName[];
  /**
   * Build the semaphore with traffic classes (interactive: share 2, priority 1; bulk: share 1),
   * each worker's callers taking turns between them.
   */
  classes?: boolean;
  /**
   * Call through a fused gate (test/redis/fixtures/chaos-gate.ts): a token bucket that binds now
   * and then, the semaphore, an AIMD limiter of the same limit and an interval gate (spacing
   * nothing unless told). The counts are then watched for both permit stages, and no member may
   * hold a lease of either while it waits in the gate's line.
   */
  gate?: boolean;
  /** Told a line as each phase ends. */
  progress?: (line: string) => void;
}

/**
 * What was in flight at the provider when a breach arrived, most damning first: a call sent on a
 * grant that reached a frozen waiter and had ended in Redis (`staleGrant`); a call of a holder
 * frozen after admission that found its signal clear and sent (`frozenHolder`, the one breach
 * allowed: nothing tells a process how long it was stopped); a call whose ticket had been
 * signalled lost by then (`lostLease`); a call whose lease Redis no longer held as it went out
 * (`staleLease`); none of these (`unexplained`).
 */
export const CAUSES = ["staleGrant", "frozenHolder", "lostLease", "staleLease", "unexplained"] as const;
export type Cause = (typeof CAUSES)[number];

export interface PhaseFigures {
  name: string;
  seconds: number;
  faults: number;
  /** Successful provider calls (arrivals at or under the cap) per second. */
  callsPerSecond: number;
  /** Most requests the provider had at once. */
  peak: number;
  /** Arrivals above the cap, and each by what was in flight. */
  breaches: number;
  causes: Record<Cause, number>;
  /** Longest gap between two successful arrivals fleet-wide (phase edges included), ms. */
  stallMs: number;
  /** Longest time redis-server was away in one of the phase's restarts (stop to ready again; 0 for none), ms. */
  outageMs: number;
  lostBeforeSend: number;
  lostInCall: number;
  /** Calls sent on a grant that reached a waiter while it was frozen and had ended in Redis. */
  staleGrantSends: number;
  /** Other calls sent while Redis held no live lease for them (frozen holders among them). */
  staleLeaseSends: number;
  unavailable: number;
  timeouts: number;
  errors: number;
}

export interface Leftovers {
  /**
   * Keys under the prefix but the stage's meta hash (which keeps the fencing sequence for good),
   * each with its type, size and expiry.
   */
  keys: string[];
  liveLeases: number;
  expiredLeases: number;
  waiters: number;
  /** Permits meta counts as held: in all, and by the classes together (u0, u1; 0 without classes). */
  used: number;
  classesUsed: number;
}

/** The permit stages whose counts are watched: the semaphore, and with `gate` the AIMD limiter. */
function permitStages(gate: boolean): string[] {
  return gate ? [GATE_STAGES.permits, GATE_STAGES.adaptive] : [GATE_STAGES.permits];
}

export interface ChaosReport {
  phases: PhaseFigures[];
  whole: PhaseFigures;
  /** Calls/s under kill churn over calls/s calm (NaN unless both phases ran). */
  ratio: number;
  left: Leftovers;
  /** Breaches the tap saw from the first worker's start to the last one's exit. */
  tapBreaches: number;
  /** The provider's own count of 429s for its cap, to check the tap by. */
  providerBreaches: number;
  freezes: { worker: number; kind: "holder" | "waiter"; ms: number }[];
  /**
   * The stage's counts read every 100 ms while the fleet ran (see `watchCounts`): how many reads
   * (one MULTI each; those a fault failed are not counted) and how many found a count off; with
   * `gate`, how many found someone in the gate's line (the check that nobody there holds a lease
   * is only as good as that number).
   */
  counts: { reads: number; off: number; lineSeen: number };
  /** Workers that crashed or would not stop; counts off (`counts`), the first few of them. */
  problems: string[];
}

/**
 * What is wrong with the stage's state read at one instant (its meta hash, holders and line), if
 * anything: `used` is the costs of the leases held, in all and (u0, u1 with classes) per class,
 * expired or not, granted or claimed; no member both holds a lease and waits in line.
 */
export function countsOff(
  meta: Record<string, string>,
  holders: readonly string[],
  queue: readonly string[],
  /** With `line`: the member each lease in `holders` is the call of (a fused call's name). */
  callers: readonly string[] = holders,
  /** A fused gate's line: members waiting there, holding nothing. */
  line: readonly string[] = [],
): string {
  const cost = (m: string) => Number(/:(\d+)$/.exec(m)?.[1] ?? 1);
  const cls = (m: string) => Number(/~(\d+):/.exec(m)?.[1] ?? 0);
  let sum = 0;
  const byClass: number[] = [];
  for (const m of holders) {
    sum += cost(m);
    byClass[cls(m)] = (byClass[cls(m)] ?? 0) + cost(m);
  }
  const wrong: string[] = [];
  if (Number(meta.used ?? 0) !== sum) wrong.push(`used ${meta.used ?? 0}, leases' costs ${sum}`);
  for (const field of Object.keys(meta)) {
    const k = /^u(\d+)$/.exec(field);
    if (k && Number(meta[field]) !== (byClass[Number(k[1])] ?? 0)) {
      wrong.push(`${field} ${meta[field]}, class ${k[1]}'s leases' costs ${byClass[Number(k[1])] ?? 0}`);
    }
  }
  const waiting = new Set(queue);
  const both = holders.filter((m) => waiting.has(m));
  if (both.length > 0) wrong.push(`holding and in line: ${both.join(", ")}`);
  const inGate = new Set(line);
  const held = holders.filter((_, i) => inGate.has(callers[i]!));
  if (held.length > 0) wrong.push(`holding while in the gate's line: ${held.join(", ")}`);
  return wrong.join("; ");
}

/** A call a worker reported (see the fixture): all but the plain 200s, and any across a freeze. */
interface CallRecord {
  /** Sent as `x-call-id`: the provider tap records which calls were in flight at each arrival. */
  id: string;
  outcome: string;
  admittedAt: number;
  sentAt?: number;
  endedAt?: number;
  lostAt?: number;
  frozen?: "holder" | "waiter";
  stale?: boolean;
}

type Counts = Record<"unavailable" | "timeouts" | "errors", number>;
type Window = [
  name: string,
  from: number,
  to: number,
  faults: number,
  before: Counts,
  after: Counts,
  outageMs: number,
];

const sleepUntil = (t: number) => sleep(Math.max(0, t - epochNow()));
const jitter = (ms: number) => ms * (0.75 + Math.random() / 2);
const pick = <T>(items: readonly T[]): T | undefined => items[Math.floor(Math.random() * items.length)];

class ChaosRun {
  readonly s: typeof DEFAULTS & ChaosSettings;
  readonly tap = new ProviderTap();
  readonly prefix = `chaos:${randomUUID()}:`;
  readonly admin: Redis;
  env: Record<string, string> = {};
  readonly classes: boolean;
  readonly gate: boolean;
  readonly all: Child[] = [];
  readonly ids = new Map<Child, number>();
  live: Child[] = [];
  /** Connected and ready, not calling yet: a killed worker's replacement starts calling at once. */
  standby: Child[] = [];
  readonly niced = new Set<Child>();
  readonly frozen = new Set<Child>();
  readonly freezes: ChaosReport["freezes"] = [];
  readonly problems: string[] = [];
  readonly counts = { reads: 0, off: 0, lineSeen: 0 };
  /** Longest time redis-server was away in a restart of the current phase, ms. */
  #outageMs = 0;

  /**
   * Read the stage's meta, holders and line in one MULTI every 100 ms until `done()`, on a
   * connection of its own (faults cut it too; a read they fail is not counted), and note each
   * state `countsOff` finds wrong in `problems` (the first five), named by `phase()`.
   */
  async watchCounts(done: () => boolean, phase: () => string): Promise<void> {
    const watcher = new Redis(this.s.server.url, { maxRetriesPerRequest: 0, retryStrategy: () => 50 });
    watcher.on("error", () => {});
    const stages = permitStages(this.gate);
    try {
      while (!done()) {
        await sleep(100);
        let read: [unknown, unknown][] | null;
        try {
          const multi = watcher.multi();
          for (const stage of stages) {
            multi
              .hgetall(this.key("meta", stage))
              .zrange(this.key("holders", stage), 0, -1)
              .zrange(this.key("queue", stage), 0, -1);
          }
          if (this.gate) multi.zrange(this.gateKey("line"), 0, -1);
          read = await multi.exec();
        } catch {
          continue;
        }
        if (!read || read.some(([error]) => error)) continue;
        this.counts.reads++;
        const values = read.map(([, value]) => value);
        // A fused call waits in the gate's line under its member; its leases are named by it (a
        // later try's with ".<try>" after it): none of them may be held while it is there.
        const line = this.gate ? (values[stages.length * 3] as string[]) : [];
        if (line.length > 0) this.counts.lineSeen++;
        const offs: string[] = [];
        for (let i = 0; i < stages.length; i++) {
          const [meta, holders, queue] = values.slice(i * 3, i * 3 + 3) as [
            Record<string, string>,
            string[],
            string[],
          ];
          const members = holders.map((m) => (this.gate ? m.replace(/\.\d+$/, "") : m));
          const off = countsOff(meta, holders, queue, members, line);
          if (off !== "") offs.push(stages.length > 1 ? `${stages[i]}: ${off}` : off);
        }
        if (offs.length === 0) continue;
        if (++this.counts.off <= 5) this.problems.push(`counts off in "${phase()}": ${offs.join("; ")}`);
      }
    } finally {
      watcher.disconnect();
    }
  }

  constructor(settings: ChaosSettings) {
    this.s = { ...DEFAULTS, ...settings };
    this.classes = settings.classes === true;
    this.gate = settings.gate === true;
    this.admin = new Redis(this.s.server.url, { maxRetriesPerRequest: 0, retryStrategy: () => 50 });
    this.admin.on("error", () => {});
  }

  /** Fork a worker; a standby, when `nice`, at the lowest CPU priority until it starts calling. */
  spawn(standby = false, nice = false): void {
    const id = this.all.length;
    const env = { ...this.env, WORKER: String(id), STANDBY: standby ? "1" : "" };
    const child = new Child("chaos-worker.ts", env);
    this.all.push(child);
    this.ids.set(child, id);
    (standby ? this.standby : this.live).push(child);
    if (nice) this.#priority(child, 19);
  }

  #priority(child: Child, priority: number): void {
    try {
      setPriority(child.process.pid!, priority);
      if (priority > 0) this.niced.add(child);
      else this.niced.delete(child);
    } catch (error) {
      this.problems.push(
        `worker ${this.ids.get(child)}: could not set its priority to ${priority}: ${error}`,
      );
    }
  }

  /**
   * SIGKILL a running worker and start a standby in its place. Forking costs a worker about half
   * a second of CPU, which on a small machine would slow the fleet as much as the kills do: the
   * standbys are forked before the run (enough for a phase of up to 16 kills), and any forked
   * during it start at the lowest priority where this process may raise it again (as root).
   */
  async kill(): Promise<boolean> {
    const victim = pick(this.idle());
    if (!victim) return false;
    this.live = this.live.filter((c) => c !== victim);
    await victim.kill();
    const next = this.standby.shift();
    if (!next) this.spawn();
    else {
      if (this.niced.has(next)) this.#priority(next, 0);
      next.send({ type: "go" });
      this.live.push(next);
      if (this.standby.length < 2) this.spawn(true, process.getuid?.() === 0);
    }
    return true;
  }

  ready(): Promise<unknown> {
    return Promise.all([...this.live, ...this.standby].map((child) => child.message("ready", 30_000)));
  }

  /** Running workers, neither frozen nor starting. */
  idle(): Child[] {
    return this.live.filter((c) => !this.frozen.has(c) && c.messages.length > 0);
  }

  /** Sum of the last counts each worker reported (a killed worker's stay as they were). */
  totals(): Counts {
    const sum: Counts = { unavailable: 0, timeouts: 0, errors: 0 };
    for (const child of this.all) {
      const last = child.messages.findLast((m) => m.type === "counts" || m.type === "done");
      for (const k of Object.keys(sum) as (keyof Counts)[]) sum[k] += Number(last?.[k] ?? 0);
    }
    return sum;
  }

  /** Inject `name`'s faults until `until` (a freeze phase runs on past its last thaw); how many. */
  async fault(name: PhaseName, until: number): Promise<number> {
    const a = this.admin;
    let n = 0;
    switch (name) {
      case "calm":
        await sleepUntil(until);
        return 0;
      case "kill churn":
        return this.#every(this.s.killEveryMs, until, () => this.kill());
      case "frozen holders":
        return this.#freezes("holder", until);
      case "frozen waiters":
        return this.#freezes("waiter", until);
      case "client kill":
        // All workers' connections, all pub/sub connections, or every connection of one worker.
        return this.#every(400, until, async () => {
          const form = n++ % 3;
          if (form === 0) return (await a.call("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")) !== 0;
          if (form === 1) return (await a.call("CLIENT", "KILL", "TYPE", "pubsub")) !== 0;
          const victim = pick(this.idle());
          const name = ` name=chaos-worker-${victim && this.ids.get(victim)} `;
          const lines = String(await a.call("CLIENT", "LIST"))
            .split("\n")
            .filter((l) => l.includes(name));
          for (const addr of lines.map((l) => /addr=(\S+)/.exec(l)?.[1])) {
            if (addr) await a.call("CLIENT", "KILL", "ADDR", addr);
          }
          return lines.length > 0;
        });
      case "script flush":
        return this.#every(250, until, async () => (await a.call("SCRIPT", "FLUSH")) === "OK");
      case "redis restart":
        // A graceful stop a third of the way in, a crash at two thirds; the data is kept either way.
        for (const graceful of [true, false]) {
          await sleepUntil(until - this.s.phaseMs * (graceful ? 2 / 3 : 1 / 3));
          this.#outageMs = Math.max(
            this.#outageMs,
            await restartRedis(this.s.server, graceful, this.s.downMs),
          );
          n++;
        }
        await sleepUntil(until);
        return n;
    }
  }

  /** Call `inject` about every `ms` until `until`; how many times it said it did something. */
  async #every(ms: number, until: number, inject: () => Promise<boolean>): Promise<number> {
    let n = 0;
    for (;;) {
      await sleep(jitter(ms));
      if (epochNow() >= until) return n;
      if (await inject().catch(() => false)) n++;
    }
  }

  /**
   * About every `freezeEveryMs`, SIGSTOP a worker as one of its callers is admitted (and waits
   * `holdMs` before it checks its signal) or has just asked to be (and is in line), and SIGCONT
   * it `freezeMs` later. The phase runs at least 500 ms past the last thaw, so it counts what the
   * thawed workers do.
   */
  async #freezes(kind: "holder" | "waiter", until: number): Promise<number> {
    const thaws: Promise<void>[] = [];
    let thawedAt = 0;
    do {
      const child = pick(this.idle());
      const from = child?.messages.length ?? 0;
      child?.send({ type: kind === "holder" ? "hold" : "announce-wait" });
      const said =
        child && (await nextMessage(child, kind === "holder" ? "holding" : "waiting", from, 2_000));
      // A waiter's acquire is on its way as it announces: let it reach Redis and line up.
      if (said && kind === "waiter") await sleep(30);
      if (said && child.process.kill("SIGSTOP")) {
        this.frozen.add(child);
        const stoppedAt = epochNow();
        const thaw = async () => {
          await sleep(this.s.freezeMs);
          child.process.kill("SIGCONT");
          this.frozen.delete(child);
          thawedAt = epochNow();
          this.freezes.push({ worker: this.ids.get(child)!, kind, ms: thawedAt - stoppedAt });
        };
        thaws.push(thaw());
      }
      await sleep(jitter(this.s.freezeEveryMs));
    } while (epochNow() < until - this.s.freezeMs);
    await Promise.all(thaws);
    await sleepUntil(Math.max(until, thawedAt + 500));
    return thaws.length;
  }

  /** Ask every worker to stop; one that does not within 15 s is killed, and reported. */
  async stop(): Promise<void> {
    for (const child of this.frozen) child.process.kill("SIGCONT");
    const running = [...this.live, ...this.standby];
    this.live = [];
    this.standby = [];
    for (const child of running) child.send({ type: "stop" });
    await Promise.all(
      running.map(async (child) => {
        const who = `worker ${this.ids.get(child)}`;
        try {
          await child.message("done", 15_000);
          const code = await child.exit(5_000);
          if (code !== 0) this.problems.push(`${who} exited with ${code}: ${child.stderr}`);
        } catch (error) {
          this.problems.push(`${who} did not stop: ${String(error)}`);
          await child.kill();
        }
      }),
    );
  }

  /** The figures of the window [from, to), from the provider's arrivals and the workers' reports. */
  figures(calls: CallRecord[], [name, from, to, faults, before, after, outageMs]: Window): PhaseFigures {
    const { at, level } = this.tap;
    const byId = new Map(calls.map((c) => [c.id, c]));
    const causes = Object.fromEntries(CAUSES.map((c) => [c, 0])) as Record<Cause, number>;
    let [breaches, peak, ok, stallMs, last] = [0, 0, 0, 0, from];
    for (let i = 0; i < at.length; i++) {
      const t = at[i]!;
      if (t < from || t >= to) continue;
      peak = Math.max(peak, level[i]!);
      if (level[i]! > this.s.limit) {
        breaches++;
        causes[this.cause(i, byId)]++;
        continue;
      }
      ok++;
      stallMs = Math.max(stallMs, t - last);
      last = t;
    }
    stallMs = Math.max(stallMs, to - last);
    const sent = calls.filter((c) => c.sentAt !== undefined && c.sentAt >= from && c.sentAt < to);
    const seconds = (to - from) / 1000;
    return {
      name,
      seconds,
      faults,
      callsPerSecond: ok / seconds,
      peak,
      breaches,
      causes,
      stallMs,
      outageMs,
      lostBeforeSend: calls.filter(
        (c) => c.outcome === "lost-before-send" && c.admittedAt >= from && c.admittedAt < to,
      ).length,
      lostInCall: sent.filter((c) => c.outcome === "lost-in-call").length,
      staleGrantSends: sent.filter((c) => c.stale && c.frozen === "waiter").length,
      staleLeaseSends: sent.filter((c) => c.stale && c.frozen !== "waiter").length,
      unavailable: after.unavailable - before.unavailable,
      timeouts: after.timeouts - before.timeouts,
      errors: after.errors - before.errors,
    };
  }

  /**
   * What was at the provider when the breach at arrival `i` came: the calls the tap saw in flight
   * then (by their `x-call-id`), as the workers reported them. A call the workers did not report
   * was a plain one: admitted, sent on a live lease, answered 200, no freeze.
   */
  cause(i: number, byId: ReadonlyMap<string, CallRecord>): Cause {
    const t = this.tap.at[i]!;
    const there: CallRecord[] = [];
    for (const id of this.tap.ids[i]!) {
      const c = byId.get(id);
      if (c !== undefined) there.push(c);
    }
    if (there.some((c) => c.frozen === "waiter" && c.stale)) return "staleGrant";
    const lostAt = (c: CallRecord) => c.lostAt ?? Number.POSITIVE_INFINITY;
    if (there.some((c) => c.frozen === "holder" && lostAt(c) > c.sentAt!)) return "frozenHolder";
    if (there.some((c) => lostAt(c) <= t)) return "lostLease";
    if (there.some((c) => c.stale)) return "staleLease";
    return "unexplained";
  }

  /** The name of key `part` of the fleet's semaphore (or of another of its stages) in Redis. */
  key(part: string, stage: string = GATE_STAGES.permits): string {
    return stageKey(this.prefix, stage, part);
  }

  /** The name of the fused gate's key `part` in Redis. */
  gateKey(part: string): string {
    return chaosGateKey(this.prefix, part);
  }

  /**
   * One admission of the whole limit, at once or never, and its release; with `gate`, one of the
   * AIMD limiter's whole limit as it stands (it may have come down) too. (A stage reaps expired
   * leases only when they stand in its way: an admission of less would leave a killed worker's.)
   */
  async sweep(): Promise<void> {
    const client = new Redis(this.s.server.url, { maxRetriesPerRequest: 0, enableOfflineQueue: false });
    client.on("error", () => {});
    // What Redis holds at `stage`, for whoever looks into it: the count, the leases, the line.
    const held = async (what: string, stage: string) => {
      const meta = await client.hgetall(this.key("meta", stage));
      const holders = await client.zrange(this.key("holders", stage), 0, -1, "WITHSCORES");
      const queue = await client.zrange(this.key("queue", stage), 0, -1, "WITHSCORES");
      this.problems.push(
        `the sweeping call found ${what} still held (meta ${JSON.stringify(meta)}, ` +
          `holders [${holders.join(" ")}], line [${queue.join(" ")}])`,
      );
    };
    try {
      if (client.status !== "ready") await once(client, "ready");
      const backend = redis(client, { prefix: this.prefix });
      const sem = backend.semaphore("provider", { limit: this.s.limit, leaseMs: this.s.leaseMs });
      const ticket = await sem.tryAdmit({ cost: this.s.limit });
      if (!ticket) await held("the limit", GATE_STAGES.permits);
      await ticket?.release("ignored");
      if (this.gate) {
        const aimd = backend.aimd(GATE_STAGES.adaptive, aimdOptions(this.s));
        // Its whole limit as it stands, a permit at a time (an AIMD limiter admits a cost of `min`
        // at most; its limit may be fractional after a decrease).
        const limit =
          Number(await client.hget(this.key("meta", GATE_STAGES.adaptive), "limit")) || this.s.limit;
        const whole = Math.max(1, Math.floor(limit));
        const taken: Ticket[] = [];
        while (taken.length < whole) {
          const one = await aimd.tryAdmit();
          if (!one) break;
          taken.push(one);
        }
        if (taken.length < whole) await held("the AIMD limiter", GATE_STAGES.adaptive);
        for (const one of taken) await one.release("ignored");
      }
      await backend.close();
    } finally {
      client.disconnect();
    }
  }

  async leftovers(): Promise<Leftovers> {
    const a = this.admin;
    const keys: string[] = [];
    const stages = permitStages(this.gate);
    const metas = new Set(stages.map((stage) => this.key("meta", stage)));
    for await (const batch of a.scanStream({ match: `${this.prefix}*`, count: 200 })) {
      for (const k of batch as string[]) {
        if (metas.has(k)) continue;
        const [type, ttl] = await Promise.all([a.type(k), a.pttl(k)]);
        const size = type === "zset" ? await a.zcard(k) : type === "hash" ? await a.hlen(k) : "?";
        const expiry = ttl < 0 ? "no expiry" : `expires in ${ttl} ms`;
        keys.push(`${k.slice(this.prefix.length)} (${type} of ${size}, ${expiry})`);
      }
    }
    const [seconds, micros] = await a.time();
    const now = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
    const left = { keys: keys.sort(), liveLeases: 0, expiredLeases: 0, waiters: 0, used: 0, classesUsed: 0 };
    for (const stage of stages) {
      left.liveLeases += await a.zcount(this.key("holders", stage), `(${now}`, "+inf");
      left.expiredLeases += await a.zcount(this.key("holders", stage), "-inf", now);
      left.waiters += await a.zcard(this.key("queue", stage));
      left.used += Number((await a.hget(this.key("meta", stage), "used")) ?? 0);
      const classes = await a.hmget(this.key("meta", stage), "u0", "u1");
      left.classesUsed += classes.reduce((sum, v) => sum + Number(v ?? 0), 0);
    }
    if (this.gate) left.waiters += await a.zcard(this.gateKey("line"));
    return left;
  }

  async run(): Promise<ChaosReport> {
    const s = this.s;
    const provider = await startProvider({ cap: s.limit, serviceMs: s.serviceMs, group: this.tap });
    this.env = {
      REDIS_URL: s.server.url,
      PREFIX: this.prefix,
      PROVIDER_URL: provider.url,
      LIMIT: String(s.limit),
      LEASE_MS: String(s.leaseMs),
      POLL_MS: String(s.pollMs),
      CALLERS: String(s.callers),
      HOLD_MS: String(s.holdMs),
      CLASSES: this.classes ? "1" : "",
      GATE: this.gate ? "1" : "",
      GATE_RATE: String(s.gateRate),
      GATE_SPACING: String(s.gateSpacingMs),
      GATE_JITTER: String(s.gateJitterMs),
    };
    try {
      const names = s.phases ?? PHASES;
      // The standbys of a churn are forked now, while nothing is measured.
      const kills = names.includes("kill churn") ? Math.ceil(s.phaseMs / (0.75 * s.killEveryMs)) + 2 : 0;
      for (let i = 0; i < s.workers; i++) this.spawn();
      for (let i = 0; i < Math.min(kills, 18); i++) this.spawn(true);
      await this.ready();
      const windows: Window[] = [];
      const runFrom = epochNow();
      await sleep(1_000); // warm-up: connections, subscriptions, compiled code
      let phase = "warm-up";
      let watching = true;
      const watched = this.watchCounts(
        () => !watching,
        () => phase,
      );
      for (const name of names) {
        await this.ready();
        phase = name;
        const [from, before] = [epochNow(), this.totals()];
        this.#outageMs = 0;
        const faults = await this.fault(name, from + s.phaseMs);
        windows.push([name, from, epochNow(), faults, before, this.totals(), this.#outageMs]);
        s.progress?.(`${name}: ${faults} faults`);
      }
      windows.push([
        "whole run",
        runFrom,
        epochNow(),
        0,
        { unavailable: 0, timeouts: 0, errors: 0 },
        this.totals(),
        Math.max(0, ...windows.map((w) => w[6])),
      ]);
      phase = "stopping";
      await this.stop();
      watching = false;
      await watched;
      // Anything still held now was left behind; let it run out first, to tell live from expired.
      await sleep(s.leaseMs + 3 * s.pollMs + 500);
      // What killed workers left (leases run out, waiters gone silent) is reaped by the next call
      // that meets it: one call for the whole limit, from a process of its own, then nothing
      // may be left.
      await this.sweep();
      const calls = this.all.flatMap((c) => c.messages.filter((m) => m.type === "call")) as unknown[];
      const figures = windows.map((w) => this.figures(calls as CallRecord[], w));
      const phases = figures.slice(0, -1);
      const rate = (n: PhaseName) => phases.find((p) => p.name === n)?.callsPerSecond ?? Number.NaN;
      return {
        phases,
        whole: figures.at(-1)!,
        ratio: rate("kill churn") / rate("calm"),
        left: await this.leftovers(),
        tapBreaches: this.tap.level.filter((n) => n > s.limit).length,
        providerBreaches: provider.stats().rejectedBy.cap,
        freezes: this.freezes,
        counts: this.counts,
        problems: this.problems,
      };
    } finally {
      for (const child of this.all) child.process.kill("SIGCONT");
      await Promise.all(this.all.map((child) => child.kill()));
      await provider.close();
      this.admin.disconnect();
    }
  }
}

/** Run the fleet through the phases: figures per phase, and what is left in Redis at the end. */
export function runChaos(settings: ChaosSettings): Promise<ChaosReport> {
  return new ChaosRun(settings).run();
}

/** The report as a compact table, with the bounds it is judged by. */
export function formatReport(r: ChaosReport): string {
  const head =
    "phase|s|faults|calls/s|peak|breaches|stall ms|redis down ms|lost b/i|stale g/l|unavail|t/o|err".split(
      "|",
    );
  const row = (p: PhaseFigures) => {
    const causes = CAUSES.filter((c) => p.causes[c] > 0).map((c) => `${c} ${p.causes[c]}`);
    return [
      p.name,
      p.seconds.toFixed(1),
      String(p.faults),
      p.callsPerSecond.toFixed(1),
      String(p.peak),
      p.breaches === 0 ? "0" : `${p.breaches} (${causes.join(", ")})`,
      p.stallMs.toFixed(0),
      p.outageMs.toFixed(0),
      `${p.lostBeforeSend}/${p.lostInCall}`,
      `${p.staleGrantSends}/${p.staleLeaseSends}`,
      ...[p.unavailable, p.timeouts, p.errors].map(String),
    ];
  };
  const rows = [head, ...r.phases.map(row), row(r.whole)];
  const widths = head.map((_, i) => Math.max(...rows.map((cells) => cells[i]!.length)));
  const pad = (c: string, i: number) => (i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!));
  const { keys, liveLeases, expiredLeases, waiters, used, classesUsed } = r.left;
  const ratio = Number.isNaN(r.ratio) ? "n/a" : `${(r.ratio * 100).toFixed(0)}%`;
  const freezes = (kind: "holder" | "waiter") => {
    const ms = r.freezes.filter((f) => f.kind === kind).map((f) => f.ms);
    return ms.length === 0
      ? "none"
      : `${ms.length} of ${Math.min(...ms).toFixed(0)}–${Math.max(...ms).toFixed(0)} ms`;
  };
  return [
    ...rows.map((cells) => cells.map(pad).join("  ")),
    "(lost b/i: leases lost before the send / during the call; stale g/l: calls sent on a grant that " +
      "reached a frozen waiter / on another lease Redis no longer held)",
    `kill churn / calm: ${ratio} (bound >= ${MIN_CHURN_RATIO * 100}%); longest stall ` +
      `${r.whole.stallMs.toFixed(0)} ms (bound ${STALL_BOUND_MS} ms past Redis's longest restart, ` +
      `${r.whole.outageMs.toFixed(0)} ms); breaches seen by the tap ` +
      `${r.tapBreaches}, counted by the provider ${r.providerBreaches}`,
    `freezes: holders ${freezes("holder")}, waiters ${freezes("waiter")}`,
    `counts read every 100 ms: ${r.counts.reads}, off ${r.counts.off}` +
      (r.counts.lineSeen > 0 ? `; someone in the gate's line in ${r.counts.lineSeen}` : ""),
    `left in Redis: keys [${keys.join(", ")}], live leases ${liveLeases}, expired leases ${expiredLeases}, ` +
      `waiters ${waiters}, used ${used} (by the classes ${classesUsed})`,
    ...r.problems.map((p) => `problem: ${p}`),
  ].join("\n");
}

/** The bounds the report breaks, a line each; empty when it keeps them all. */
export function broken(r: ChaosReport): string[] {
  const out: string[] = [];
  for (const p of [...r.phases, r.whole]) {
    const over = p.breaches - p.causes.frozenHolder;
    if (over > 0) out.push(`${p.name}: ${over} breaches`);
    if (p.staleGrantSends > 0) out.push(`${p.name}: ${p.staleGrantSends} calls sent on stale grants`);
    if (p.stallMs > stallBound(p)) out.push(`${p.name}: stalled ${p.stallMs.toFixed(0)} ms`);
  }
  if (r.ratio < MIN_CHURN_RATIO) out.push(`kill churn kept ${(r.ratio * 100).toFixed(0)}% of calm`);
  const { keys, liveLeases, expiredLeases, waiters, used, classesUsed } = r.left;
  if (keys.length + liveLeases + expiredLeases + waiters + used + classesUsed > 0)
    out.push(`left in Redis: ${keys.join(", ")}`);
  return [...out, ...r.problems];
}

const COMMAND = command({
  name: "chaos",
  synopsis: "npm run chaos -- [flags]",
  about:
    "Chaos for the Redis semaphore fleet: worker processes loop admit → fetch → release against a\n" +
    "provider capped at the semaphore's limit, through phases of faults (SIGKILL churn, frozen\n" +
    "holders and waiters, CLIENT KILL, SCRIPT FLUSH, redis-server restarts). Starts its own\n" +
    "redis-server with persistence. Prints figures per phase; exits 1 when a bound is broken. With\n" +
    "--gate, the workers call through a fused gate: a token bucket, the semaphore, an AIMD limiter\n" +
    "and an interval gate, in one script call per admission and per release.",
  flags: {
    seconds: { type: "number", default: 60, min: 1, help: "length of each phase, s" },
    workers: { type: "int", default: DEFAULTS.workers, help: "worker processes" },
    callers: { type: "int", default: DEFAULTS.callers, help: "callers per worker" },
    limit: { type: "int", default: DEFAULTS.limit, help: "the semaphore's permits and the provider's cap" },
    "lease-ms": { type: "int", default: DEFAULTS.leaseMs, min: 100, help: "permit lease, ms" },
    "poll-ms": { type: "int", default: DEFAULTS.pollMs, help: "how often a waiter polls Redis, ms" },
    "kill-every-ms": {
      type: "int",
      default: DEFAULTS.killEveryMs,
      help: "a worker is SIGKILLed about this often under kill churn, ms",
    },
    classes: { type: "boolean", help: "build the semaphore with traffic classes (interactive 2 : bulk 1)" },
    gate: {
      type: "boolean",
      help: "call through a fused gate: a token bucket, the semaphore, an AIMD limiter, an interval gate",
    },
    "gate-rate": {
      type: "number",
      default: DEFAULTS.gateRate,
      help: "with --gate: the bucket's refill a second",
    },
    "gate-spacing": {
      type: "number",
      default: DEFAULTS.gateSpacingMs,
      help: "with --gate: the host's spacing, ms",
    },
    "gate-jitter": {
      type: "number",
      default: DEFAULTS.gateJitterMs,
      help: "with --gate: the host's jitter, ms",
    },
    phase: {
      type: "string",
      multiple: true,
      choices: PHASES,
      value: "NAME",
      defaultText: "every phase, in order",
      help: "run only this phase",
    },
  },
  notes: ['e.g. npm run chaos -- --seconds 10 --phase calm --phase "kill churn"'],
});

async function main(): Promise<void> {
  const { values: v } = parseOrExit(COMMAND);
  const redis = await startPersistentRedis();
  try {
    const report = await runChaos({
      server: redis.server,
      phaseMs: v.seconds * 1000,
      workers: v.workers,
      callers: v.callers,
      limit: v.limit,
      leaseMs: v["lease-ms"],
      pollMs: v["poll-ms"],
      killEveryMs: v["kill-every-ms"],
      classes: v.classes,
      gate: v.gate,
      gateRate: v["gate-rate"],
      gateSpacingMs: v["gate-spacing"],
      gateJitterMs: v["gate-jitter"],
      phases: (v.phase.length > 0 ? v.phase : PHASES) as PhaseName[],
      progress: (line) => console.error(line),
    });
    console.log(formatReport(report));
    const failures = broken(report);
    for (const f of failures) console.log(`FAILED: ${f}`);
    process.exitCode = failures.length > 0 ? 1 : 0;
  } finally {
    await redis.remove();
  }
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) await main();
