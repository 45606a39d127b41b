/**
 * Traffic classes of a token bucket: how its refill and capacity are divided into guaranteed
 * shares, and which class's head of line takes tokens next. Pure: numbers in, numbers out, no
 * timers. The memory token bucket calls `nextBucketClass` for every grant and `chargeClass` /
 * `creditClass` as tokens are taken and given back; `test/algorithms/bucket-classes.test.ts`
 * pins them. The rule is the one of `nextClass` (src/algorithms/classes.ts), with tokens for
 * permits:
 *
 * - Each class has a **guarantee**: its share of the refill (`rate`) and of the capacity
 *   (`capacity`), kept as a ledger of its own (`ClassLedger.guarantee`): tokens that refill at
 *   its rate, and that each of its admissions takes its cost from, down to zero. A class is
 *   **owed** while its ledger holds its head's cost: it has drawn less than its share lately.
 *   The ledger refills up to the class's capacity, and, from the moment a head starts waiting,
 *   up to its capacity plus that head's cost, so a head that waits for the bucket (or costs more
 *   than the class's capacity) loses none of the class's rate meanwhile. It never goes
 *   below zero: what a class borrowed while the others were idle is not held against it, so
 *   when they come back it is owed again as soon as its ledger has refilled its head's cost
 *   (cost ÷ its rate), as a permit stage's class is owed a released permit.
 * - **Owed first**, in arrival order; **then borrowers by priority**, then arrival; **the first
 *   blocks the rest** until the bucket holds its cost. A class with a ceiling (`maxShare` below
 *   1) also keeps a ceiling ledger refilled at `maxShare` of the rate; a head it cannot pay is
 *   skipped, not waited for.
 * - A borrower leaves in the bucket, for every other class, the part of that class's ledger it
 *   does not lend (`(1 − lendable) × capacity`, as far as the ledger holds it): those tokens stay
 *   there for the class's next calls. An owed class's head does not look at that.
 *
 * The bucket itself bounds everything: no class takes a token the bucket does not hold, so the
 * rate and burst of the whole bucket hold exactly as without classes. A penalty slows the
 * bucket's refill only; the guarantees stay shares of the configured rate, so under a penalty
 * the owed classes are served first and the bucket is the bound.
 */
import { type ClassConfig, guarantees } from "./classes.js";
import { type BucketConfig, type BucketState, tokensAt, waitMs } from "./token-bucket.js";

/** Tolerance for float error when comparing token counts. */
const EPSILON = 1e-9;

/** Each class's part of one bucket. */
export interface BucketShares {
  /** Tokens per second of each class's guarantee: its share of the refill. */
  readonly rate: readonly number[];
  /** Most tokens each class's guarantee holds: its share of the capacity. */
  readonly capacity: readonly number[];
  /**
   * Each class's ceiling as a fraction of the bucket's refill: its `maxShare`, never below its
   * share; 1 for a class without one.
   */
  readonly ceiling: readonly number[];
  /**
   * Most tokens each class's ceiling holds: whole tokens, as a permit stage's ceiling at a limit
   * of `capacity` (`guarantees`), so the largest cost a class is let ask for can always be paid.
   */
  readonly ceilingCapacity: readonly number[];
  /** Tokens of each class's guarantee it never lends: `(1 − lendable) × capacity`. */
  readonly kept: readonly number[];
  /** The bucket's capacity: how far below zero a class's ceiling ledger may go (a settle's charge). */
  readonly debt: number;
}

/** Divide `config`'s refill and capacity among `classes` by share. */
export function bucketShares(config: BucketConfig, classes: readonly ClassConfig[]): BucketShares {
  let total = 0;
  for (const c of classes) total += c.share;
  const rate: number[] = [];
  const capacity: number[] = [];
  const ceiling: number[] = [];
  const kept: number[] = [];
  for (const c of classes) {
    const part = c.share / total;
    rate.push(config.refillPerSecond * part);
    capacity.push(config.capacity * part);
    ceiling.push(Math.max(part, c.maxShare));
    kept.push((1 - c.lendable) * config.capacity * part);
  }
  const ceilingCapacity = guarantees(config.capacity, classes).ceiling;
  return { rate, capacity, ceiling, ceilingCapacity, kept, debt: config.capacity };
}

/**
 * What each class of one bucket has drawn lately: tokens of its guarantee and of its ceiling,
 * each class's as of its own `at`. (A class without a ceiling keeps one of the bucket's whole
 * rate and capacity, which never binds before the bucket itself does.)
 */
