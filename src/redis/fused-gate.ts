/**
 * A Gate of Redis stages decided in one script call (lua/gate.lua): each stage's own script runs
 * as a step, at one instant of server time, all or nothing; a release of the whole gate is one
 * call too. A call a permit stage refuses waits in the gate's line in Redis, holding nothing.
 * Here is a call's admission, try after try; its parts are in the fused-*.ts files beside it: the
 * tries sent in turns (fused-tries.ts) and what each gave (fused-answers.ts), the steps Redis keeps
 * for a waiter (fused-kept.ts), its sleeps (fused-sleeps.ts), the stage it waits for
 * (fused-waits.ts), permits freed outside the gate (fused-freed.ts) and the releases
 * (fused-releases.ts).
 */
import { randomBytes } from "node:crypto";
import type { Clock } from "../clock.js";
import { isFloodgateError } from "../errors.js";
import { type FusedAdmission, type FusedCall, type FusionHost, gateTimeout } from "../fuse.js";
import { settleAll } from "../gate-ticket.js";
import type { Outcome, Stage, Ticket } from "../types.js";
import { TryOutcomes } from "./fused-answers.js";
import { FreedPermits } from "./fused-freed.js";
import { type Attempt, type Held, KeptTries } from "./fused-kept.js";
import { FusedReleases } from "./fused-releases.js";
import { FusedSleeps } from "./fused-sleeps.js";
import { FusedTries } from "./fused-tries.js";
import { FusedWaits } from "./fused-waits.js";
import { type GateCall, type GateHead, onWire } from "./gate-call.js";
import { stageKey } from "./keys.js";
import { awayDelay, type RedisLink } from "./link.js";

/** What the fused gates of one Redis backend share. */
export interface FusionSettings {
  link: RedisLink;
  prefix: string;
  clock: Clock;
  random: () => number;
  /** Longest a waiter goes without asking Redis again, ms. */
  pollMs: number;
}

/** The Redis backend's host for fused gates: one per `redis(client)`, absent on a Cluster. */
export class RedisFusion implements FusionHost {
  constructor(readonly settings: FusionSettings) {}

  fuse(gate: string, stages: readonly Stage[]): FusedAdmission {
    return new FusedGate(gate, stages, this.settings);
  }
}

/**
 * The most lanes (keys and hosts) whose keys a fused gate keeps made (`#laneOf`): past it, they
 * are made again. One array a call less for the usual few; a bound for a key per user.
 */
const MAX_LANES = 1024;

/** One gate's fused stages on one Redis backend, in this process. */
class FusedGate implements FusedAdmission {
  readonly #name: string;
  readonly #stages: readonly Stage[];
  readonly #s: FusionSettings;
  readonly #link: RedisLink;
  /** Names this process's places in the gate's line, and its wake channel. */
  readonly #token = randomBytes(8).toString("hex");
  #members = 0;
  /** The gate's keys: its permit line, the line's expiries, its sequence, kept steps, their expiries. */
  readonly #keys: readonly string[];
  /** The lane of a gate without keyed buckets or interval gates, and its expiries. */
  readonly #lane: readonly string[];
  readonly #id: string;
  readonly #channel: string;
  /** Where this process's callers wait between tries. */
  readonly #sleeps: FusedSleeps;
  /** Permits freed at the gate's permit stages outside the gate, heard while callers wait. */
  readonly #freed: FreedPermits;
  /** The tries of this process's callers, sent in turns. */
  readonly #tries: FusedTries;
  /** The releases of this process's callers, sent in turns. */
  readonly #gives: FusedReleases;
  #listening: Promise<void> | undefined;

