/**
 * A Gate of Redis stages decided in one script call (lua/gate.lua): each stage's own script runs
 * as a step, at one instant of server time, all or nothing; a release of the whole gate is one
 * call too. A call a permit stage refuses waits in the gate's line in Redis, holding nothing.
 */
import { randomBytes } from "node:crypto";
import type { BaseStage, StepDone } from "../base/stage.js";
import type { Clock } from "../clock.js";
import type { FusedAdmission, FusedCall, FusionHost } from "../fuse.js";
import { settleAll, settleSteps } from "../gate-ticket.js";
import type { Outcome, Stage, Ticket } from "../types.js";
import { TurnQueue } from "./batch.js";
import { Answers, TryOutcomes } from "./fused-answers.js";
import { FreedPermits } from "./fused-freed.js";
import { type Attempt, type Held, KeptTries } from "./fused-kept.js";
import { FusedSleeps } from "./fused-sleeps.js";
import { FusedWaits } from "./fused-waits.js";
import { type GateCall, type GateHead, type GateReply, onWire } from "./gate-call.js";
import { grantReplies } from "./gate-reply.js";
import { stageKey } from "./keys.js";
import type { RedisLink } from "./link.js";

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

/** A try's call in its `gate` call: the earlier try whose steps are kept goes with it (`#ranLate`). */
interface TryCall extends GateCall {
  kept: Held | undefined;
}

/** A try waiting to go with this turn's others. */
interface Try {
  call: FusedCall;
  member: string;
  /** The call's lane and its expiries (`#laneOf`). */
  lane: readonly string[];
  wait: boolean;
  /** The try's number. */
  try: number;
  /** The call's earlier try whose steps are kept, if any. */
  kept: Held | undefined;
  resolve: (a: Attempt) => void;
  reject: (error: unknown) => void;
}

/**
 * Releases waiting to go with this turn's others: a function that makes them (`together`), or
 * tickets to release with an outcome or refund without (`settle`).
 */
interface Give {
  fn: (() => Promise<void>) | undefined;
  tickets: readonly Ticket[];
  outcome: Outcome | undefined;
  resolve: () => void;
  reject: (error: unknown) => void;
}

const NO_TICKETS: readonly Ticket[] = [];

/**
 * The most lanes (keys and hosts) whose keys a fused gate keeps made (`#laneOf`): past it, they
 * are made again. One array a call less for the usual few; a bound for a key per user.
 */
const MAX_LANES = 1024;