export interface ClassLedger {
  readonly at: number[];
  readonly guarantee: number[];
  readonly ceiling: number[];
}

/** A ledger at `now` of classes that have drawn nothing: every guarantee and ceiling full. */
export function newLedger(shares: BucketShares, now: number): ClassLedger {
  return {
    at: shares.capacity.map(() => now),
    guarantee: [...shares.capacity],
    ceiling: [...shares.ceilingCapacity],
  };
}

/**
 * Class `i`'s guarantee tokens at `now`: refilled at its rate up to its capacity, and from
 * `since` (when a head of `headCost` started waiting) up to its capacity plus that cost.
 */
export function guaranteeAt(
  ledger: ClassLedger,
  shares: BucketShares,
  i: number,
  now: number,
  headCost = 0,
  since = now,
): number {
  const rate = shares.rate[i]!;
  const cap = shares.capacity[i]!;
  let g = ledger.guarantee[i]!;
  let from = ledger.at[i]!;
  if (since > from) {
    g = refilled(g, rate, cap, Math.min(since, now) - from);
    from = since;
  }
  return refilled(g, rate, cap + headCost, now - from);
}

/** Class `i`'s ceiling tokens at `now`. */
function ceilingAt(
  ledger: ClassLedger,
  shares: BucketShares,
  config: BucketConfig,
  i: number,
  now: number,
): number {
  const rate = config.refillPerSecond * shares.ceiling[i]!;
  return refilled(ledger.ceiling[i]!, rate, shares.ceilingCapacity[i]!, now - ledger.at[i]!);
}

/** `tokens` after `ms` of refill at `perSecond`, capped at `cap` (a clock that went back refills nothing). */
function refilled(tokens: number, perSecond: number, cap: number, ms: number): number {
  if (!(ms > 0)) return Math.min(tokens, cap);
  const t = tokens + (ms * perSecond) / 1000;
  // A debt of -Infinity refilled by +Infinity is NaN: full, as the bucket reads it (not Math.min).
  if (t < cap) return t;
  return cap;
}

/** Whole milliseconds (at least 1) until `tokens` refilled at `perSecond` reach `need`. */
function msUntil(tokens: number, need: number, perSecond: number): number {
  const ms = Math.ceil(((need - tokens) * 1000) / perSecond - EPSILON);
  // NaN (an infinite rate) is at once, as any wait under a millisecond (not Math.max).
  if (ms >= 1) return ms;
  return 1;
}

/**
 * Bring class `i` of `ledger` to `now` (never back), a head of `headCost` having waited since
 * `since` (see `guaranteeAt`).
 */
function advance(
  ledger: ClassLedger,
  shares: BucketShares,
  config: BucketConfig,
  i: number,
  now: number,
  headCost: number,
  since: number,
): void {
  if (!(now > ledger.at[i]!)) return;
  ledger.guarantee[i] = guaranteeAt(ledger, shares, i, now, headCost, since);
  ledger.ceiling[i] = ceilingAt(ledger, shares, config, i, now);
  ledger.at[i] = now;
}

/**
 * Class `i`'s head, waiting since `since`, took `cost` tokens at `now` (or a settle charged the
 * class `cost` more: `since` is then `now`): its guarantee is charged down to zero at most, and
 * its ceiling down to minus the bucket's capacity (a settle that charges more is forgotten
 * beyond that, so no class is held back for ever).
 */
export function chargeClass(
  ledger: ClassLedger,
  shares: BucketShares,
  config: BucketConfig,
  i: number,
  cost: number,
  now: number,
  since = now,
): void {
  advance(ledger, shares, config, i, now, cost, since);
  ledger.guarantee[i] = Math.max(0, ledger.guarantee[i]! - cost);
  ledger.ceiling[i] = Math.max(-shares.debt, ledger.ceiling[i]! - cost);
}

/**
 * Class `i` got `amount` tokens back at `now` (a refund, or a settle below the estimate) while a
 * head of `headCost` waits since `since` (none: 0): back up to what its ledger may hold then.
 */
export function creditClass(
  ledger: ClassLedger,
  shares: BucketShares,
  config: BucketConfig,
  i: number,
  amount: number,
  now: number,
  headCost = 0,
  since = now,
): void {
  advance(ledger, shares, config, i, now, headCost, since);
  ledger.guarantee[i] = Math.min(shares.capacity[i]! + headCost, ledger.guarantee[i]! + amount);
  ledger.ceiling[i] = Math.min(shares.ceilingCapacity[i]!, ledger.ceiling[i]! + amount);
}

