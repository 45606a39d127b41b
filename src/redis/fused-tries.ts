/**
 * A fused gate's tries in this process: each goes with its turn's others in one `gate` call
 * (lua/gate.lua), every stage gathering its own step into it; and a try that gave up, or whose
 * call ran after it had failed, leaves the gate's lines it took a place in.
 */
import type { BaseStage, StepDone } from "../base/stage.js";
import type { FusedCall } from "../fuse.js";
import type { Stage } from "../types.js";
import { TurnQueue } from "./batch.js";
import { Answers, type TryOutcomes } from "./fused-answers.js";
import type { Attempt, Held } from "./fused-kept.js";
import type { GateCall, GateHead, GateReply } from "./gate-call.js";
import { grantReplies } from "./gate-reply.js";
import { askAgainWhileAway, type RedisLink } from "./link.js";

/** A try's call in its `gate` call: the earlier try whose steps are kept goes with it (`#ranLate`). */
interface TryCall extends GateCall {
  kept: Held | undefined;
}

/** A try waiting to go with this turn's others. */
interface Try {
  call: FusedCall;
  member: string;
  /** The call's lane and its expiries (the fused gate's `#laneOf`). */
  lane: readonly string[];
  wait: boolean;
  /** The try's number. */
  try: number;
  /** The call's earlier try whose steps are kept, if any. */
  kept: Held | undefined;
  resolve: (a: Attempt) => void;
  reject: (error: unknown) => void;
}

/** A stage of a fused gate: it admits by gathering its step into the gate's call (`tryStep`). */
type DirectStage = Stage & Pick<BaseStage, "tryStep">;

/** What a fused gate's tries need of their gate. */
export interface TriesHost {
  /** The gate's name, for its script calls. */
  name: string;
  stages: readonly Stage[];
  link: RedisLink;
  /** The heads of the gate's admissions and of its leaves (lua/gate.lua: "all", "leave"). */
  admits: GateHead;
  leaves: GateHead;
  /** Whether this process listens on its wake channel: then a waiter's steps are kept. */
  heard: () => boolean;
  /** Tells each try what it gave. */
  outcomes: TryOutcomes;
  /** The wake-ups and grants a reply carries, for this process's callers. */
  wakeAll(messages: readonly string[]): void;
}

/** One fused gate's tries in this process. */
export class FusedTries {
  readonly #host: TriesHost;

  constructor(host: TriesHost) {
    this.#host = host;
  }

  /** Tries: with this turn's others in one `gate` call. */
  readonly #tries = new TurnQueue<Try>((tries) => this.#send(tries));

  /**
   * One try of every stage, in a `gate` call with this turn's other tries (decided in turn, as
   * if each had come alone). Each stage runs its own `tryAdmit`, whose script call the link
   * gathers as a step.
   */
  attempt(
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
    const stages = this.#host.stages as readonly DirectStage[];
    const answers = tries.map(() => new Answers(stages.length));
    const calls = tries.map(
      (t, c): TryCall => ({
        kept: t.kept,
        member: t.member,
        // (Steps are kept only once this process listens for grants: a release passes over a
        // waiter nobody listens for, as one whose process died.)
        mode: t.wait ? (this.#host.heard() ? "hold" : "wait") : "try",
        try: t.try,
        held: t.kept?.try ?? "",
        lane: t.lane,
        fn: (count) => {
          const a = answers[c]!;
          // The try's name, which its stages give their leases and grants when they can: the
          // member on a first try, so that a turn's first tries differ in it alone (gate-call.ts).
          const name = t.try === 1 ? t.member : `${t.member}.${t.try}`;
          for (let i = 0; i < stages.length; i++) {
            const stage = stages[i]!;
            const before = count();
            const done: StepDone = (ticket, error) => a.answer(i, ticket, error);
            try {
              stage.tryStep(t.call.optionsFor(stage), done, name);
            } catch (error) {
              done(undefined, error);
            }
            a.stepOf[i] = count() > before ? before : -1;
          }
        },
      }),
    );
    const sent = this.#host.link.gather(this.#host.name, this.#host.admits, calls, this.#ranLate);
    const each = (reply: (c: number) => GateReply | undefined, failed: boolean, error: unknown) => {
      for (let c = 0; c < tries.length; c++) {
        const t = tries[c]!;
        try {
          this.#host.outcomes.answered(reply(c), failed, error, answers[c]!, t);
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
      this.leave(calls.filter((call) => call.mode !== "try"));
      return;
    }
    const leaving: GateCall[] = [];
    for (let c = 0; c < calls.length; c++) {
      const reply = replies[c];
      if (!Array.isArray(reply)) continue;
      if (Number(reply[0]) === 2) (calls[c] as TryCall).kept?.collectedLate(grantReplies(String(reply[5])));
      else if (Number(reply[2]) !== 0) leaving.push(calls[c]!);
    }
    this.leave(leaving);
  };

  /**
   * Take each of `leavers` out of the gate's lines in the background (they gave up), in one call.
   * With Redis away (a dropped connection, as often as not what they gave up on), it asks again
   * shortly, for as long as a place in line could still be held without asking: a place left
   * behind would hold up everyone after it in its line until it ran out.
   */
  leave(leavers: readonly Pick<GateCall, "member" | "lane">[], waitedMs = 0): void {
    if (leavers.length === 0) return;
    const calls = leavers.map(
      ({ member, lane }): GateCall => ({ member, mode: "try", try: "", held: "", lane, fn: () => {} }),
    );
    const link = this.#host.link;
    link.gather(this.#host.name, this.#host.leaves, calls)?.then(
      (replies) => {
        for (const reply of replies) this.#host.wakeAll(reply.woken);
      },
      (error: unknown) => {
        const ttlMs = this.#host.leaves.waiterTtlMs;
        askAgainWhileAway(link.clock, error, waitedMs, ttlMs / 3, ttlMs, (waited) =>
          this.leave(leavers, waited),
        );
      },
    );
  }
}