/** A stage of a fused gate: it admits by gathering its step into the gate's call (`tryStep`). */
type DirectStage = Stage & Pick<BaseStage, "tryStep">;

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
  /** What each try gave, told to its caller. */
  readonly #outcomes: TryOutcomes;
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
    this.#outcomes = new TryOutcomes({
      name,
      pollMs: settings.pollMs,
      waits: this.#waits,
      together: (fn) => this.together(fn),
      wakeAll: (messages) => this.#wakeAll(messages),
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

  async admit(call: FusedCall, wait: boolean): Promise<Ticket[] | undefined> {
    const member = `${this.#token}-${++this.#members}`;
    const lane = this.#laneOf(call);
    const clock = this.#s.clock;
    let inLine = false;
    this.#sleeps.begin(member);
    // The stage the call waited for since its previous try, and when that try went out; the
    // permit line's firsts' rate waits in all, as that try's reply said (see `FusedWaits.stretch`).
    let blame = -1;
    let since = 0;
    let rateAt = -1;
    // Refused permits, first in line: ms until a permit could free by itself (see `FusedWaits.refused`).
    let soonest = -1;
    // A call with no time left to wait (`timeoutMs: 0`) only tries: it never takes a place in line.
    const lines = wait && call.deadline > clock.now();
    let tries = 0;
    // The latest try whose steps Redis keeps while the call waits (a release may admit them).
    let held: Held | undefined;
    try {
      for (;;) {
        const at = clock.now();
        const attempt = await this.#attempt(call, member, lane, lines, ++tries, held);
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
          // (Without a subscription, it polls.)
          if (inLine && this.#listening === undefined) {
            const listening = await this.#listen().then(
              () => true,
              () => false,
            );
            // (A grant that came meanwhile is taken above.)
            if (listening) {
              if (held?.granted) continue;
              break;
            }
          }
          // Told to ask again while this try was out: ask at once.
          if (this.#sleeps.takeWoken(member)) break;
          // Whole ms, as Redis counts waits: a wake-up between two ms would find the wait not over.
          const poll = Math.ceil(this.#s.pollMs * (0.5 + this.#s.random()));
          const waitMs = reply?.waitMs ?? -1;
          const until = waitMs >= 0 ? waitMs : soonest >= 0 ? soonest + 1 : -1;
          await this.#sleeps.sleep(member, until >= 0 ? Math.min(until, poll) : poll, call);
          if (!held?.granted) break;
        }
      }
    } catch (error) {
      // Its wait until it gave up (timed out, aborted, closed) counts too.
      this.#waits.charge(blame, clock.now() - since);
      if (held) this.#drop(held);
      if (inLine) this.#leave([{ member, lane }]);
      throw error;
    } finally {
      this.#freed.gone(member);
      this.#kept.end(member);
      this.#sleeps.end(member);
    }
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

  /** Tries: with this turn's others in one `gate` call. */
  readonly #tries = new TurnQueue<Try>((tries) => this.#send(tries));

  /**
   * One try of every stage, in a `gate` call with this turn's other tries (decided in turn, as
   * if each had come alone). Each stage runs its own `tryAdmit`, whose script call the link
   * gathers as a step.
   */
  #attempt(
    call: FusedCall,
    member: string,
    lane: readonly string[],
    wait: boolean,
    tryNo: number,
    kept: Held | undefined,
  ): Promise<Attempt> {
    return new Promise<Attempt>((resolve, reject) => {
      this.#tries.add({ call, member, lane, wait, try: tryNo, kept, resolve, reject });
    });
  }

  #send(tries: Try[]): Promise<unknown> | undefined {
    const stages = this.#stages as readonly DirectStage[];
    const answers = tries.map(() => new Answers(stages.length));
    const calls = tries.map(
      (t, c): TryCall => ({
        kept: t.kept,
        member: t.member,
        // (Steps are kept only once this process listens for grants: a release passes over a
        // waiter nobody listens for, as one whose process died.)
        mode: t.wait ? (this.#heard ? "hold" : "wait") : "try",
        try: t.try,
        held: t.kept?.try ?? "",
        lane: t.lane,
        fn: (count) => {
          const a = answers[c]!;
          for (let i = 0; i < stages.length; i++) {
            const stage = stages[i]!;
            const before = count();
            const done: StepDone = (ticket, error) => a.answer(i, ticket, error);
            try {
              stage.tryStep(t.call.optionsFor(stage), done);
            } catch (error) {
              done(undefined, error);
            }
            a.stepOf[i] = count() > before ? before : -1;
          }
        },
      }),
    );
    const sent = this.#link.gather(this.#name, this.#admits, calls, this.#ranLate);
    const each = (reply: (c: number) => GateReply | undefined, failed: boolean, error: unknown) => {
      for (let c = 0; c < tries.length; c++) {
        const t = tries[c]!;
        try {
          this.#outcomes.answered(reply(c), failed, error, answers[c]!, t);
        } catch (e) {
          t.reject(e);
        }
      }
    };
    if (sent === undefined) each(() => undefined, false, undefined);
    else {
      sent.then(
        (replies) => each((c) => replies[c], false, undefined),
        (error: unknown) => each(() => undefined, true, error),
      );
    }
    return sent;
  }

  /** Releases: with this turn's others in one `gate` call. */
  readonly #gives = new TurnQueue<Give>((gives) => this.#give(gives));

  /**
   * Run `fn` (releases, refunds, settles of this gate's stages) with its script calls gathered
   * into one `gate` call with this turn's others.
   */
  together(fn: () => Promise<void>): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      this.#gives.add({ fn, tickets: NO_TICKETS, outcome: undefined, resolve, reject });
    });
  }

  settle(tickets: readonly Ticket[], outcome: Outcome | undefined): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      this.#gives.add({ fn: undefined, tickets, outcome, resolve, reject });
    });
  }

  /** Run the `fn` of each of `gives` with their script calls gathered into one `gate` call. */
  #give(gives: Give[]): Promise<unknown> | undefined {
    const call = this.#ownCall(() => {
      for (const g of gives) {
        if (g.fn) g.fn().then(g.resolve, g.reject);
        else settleSteps(g.tickets, g.outcome, g.resolve, g.reject);
      }
    });
    const sent = this.#link.gather(this.#name, this.#releases, [call]);
    sent?.then(
      (replies) => this.#wakeAll(replies[0]!.woken),
      () => {},
    );
    return sent;
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
    this.#listening ??= this.#link
      .listen(`${this.#channel}:${this.#token}`, (message) => this.#onWake(message))
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

  /**
   * A turn's `gate` call ran after its tries had failed closed (see `Late`): a try (a call) its reply left
   * in a line (the permit line, its steps kept or not, or its lane) leaves it, which also takes
   * back a grant made to it since; its caller has gone. A try that collected the grant a release
   * made to its call's kept steps (status 2) gives that grant back, step by step, as each kept
   * step would have given back its own reply run late. (Each step of the try gives back what it
   * took itself: see `ranLate` in link.ts.) Without replies (the client failed the call later,
   * and it may have run: see `Late`), each try that could have taken a place in line leaves it.
   */
  readonly #ranLate = (calls: readonly GateCall[], replies: unknown): void => {
    if (!Array.isArray(replies)) {
      this.#leave(calls.filter((call) => call.mode !== "try"));
      return;
    }
    const leaving: GateCall[] = [];
    for (let c = 0; c < calls.length; c++) {
      const reply = replies[c];
      if (!Array.isArray(reply)) continue;
      if (Number(reply[0]) === 2) (calls[c] as TryCall).kept?.collectedLate(grantReplies(String(reply[5])));
      else if (Number(reply[2]) !== 0) leaving.push(calls[c]!);
    }
    this.#leave(leaving);
  };

  /** Take each of `leavers` out of the gate's lines in the background (they gave up), in one call. */
  #leave(leavers: readonly Pick<GateCall, "member" | "lane">[]): void {
    if (leavers.length === 0) return;
    const calls = leavers.map(
      ({ member, lane }): GateCall => ({ member, mode: "try", try: "", held: "", lane, fn: () => {} }),
    );
    this.#link.gather(this.#name, this.#leaves, calls)?.then(
      (replies) => {
        for (const reply of replies) this.#wakeAll(reply.woken);
      },
      () => {},
    );
  }
}
