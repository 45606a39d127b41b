/**
 * Graceful shutdown, shared by every stage and the Gate: the options, the state of a drain under
 * way, and `drainOnSignals` for a worker process.
 */
import { z } from "zod";
import { drainChannel } from "./channels.js";
import type { Clock, ClockTimer } from "./clock.js";
import type { DrainingError } from "./errors.js";
import type { DrainOptions, DrainResult, StageKind } from "./types.js";
import { checkTargets, parseOptions } from "./validate.js";

/** How long calls in flight get by default, ms. */
export const DEFAULT_GRACE_MS = 30_000;

const drainFields = {
  graceMs: z
    .number({ error: "must be a finite number >= 0" })
    .refine((v) => Number.isFinite(v) && v >= 0, { error: "must be a finite number >= 0" })
    .optional(),
  waiting: z.enum(["reject", "admit"], { error: 'must be "reject" or "admit"' }).optional(),
};
const drainSchema = z.strictObject(drainFields);
const onSignalsSchema = z.strictObject({
  ...drainFields,
  signals: z
    .array(z.string({ error: "must be an array of signal names" }).min(1), {
      error: "must be an array of signal names",
    })
    .optional(),
  onDrained: z
    .custom<(result: DrainResult) => void>((v) => typeof v === "function", { error: "must be a function" })
    .optional(),
  exit: z.boolean({ error: "must be true or false" }).optional(),
});

/** `options` checked: an `InvalidOptionsError` naming the field, else the grace and the waiting rule. */
export function drainOptions(
  kind: StageKind,
  name: string,
  options: DrainOptions | undefined,
): { graceMs: number; waiting: "reject" | "admit" } {
  const o = parseOptions(drainSchema, kind, name, options ?? {});
  return { graceMs: o.graceMs ?? DEFAULT_GRACE_MS, waiting: o.waiting ?? "reject" };
}

/** A drain under way: its error, its count of calls that released in time, its wait. */
export class Drain {
  completed = 0;
  /** Set when the grace has run out: releases from then on are the drain's own. */
  forcing = false;
  #idle: (() => boolean) | undefined;
  #done: (() => void) | undefined;

  constructor(readonly error: DrainingError) {}

  /** A release in time: count it, unless the drain is releasing what is left. */
  released(): void {
    if (!this.forcing) this.completed++;
    this.poke();
  }

  /**
   * Something changed (a release, a waiter gone): end the wait if `idle` holds once the code
   * that changed it is done (a waiter leaves its line just before its ticket is issued).
   */
  poke(): void {
    if (this.#done === undefined || this.#checking) return;
    this.#checking = true;
    queueMicrotask(() => {
      this.#checking = false;
      if (this.#done !== undefined && this.#idle!()) this.#done();
    });
  }

  #checking = false;

  /** Resolve once `idle()` holds (checked on every `poke`) or after `ms` on `clock`. */
  until(idle: () => boolean, ms: number, clock: Clock): Promise<void> {
    if (idle()) return Promise.resolve();
    return new Promise<void>((resolve) => {
      let timer: ClockTimer | undefined;
      const done = () => {
        if (timer !== undefined) clock.clearTimeout(timer);
        this.#done = undefined;
        this.#idle = undefined;
        resolve();
      };
      timer = clock.setTimeout(() => {
        timer = undefined;
        done();
      }, ms);
      this.#idle = idle;
      this.#done = done;
    });
  }
}

/** What a stage or a gate keeps of its drain: the one under way, its promise, and its end. */
export class Drains {
  /** The drain under way, once `drain` has begun (new calls are refused from then on). */
  current: Drain | undefined = undefined;
  #promise: Promise<DrainResult> | undefined = undefined;
  /**
   * Set once the grace has run out and the owner has released every ticket itself: a holder's
   * own release afterwards gives back nothing more.
   */
  releasedAll = false;

  /**
   * A ticket of `owner` is being released: count it out of the calls in flight (and into the
   * drain's); false when the drain has released it already.
   */
  ticketDone(owner: { inFlight: number }): boolean {
    if (this.releasedAll) return false;
    owner.inFlight--;
    this.current?.released();
    return true;
  }

  /**
   * Run `run` with the checked options, once: a later call gets the same promise; bad options
   * reject with `InvalidOptionsError`, and nothing starts. Its result is published on
   * `floodgate:drain`.
   */
  start(
    kind: StageKind,
    name: string,
    options: DrainOptions | undefined,
    run: (graceMs: number, waiting: "reject" | "admit") => Promise<DrainResult>,
  ): Promise<DrainResult> {
    let o: ReturnType<typeof drainOptions>;
    try {
      o = drainOptions(kind, name, options);
    } catch (error) {
      return Promise.reject(error);
    }
    this.#promise ??= run(o.graceMs, o.waiting).then((result) => {
      if (drainChannel.hasSubscribers) drainChannel.publish({ stage: name, kind, ...result });
      return result;
    });
    return this.#promise;
  }
}

/** What a drain reports when there was nothing to drain (closed already). */
export function nothingDrained(): DrainResult {
  return { completed: 0, aborted: 0, rejected: 0, tookMs: 0 };
}

/** What `drainOnSignals` drains: a gate or a stage. */
export interface Drainable {
  drain(options?: DrainOptions): Promise<DrainResult>;
}

/** Options for `drainOnSignals`. */
export interface DrainOnSignalsOptions extends DrainOptions {
  /** The signals to drain on. @default ["SIGTERM", "SIGINT"] */
  signals?: readonly NodeJS.Signals[];
  /** Called with what the drain did, before the process exits. */
  onDrained?: (result: DrainResult) => void;
  /**
   * Exit the process once drained (`process.exit(0)`; a second signal during the drain exits at
   * once with 1). `false` leaves the process running. @default true
   */
  exit?: boolean;
}

/**
 * On the first of `signals` (SIGTERM, SIGINT), drain every one of `targets` (gates or stages)
 * with `options`, hand the results to `onDrained`, then exit the process (unless `exit: false`).
 * A second signal while draining exits at once with code 1. Returns a function that removes the
 * handlers.
 */
export function drainOnSignals(
  targets: Drainable | readonly Drainable[],
  options: DrainOnSignalsOptions = {},
): () => void {
  const list = checkTargets<Drainable>("drainOnSignals", targets, "drain", false);
  const o = parseOptions(onSignalsSchema, "gate", "drainOnSignals", options);
  const { signals = ["SIGTERM", "SIGINT"], onDrained, exit = true, ...rest } = o;
  const drain: DrainOptions = {};
  if (rest.graceMs !== undefined) drain.graceMs = rest.graceMs;
  if (rest.waiting !== undefined) drain.waiting = rest.waiting;
  let draining = false;
  const handler = () => {
    if (draining) {
      if (exit) process.exit(1);
      return;
    }
    draining = true;
    void Promise.all(list.map((t) => t.drain(drain))).then(
      (results) => {
        const total: DrainResult = nothingDrained();
        for (const r of results) {
          total.completed += r.completed;
          total.aborted += r.aborted;
          total.rejected += r.rejected;
          total.tookMs = Math.max(total.tookMs, r.tookMs);
        }
        onDrained?.(total);
        if (exit) process.exit(0);
      },
      (error: unknown) => {
        process.emitWarning(`floodgate: drain failed: ${(error as Error)?.message ?? String(error)}`);
        if (exit) process.exit(1);
      },
    );
  };
  for (const s of signals) process.on(s, handler);
  return () => {
    for (const s of signals) process.off(s, handler);
  };
}
