/** Stable codes carried by every floodgate error. */
export type ErrorCode =
  | "SHED"
  | "ADMIT_TIMEOUT"
  | "INVALID_OPTIONS"
  | "BACKEND_UNAVAILABLE"
  | "LEASE_LOST"
  | "RECLAIMED"
  | "CLOSED"
  | "DRAINING"
  | "RETRIES_EXHAUSTED";

const kCode = Symbol.for("floodgate.error.code");

interface ErrorFields {
  stage?: string | undefined;
  cause?: unknown;
  retryAfterMs?: number | undefined;
}

/**
 * Base of every error floodgate throws. `instanceof` works across two installed copies of the
 * package: classes check a `Symbol.for` brand rather than the prototype chain.
 */
export class FloodgateError extends Error {
  /** The code instances of this class carry; `undefined` on the base class. */
  static readonly code: ErrorCode | undefined = undefined;

  static override [Symbol.hasInstance](value: unknown): boolean {
    if (typeof value !== "object" || value === null) return false;
    const code = (value as Record<symbol, unknown>)[kCode];
    if (typeof code !== "string") return false;
    return this.code === undefined || this.code === code;
  }

  readonly code: ErrorCode;
  /** Name of the stage that raised it, when one did. */
  readonly stage: string | undefined;
  /** How long to wait before trying again, when known. */
  readonly retryAfterMs: number | undefined;

  constructor(code: ErrorCode, message: string, fields: ErrorFields = {}) {
    super(message, fields.cause === undefined ? undefined : { cause: fields.cause });
    this.code = code;
    this.stage = fields.stage;
    this.retryAfterMs = fields.retryAfterMs;
    Object.defineProperty(this, kCode, { value: code });
  }

  override get name(): string {
    return this.constructor.name;
  }
}

/** A bounded queue with `whenFull: "shed"` was full. */
export class ShedError extends FloodgateError {
  static override readonly code = "SHED" as const;
  constructor(stage: string, message: string, fields: Omit<ErrorFields, "stage"> = {}) {
    super("SHED", message, { ...fields, stage });
  }
}

/** A wait ran past its `timeoutMs`. Nothing is held afterwards. */
export class AdmitTimeoutError extends FloodgateError {
  static override readonly code = "ADMIT_TIMEOUT" as const;
  constructor(stage: string, message: string, fields: Omit<ErrorFields, "stage"> = {}) {
    super("ADMIT_TIMEOUT", message, { ...fields, stage });
  }
}

/** Options or call arguments broke a rule. `field` names the offending field. */
export class InvalidOptionsError extends FloodgateError {
  static override readonly code = "INVALID_OPTIONS" as const;
  /** Dotted path of the field, e.g. `capacity` or `penalty.factor`. */
  readonly field: string;
  constructor(stage: string | undefined, field: string, message: string) {
    super("INVALID_OPTIONS", message, { stage });
    this.field = field;
  }
}

/** The backend (Redis) could not be reached; the call was not admitted. */
export class BackendUnavailableError extends FloodgateError {
  static override readonly code = "BACKEND_UNAVAILABLE" as const;
  constructor(stage: string | undefined, message: string, fields: Omit<ErrorFields, "stage"> = {}) {
    super("BACKEND_UNAVAILABLE", message, { ...fields, stage });
  }
}

/** A permit's lease ran out before it was released or renewed. */
export class LeaseLostError extends FloodgateError {
  static override readonly code = "LEASE_LOST" as const;
  constructor(stage: string, message: string, fields: Omit<ErrorFields, "stage"> = {}) {
    super("LEASE_LOST", message, { ...fields, stage });
  }
}

/**
 * The reason a borrowed ticket's `signal` aborts on a stage built with `reclaim: "signal"`: a
 * class below its guarantee waits for the permits this ticket's class borrowed. The ticket keeps
 * its permits (and its lease) until it is released: wrap the call up and release it.
 */
export class ReclaimedError extends FloodgateError {
  static override readonly code = "RECLAIMED" as const;
  constructor(stage: string, message: string) {
    super("RECLAIMED", message, { stage });
  }
}

/** The stage was closed before or while waiting. */
export class ClosedError extends FloodgateError {
  static override readonly code = "CLOSED" as const;
  constructor(stage: string, message = `stage "${stage}" is closed`) {
    super("CLOSED", message, { stage });
  }
}

/**
 * The stage or gate is draining (`drain()`): a new call is refused with it at once; a waiting
 * call with it when the drain rejects waiters (or its grace ran out before the call was
 * admitted); and a ticket's `signal` aborts with it when the grace runs out before the call
 * released it.
 */
export class DrainingError extends FloodgateError {
  static override readonly code = "DRAINING" as const;
  constructor(stage: string, message = `stage "${stage}" is draining`) {
    super("DRAINING", message, { stage });
  }
}

/** True when `value` is a floodgate error, optionally of the given code. */
export function isFloodgateError(value: unknown, code?: ErrorCode): value is FloodgateError {
  if (!(value instanceof FloodgateError)) return false;
  return code === undefined || value.code === code;
}