  constructor(name: string, stages: readonly Stage[], settings: FusionSettings) {
    this.#name = name;
    this.#stages = stages;
    this.#s = settings;
    this.#link = settings.link;
    // Processes that build the same gate (its name and its stages) share its line.
    const id = `gate:${name}|${stages.map((s) => s.name).join("|")}`;
    this.#id = id;
    this.#keys = ["line", "lexp", "gmeta", "held", "hexp"].map((part) => stageKey(settings.prefix, id, part));
    this.#lane = ["lane:", "lexp:"].map((part) => stageKey(settings.prefix, id, part));
    this.#channel = stageKey(settings.prefix, id, "gwake");
    // (Each stage's keys begin so, as Redis names them: see `FusedWaits.stretch`.)
    this.#waits = new FusedWaits(
      stages,
      stages.map((stage) => onWire(stageKey(settings.prefix, stage.name, ""))),
    );
    this.#admits = this.#head("all");
    this.#releases = this.#head("each");
    this.#leaves = this.#head("leave");
    this.#grants = this.#head("grant");
    this.#sleeps = new FusedSleeps(name, settings.clock);
    const wakeAll = (messages: readonly string[]) => this.#wakeAll(messages);
    this.#gives = new FusedReleases({
      name,
      link: this.#link,
      releases: this.#releases,
      ownCall: (fn) => this.#ownCall(fn),
      wakeAll,
    });
    this.#tries = new FusedTries({
      name,
      stages,
      link: this.#link,
      admits: this.#admits,
      leaves: this.#leaves,
      heard: () => this.#heard,
      outcomes: new TryOutcomes({
        name,
        pollMs: settings.pollMs,
        waits: this.#waits,
        together: (fn) => this.together(fn),
        wakeAll,
      }),
      wakeAll,
    });
    // (The wake channel as Redis names it, a lone surrogate as U+FFFD, names this gate where
    // lua/gate.lua says who freed permits: floodgate_freed.)
    const wire = onWire(this.#channel);
    this.#freed = new FreedPermits({
      stages,
      link: this.#link,
      onWire: wire,
      from: `${wire}|${this.#token}`,
      releases: this.#releases,
      grant: () =>
        this.#link.gather(name, this.#grants, [this.#ownCall(() => {})])!.then((replies) => {
          this.#wakeAll(replies[0]!.woken);
        }),
      closed: () => this.#sleeps.closedBy !== undefined,
    });
  }

  /** The stage each call waits for, and each stretch of its wait counted against a stage. */
  readonly #waits: FusedWaits;

  /**
   * The keys of a call's lane (and its expiries): its key at stages keyed by key, its host at
   * stages keyed by host (interval gates). Calls of one lane wait for the same tokens and spacing.
   */
  #laneOf(call: FusedCall): readonly string[] {
    let lane = "";
    for (const stage of this.#stages) {
      const by = stage.keyedBy;
      if (by === undefined) continue;
      const o = call.optionsFor(stage);
      lane += `${by === "key" ? (o.key ?? "") : (o.host ?? "")}|`;
    }
    if (lane === "") return this.#lane;
    let keys = this.#lanes.get(lane);
    if (keys === undefined) {
      const prefix = this.#s.prefix;
      keys = [stageKey(prefix, this.#id, `lane:${lane}`), stageKey(prefix, this.#id, `lexp:${lane}`)];
      if (this.#lanes.size >= MAX_LANES) this.#lanes.clear();
      this.#lanes.set(lane, keys);
    }
    return keys;
  }

  /** The keys of the lanes calls came in lately, by lane (at most MAX_LANES: see `#laneOf`). */
  readonly #lanes = new Map<string, readonly string[]>();

  #head(op: GateHead["op"]): GateHead {
    return { keys: this.#keys, op, waiterTtlMs: this.#s.pollMs * 3, channel: this.#channel };
  }

  readonly #admits: GateHead;
  readonly #releases: GateHead;
  readonly #leaves: GateHead;
  readonly #grants: GateHead;

  /**
   * A call's first try goes out here, and a call it admits returns without the waiting loop
   * (`#waitFor`), which takes every other: most calls of a gate nothing binds are admitted at
   * their first try, and the loop's state, kept across its awaits, is most of what a call would
   * otherwise allocate.
   */
  admit(call: FusedCall, wait: boolean): Promise<Ticket[] | undefined> {
    const member = `${this.#token}-${++this.#members}`;
    const lane = this.#laneOf(call);
    const clock = this.#s.clock;
    this.#sleeps.begin(member);
    // A call with no time left to wait (`timeoutMs: 0`) only tries: it never takes a place in line.
    const lines = wait && call.deadline > clock.now();
    const at = clock.now();
    // (A member that just began cannot have been heard again: its first try is its own.)
    return this.#tries.attempt(call, member, lane, lines, 1, undefined).then(
      (attempt) => {
        if (attempt.tickets === undefined) return this.#waitFor(call, wait, member, lane, lines, at, attempt);
        this.#done(member);
        // (As the loop counts a try's stretch: nobody to charge before a first try.)
        this.#waits.stretch(-1, at, -1, attempt.reply);
        return attempt.tickets;
      },
      (error: unknown) => {
        this.#done(member);
        throw error;
      },
    );
  }

  /** `member`'s call is done with its admission, admitted or not. */
  #done(member: string): void {
    this.#freed.gone(member);
    this.#kept.end(member);
    this.#sleeps.end(member);
  }

  /**
   * A call its first try (`first`, sent at `firstAt`) did not admit: it waits, holding nothing,
   * and tries again until every stage admits it, it gives up, or, with `wait` false, at once.
   */
  async #waitFor(
    call: FusedCall,
    wait: boolean,
    member: string,
    lane: readonly string[],
    lines: boolean,
    firstAt: number,
    first: Attempt,
  ): Promise<Ticket[] | undefined> {
    const clock = this.#s.clock;
    let inLine = false;
    let pending: Attempt | undefined = first;
    // The stage the call waited for since its previous try, and when that try went out; the
    // permit line's firsts' rate waits in all, as that try's reply said (see `FusedWaits.stretch`).
    let blame = -1;
    let since = 0;
    let rateAt = -1;
    // Refused permits, first in line: ms until a permit could free by itself (see `FusedWaits.refused`).
    let soonest = -1;
    let tries = 1;
    // The latest try whose steps Redis keeps while the call waits (a release may admit them).
    let held: Held | undefined;
    // Asking because the gate's channel was heard again, or just began to be (a wake-up may have
    // been lost), not by its own schedule: how long such tries have failed for. Redis away again
    // then fails nothing, as it would not have at the call's own try: it asks again shortly, for
    // up to a poll, and then fails closed as that try would have. (Each failed try's steps give
    // back what they may have taken, as they do when the call fails closed.)
    let softMs: number | undefined;
    try {
      for (;;) {
        let at: number;
        let attempt: Attempt;
        if (pending !== undefined) {
          at = firstAt;
          attempt = pending;
          pending = undefined;
        } else {
          at = clock.now();
          if (this.#sleeps.takeHeardAgain(member)) softMs ??= 0;
          try {
            attempt = await this.#tries.attempt(call, member, lane, lines, ++tries, held);
          } catch (error) {
            if (softMs === undefined || !isFloodgateError(error, "BACKEND_UNAVAILABLE")) throw error;
            const delay = awayDelay(softMs, this.#s.pollMs);
            if (softMs + delay >= this.#s.pollMs) throw error;
            await this.#sleeps.sleep(member, delay, call, this.#waitedFor(blame));
            softMs += delay;
            continue;
          }
        }
        softMs = undefined;
        // The stretch up to this try is counted now that its reply says what the line waited for.
        this.#waits.stretch(blame, at - since, rateAt, attempt.reply);
        since = at;
        rateAt = attempt.reply?.lineRateMs ?? -1;
        if (held) {
          // This try's reply says whether a release admitted the kept steps (collected), unless
          // the grant's message said so first; else they are done with.
          const before = held;
          held = this.#kept.unhold(member);
          before.settle(attempt.collected);
          const earlier = await before.result;
          if (earlier.tickets) {
            // (A try that collects runs none of its steps: it cannot have been admitted too.)
            if (attempt.tickets) await this.together(() => settleAll(attempt.tickets!, undefined));
            return earlier.tickets;
          }
        }
        if (attempt.tickets) return attempt.tickets;
        const reply = attempt.reply;
        blame = attempt.blame;
        soonest = attempt.soonest ?? -1;
        inLine = reply?.inLine !== undefined;
        this.#freed.placed(member, reply?.inLine === "permits", attempt.first === true);
        if (!wait) return undefined;
        if (attempt.held) {
          held = attempt.held;
          this.#kept.keep(member, held);
        }
        // First in its line, refused by rates that cannot admit it before its deadline (counted
        // from when this try went out, no later than Redis decided it): refused at once, as a
        // lone token bucket refuses, saying when they could (its kept steps are dropped, its
        // place left, below), unless a release admitted its kept steps meanwhile.
        const rateMs = reply?.waitMs ?? -1;
        if (rateMs >= 0 && at + rateMs > call.deadline && !held?.granted) {
          throw gateTimeout(this.#name, call, this.#waitedFor(blame), rateMs);
        }
        for (;;) {
          if (held?.granted) {
            const granted = held;
            held = this.#kept.unhold(member);
            const result = await granted.result;
            // The wait since its last try ended with the grant: counted as a try's would be.
            const now = clock.now();
            this.#waits.stretch(blame, now - since, rateAt, granted.rate);
            since = now;
            if (result.tickets) return result.tickets;
            break;
          }
          // Listen before sleeping in line, then ask once more: a wake sent meanwhile is not lost.
          // That ask is the process's choice, as one on being heard again (`softMs`): Redis away
          // then fails nothing for up to a poll. (Without a subscription, it polls.)
          if (inLine && this.#listening === undefined) {
            const listening = await this.#listen().then(
              () => true,
              () => false,
            );
            // (A grant that came meanwhile is taken above.)
            if (listening) {
              if (held?.granted) continue;
              softMs ??= 0;
              break;
            }
          }
          // Told to ask again while this try was out: ask at once.
          if (this.#sleeps.takeWoken(member)) break;
          // Whole ms, as Redis counts waits: a wake-up between two ms would find the wait not over.
          const poll = Math.ceil(this.#s.pollMs * (0.5 + this.#s.random()));
          const waitMs = reply?.waitMs ?? -1;
          // (Right behind a first that may have frozen or died: no later than its place ends.)
          const ahead = reply?.aheadMs === undefined ? -1 : reply.aheadMs + 1;
          const until = waitMs >= 0 ? waitMs : soonest >= 0 ? soonest + 1 : ahead;
          const ms = until >= 0 ? Math.min(until, poll) : poll;
          await this.#sleeps.sleep(member, ms, call, this.#waitedFor(blame));
          if (!held?.granted) break;
        }
      }
    } catch (error) {
      // Its wait until it gave up (timed out, aborted, closed) counts too.
      this.#waits.charge(blame, clock.now() - since);
      if (held) this.#drop(held);
      if (inLine) this.#tries.leave([{ member, lane }]);
      throw error;
    } finally {
      this.#done(member);
    }
  }

  /** The stage a call waits for, by its index (`blame`; -1: none known). */
  #waitedFor(blame: number): Stage | undefined {
    return blame >= 0 ? this.#stages[blame] : undefined;
  }

  /** A kept try given up: its steps are done with; tickets a grant gave it go back. */
  #drop(held: Held): void {
    held.settle(undefined);
    held.result.then(
      (r) => r.tickets && this.together(() => settleAll(r.tickets!, undefined)),
      () => {},
    );
  }

  /** Tries of this process's callers whose steps Redis keeps while they wait. */
  readonly #kept = new KeptTries();

  /**
   * A message on the wake channel, or in a reply: a member told to ask again, or a grant
   * ("g|<member>|<try>|<replies>": a release admitted the member's kept steps).
   */
  #onWake(message: string): void {
    if (!message.startsWith("g|")) {
      this.#sleeps.wake(message);
      return;
    }
    const woken = this.#kept.granted(message, (member) => this.#sleeps.trying(member));
    if (woken !== undefined) this.#sleeps.wake(woken);
  }

  /**
   * Run `fn` (releases, refunds, settles of this gate's stages) with its script calls gathered
   * into one `gate` call with this turn's others.
   */
  together(fn: () => Promise<void>): Promise<void> {
    return this.#gives.together(fn);
  }

  settle(tickets: readonly Ticket[], outcome: Outcome | undefined): Promise<void> {
    return this.#gives.settle(tickets, outcome);
  }

  close(reason: unknown): void {
    this.#freed.close();
    this.#sleeps.close(reason);
  }

  #wakeAll(messages: readonly string[]): void {
    for (const m of messages) this.#onWake(m);
  }

  /** Whether this process listens on its wake channel (then its waiters' steps are kept). */
  #heard = false;

  #listen(): Promise<void> {
    // Heard again after its connection was lost, every caller here asks again: a wake-up sent
    // meanwhile was lost (a waiter whose turn in its lane came), or a release passed a waiter over
    // in the permit line while nobody listened for it. Else each would sleep until its poll.
    this.#listening ??= this.#link
      .listen(
        `${this.#channel}:${this.#token}`,
        (message) => this.#onWake(message),
        () => this.#sleeps.wakeAll(),
      )
      .then(
        () => {
          this.#heard = true;
        },
        (error: unknown) => {
          this.#listening = undefined;
          throw error;
        },
      );
    return this.#listening;
  }

  /**
   * A call of the gate's own, for its releases or a `grant`: no place in line, its member this
   * gate's token (lua/gate.lua names who freed permits by it, as another gate is told).
   */
  #ownCall(fn: GateCall["fn"]): GateCall {
    return { member: this.#token, mode: "try", try: "", held: "", lane: this.#lane, fn };
  }
}
