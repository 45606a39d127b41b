/**
 * `node:diagnostics_channel` events, as undici publishes its own: an APM or a dashboard
 * subscribes by name, and floodgate never knows about it. A message is built only when the
 * channel has a subscriber, so nobody pays for events nobody listens to.
 */
import diagnostics_channel from "node:diagnostics_channel";
import type { Outcome, StageKind } from "./types.js";

/** The channel names floodgate publishes on. */
export const CHANNELS = {
  /** A call admitted at once, without waiting. */
  admit: "floodgate:admit",
  /** A call starts to wait in a stage's line. */
  wait: "floodgate:wait",
  /** A waiting call is admitted. */
  grant: "floodgate:grant",
  /** A ticket is released (or refunded). */
  release: "floodgate:release",
  /** A bounded queue with `whenFull: "shed"` refused a call. */
  shed: "floodgate:shed",
  /** A host was paused on an interval gate. */
  pause: "floodgate:pause",
  /** A Redis lease ran out before its ticket was released. */
  leaseLost: "floodgate:lease-lost",
  /** A Redis call failed (refused, timed out, not connected): the call fails closed or falls back. */
  backendError: "floodgate:backend-error",
  /** A drain ended: what it did, and the waiting calls it rejected with `DrainingError`. */
  drain: "floodgate:drain",
} as const;

/** What every message names: the stage, its kind and its backend. */
export interface StageMessage {
  stage: string;
  kind: StageKind;
  backend: string;
}

/** `floodgate:admit`, `floodgate:wait`: a call of `cost` under `key` (its key, host or class; "" for none). */
export interface CallMessage extends StageMessage {
  key: string;
  cost: number;
}

/** `floodgate:grant`: a waiting call admitted after `waitedMs`. */
export interface GrantMessage extends CallMessage {
  waitedMs: number;
}

/** `floodgate:release`: a ticket released with `outcome` (`"refund"` for a refund) after `heldMs`. */
export interface ReleaseMessage extends CallMessage {
  outcome: Outcome | "refund";
  /** ms from admission to release. */
  heldMs: number;
}

/** `floodgate:shed`: a call of `cost` refused by a full queue. */
export interface ShedMessage extends StageMessage {
  cost: number;
}

/** `floodgate:pause`: `host` paused for `ms`. */
export interface PauseMessage extends StageMessage {
  host: string;
  ms: number;
}

/** `floodgate:lease-lost`: the lease `leaseId` ran out before its release. */
export interface LeaseLostMessage extends StageMessage {
  leaseId: string;
}

/** `floodgate:backend-error`: a Redis call of `stage` failed with `error` (a `BackendUnavailableError`). */
export interface BackendErrorMessage {
  stage: string | undefined;
  backend: "redis";
  error: Error;
}

/**
 * `floodgate:drain`: the drain of a stage or a gate (`kind: "gate"`) ended with `completed`,
 * `aborted` and `rejected` calls, after `tookMs`.
 */
export interface DrainMessage {
  stage: string;
  kind: StageKind;
  completed: number;
  aborted: number;
  rejected: number;
  tookMs: number;
}

export const admitChannel = diagnostics_channel.channel(CHANNELS.admit);
export const waitChannel = diagnostics_channel.channel(CHANNELS.wait);
export const grantChannel = diagnostics_channel.channel(CHANNELS.grant);
export const releaseChannel = diagnostics_channel.channel(CHANNELS.release);
export const shedChannel = diagnostics_channel.channel(CHANNELS.shed);
export const pauseChannel = diagnostics_channel.channel(CHANNELS.pause);
export const leaseLostChannel = diagnostics_channel.channel(CHANNELS.leaseLost);
export const backendErrorChannel = diagnostics_channel.channel(CHANNELS.backendError);
export const drainChannel = diagnostics_channel.channel(CHANNELS.drain);