/**
 * Whether nothing in `ledger` differs from a fresh one at `now`: every guarantee and ceiling
 * full again (then the bucket's key can be forgotten without changing any decision).
 */
export function ledgerIsFull(
  ledger: ClassLedger,
  shares: BucketShares,
  config: BucketConfig,
  now: number,
): boolean {
  for (let i = 0; i < ledger.guarantee.length; i++) {
    if (guaranteeAt(ledger, shares, i, now) + EPSILON < shares.capacity[i]!) return false;
    const full = shares.ceilingCapacity[i]!;
    if (ceilingAt(ledger, shares, config, i, now) + EPSILON < full) return false;
  }
  return true;
}

/** The most a call of class `i` can ever cost: its ceiling's capacity (the bucket's without one). */
export function classMaxCost(shares: BucketShares, i: number): number {
  return shares.ceilingCapacity[i]!;
}

/** One class's line as `nextBucketClass` sees it. */
export interface BucketClassLine {
  /** The cost of the head of its line, or undefined when nobody waits. */
  headCost: number | undefined;
  /** When the head arrived (any clock that orders arrivals; ties go to the earlier class). */
  headAt: number;
  /** When the head started waiting, in the ms of `now` (its class's ledger refills past its capacity since). */
  headSince: number;
}

/** What `nextBucketClass` decides: the class to grant now, or -1 and how long until that may change. */
export interface BucketPick {
  cls: number;
  /** 0 when `cls` goes now; else ms until the bucket could hold the first head's cost, or a class becomes owed or clears its ceiling; `Infinity` when nobody waits. */
  waitMs: number;
}

/**
 * The class whose head takes tokens from bucket `s` next at `now`, by the rule in the header,
 * written into `out` (and returned). When none may go now, `out.cls` is -1 and `out.waitMs` the
 * time after which asking again may find one: when the bucket could hold what the first head
 * needs, or when a class that is not owed becomes owed (it would go first), or a head skipped at
 * its ceiling could go. Never later than the first of those, so a waiter woken then misses
 * nothing; possibly earlier (what others keep grows as their ledgers refill), then it asks
 * again.
 */
export function nextBucketClass(
  lines: readonly BucketClassLine[],
  ledger: ClassLedger,
  shares: BucketShares,
  classes: readonly ClassConfig[],
  s: BucketState,
  config: BucketConfig,
  now: number,
  out: BucketPick,
): BucketPick {
  let first = -1;
  let owed = false;
  let changes = Number.POSITIVE_INFINITY;
  for (let i = 0; i < lines.length; i++) {
    const cost = lines[i]!.headCost;
    if (cost === undefined) continue;
    const c = ceilingAt(ledger, shares, config, i, now);
    if (c + EPSILON < cost) {
      changes = Math.min(changes, msUntil(c, cost, config.refillPerSecond * shares.ceiling[i]!));
      continue;
    }
    const g = guaranteeAt(ledger, shares, i, now, cost, lines[i]!.headSince);
    const isOwed = g + EPSILON >= cost;
    if (!isOwed) changes = Math.min(changes, msUntil(g, cost, shares.rate[i]!));
    if (first === -1 || ahead(i, isOwed, first, owed, lines, classes)) {
      first = i;
      owed = isOwed;
    }
  }
  if (first === -1) {
    out.cls = -1;
    out.waitMs = changes;
    return out;
  }
  let need = lines[first]!.headCost!;
  // A borrower leaves the others what they keep of their guarantee and have not drawn.
  if (!owed) {
    for (let i = 0; i < lines.length; i++) {
      if (i === first) continue;
      const line = lines[i]!;
      const g = guaranteeAt(ledger, shares, i, now, line.headCost ?? 0, line.headSince);
      need += Math.min(Math.max(0, g), shares.kept[i]!);
    }
  }
  if (tokensAt(s, config, now) + EPSILON >= need) {
    out.cls = first;
    out.waitMs = 0;
    return out;
  }
  out.cls = -1;
  out.waitMs = Math.min(waitMs(s, config, need, now), changes);
  return out;
}

/** Whether head `a` goes before head `b`: owed before borrowers, then priority among borrowers, then arrival. */
function ahead(
  a: number,
  aOwed: boolean,
  b: number,
  bOwed: boolean,
  lines: readonly BucketClassLine[],
  classes: readonly ClassConfig[],
): boolean {
  if (aOwed !== bOwed) return aOwed;
  if (!aOwed && classes[a]!.priority !== classes[b]!.priority)
    return classes[a]!.priority > classes[b]!.priority;
  return lines[a]!.headAt < lines[b]!.headAt;
}
