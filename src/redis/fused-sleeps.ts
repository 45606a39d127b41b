/**
 * Where a fused gate's callers in this process wait between their tries: asleep until woken (a
 * message on the gate's wake channel, or a reply that names them), their wait's end, the poll,
 * or the caller giving up; and the gate's close, which ends every sleeper at once.
 */
import { SignalWaits } from "../base/signal-waits.js";
import type { Clock, ClockTimer } from "../clock.js";
import { badSignal, type FusedCall, gateTimeout } from "../fuse.js";
import type { Stage } from "../types.js";

/** A sleeping call's way to be woken early: with no error by a wake message, with one on close. */
type Wake = (error?: unknown) => void;

/** The sleeps of one fused gate's callers in this process, by member. */
export class FusedSleeps {
  readonly #name: string;
  readonly #clock: Clock;
  readonly #wakes = new Map<string, Wake>();
  /** Sleeping calls' abort listeners: one per caller's signal (see `SignalWaits`). */
  readonly #signalWaits = new SignalWaits();
  /** Members of this process whose call is in its admission (asking or sleeping). */
  readonly #trying = new Set<string>();
  /** Members told to ask again while their try was out. */
  readonly #woken = new Set<string>();
  /** Members woken because the gate's channel was heard again (`wakeAll`), until they ask. */
  readonly #heardAgain = new Set<string>();
  /** Why the gate closed, once it has: sleepers and later sleeps reject with it. */
  #closedBy: unknown;

  constructor(name: string, clock: Clock) {
    this.#name = name;
    this.#clock = clock;
  }

  /** `member`'s call begins its admission. */
  begin(member: string): void {
    this.#trying.add(member);
  }

  /** `member`'s call is done with its admission, admitted or not. */
  end(member: string): void {
    this.#trying.delete(member);
    this.#woken.delete(member);
    this.#heardAgain.delete(member);
  }

  /** Whether `member`'s call is in its admission here. */
  trying(member: string): boolean {
    return this.#trying.has(member);
  }

  /**
   * Wake `member` if it sleeps; if its try is out, remember the wake-up for when the try's reply
   * comes (the wake-up travels on the pub/sub connection, the reply on another: either can come
   * first), so it asks again at once instead of sleeping through it.
   */
  wake(member: string): void {
    const wake = this.#wakes.get(member);
    if (wake) wake();
    else if (this.#trying.has(member)) this.#woken.add(member);
  }

  /**
   * Wake every call of this process in its admission, as `wake` wakes one: the gate's wake
   * channel was not heard for a while (its connection was lost), so a message meant for any of
   * them may have been lost with it.
   */
  wakeAll(): void {
    for (const member of this.#trying) {
      this.#heardAgain.add(member);
      this.wake(member);
    }
  }

  /**
   * Whether `member` was woken by `wakeAll` since it last asked (an ask of its process's choosing,
   * which Redis away again should not fail: see `FusedGate.admit`); forgets it.
   */
  takeHeardAgain(member: string): boolean {
    return this.#heardAgain.delete(member);
  }

  /** Whether `member` was told to ask again while its try was out; forgets it. */
  takeWoken(member: string): boolean {
    return this.#woken.delete(member);
  }

  /** Why the gate closed, or undefined while it is open. */
  get closedBy(): unknown {
    return this.#closedBy;
  }

  /**
   * Sleep `ms`, or until woken; rejects when the caller gives up or the gate closes (`close`
   * ends every sleeper: one listener per gate, not one per waiting call on its closed signal).
   * Out of time, it rejects with `AdmitTimeoutError` naming `waitedFor`, the stage the call
   * waits for (undefined: none known).
   */
  sleep(member: string, ms: number, call: FusedCall, waitedFor?: Stage): Promise<void> {
    const clock = this.#clock;
    const left = call.deadline - clock.now();
    if (left <= 0) return Promise.reject(gateTimeout(this.#name, call, waitedFor));
    if (call.signal?.aborted) return Promise.reject(call.signal.reason);
    if (this.#closedBy !== undefined) return Promise.reject(this.#closedBy);
    return new Promise<void>((resolve, reject) => {
      let timer: ClockTimer | undefined;
      const end = (error?: unknown) => {
        if (timer !== undefined) clock.clearTimeout(timer);
        this.#wakes.delete(member);
        if (call.signal) this.#signalWaits.remove(call.signal, onAbort);
        if (error === undefined) resolve();
        else reject(error);
      };
      const onAbort = () => end(call.signal!.reason);
      const timedOut = ms >= left;
      timer = clock.setTimeout(
        () => {
          timer = undefined;
          end(timedOut ? gateTimeout(this.#name, call, waitedFor) : undefined);
        },
        Math.min(ms, left),
      );
      this.#wakes.set(member, end);
      try {
        if (call.signal) this.#signalWaits.add(call.signal, onAbort);
      } catch (error) {
        end(badSignal(this.#name, error));
      }
    });
  }

  /** The gate closed with `reason`: every sleeper, and every later sleep, rejects with it. */
  close(reason: unknown): void {
    this.#closedBy = reason;
    for (const end of [...this.#wakes.values()]) end(reason);
  }
}
