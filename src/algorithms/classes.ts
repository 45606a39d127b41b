/**
 * Traffic classes of a permit stage: how a limit is divided into guaranteed shares, and which
 * class's head of line a free permit goes to. Pure: numbers in, numbers out, no timers. The
 * memory permit stages call `guarantees` whenever their limit changes and `nextClass` for every
 * grant; `test/algorithms/classes.test.ts` pins both.
 *
 * The rule, in the order it is applied to the heads of the classes' lines:
 * 1. **Owed first.** A class holding less than its guarantee is owed permits. Owed classes are
 *    served before any other, in the order their heads arrived (not by priority: a guarantee is
 *    a guarantee whatever the priority).
 * 2. **Then borrowers, by priority.** A class at or above its guarantee borrows what the others
 *    leave idle, up to its ceiling; among borrowers a higher priority goes first, then the
 *    earlier head. A borrower never waits for a class that is idle: lending is work-conserving.
 * 3. **The first class in that order blocks the rest.** When its head's cost does not fit the
 *    free permits, nothing is granted until it does, so a large cost is never overtaken for ever
 *    by small ones (as in one FIFO line). A class whose head would pass its ceiling is skipped.
 *    A borrower's head fits only in what stays free after the part of every other class's
 *    guarantee that class does not lend (`lendable`) and does not use; an owed class's does not
 *    look at that.
 *
 * Nothing is taken back from a call in flight: an owner reclaims its share as borrowed permits
 * are released, each freed permit going to it before any borrower. Every class is guaranteed at
 * least one permit, so no class starves whatever the priorities; while the limit is smaller
 * than the number of classes those guarantees overlap, and the owed classes take turns in
 * arrival order.
 */

/** One class as configured. */
export interface ClassConfig {
  /** Its weight: guarantees divide the limit in proportion to the shares. */
  readonly share: number;
  /** Most of the limit the class may hold, its guarantee and what it borrows, in (0, 1]. */
  readonly maxShare: number;
  /** Among borrowers, higher goes first. */
  readonly priority: number;
  /** The fraction of its guarantee others may borrow while it does not use it, in [0, 1]. */
  readonly lendable: number;
}

/** What each class may hold at one limit. */
export interface ClassBounds {
  /** Permits the class is owed whenever it has demand. */
  readonly guarantee: number[];
  /** Permits the class may hold at most, borrowing included (never below its guarantee). */
  readonly ceiling: number[];
  /** Permits of its guarantee never lent: `guarantee - floor(lendable × guarantee)`. */
  readonly kept: number[];
}

/**
 * Divide `limit` permits among `classes` by share: each gets the whole part of its exact
 * portion, and the permits left over go to the largest remainders (the earlier class on a tie);
 * every class then gets at least one. The guarantees sum to `limit`, or to the number of
 * classes when that is larger. A class's ceiling is `maxShare` of the limit, rounded down, but
 * never below its exact portion rounded up (so never below its guarantee, and never lower at a
 * higher limit).
 */
export function guarantees(limit: number, classes: readonly ClassConfig[]): ClassBounds {
  const n = classes.length;
  let total = 0;
  for (let i = 0; i < n; i++) total += classes[i]!.share;
  const guarantee = new Array<number>(n);
  const remainder = new Array<number>(n);
  let given = 0;
  for (let i = 0; i < n; i++) {
    const exact = (limit * classes[i]!.share) / total;
    guarantee[i] = Math.floor(exact);
    remainder[i] = exact - guarantee[i]!;
    given += guarantee[i]!;
  }
  for (let left = limit - given; left > 0; left--) {
    let best = 0;
    for (let i = 1; i < n; i++) if (remainder[i]! > remainder[best]!) best = i;
    guarantee[best]!++;
    remainder[best] = -1;
  }
  const ceiling = new Array<number>(n);
  const kept = new Array<number>(n);
  for (let i = 0; i < n; i++) {
    guarantee[i] = Math.max(1, guarantee[i]!);
    kept[i] = guarantee[i]! - Math.floor(classes[i]!.lendable * guarantee[i]!);
    // Its exact portion rounded up is never below its guarantee, and never falls as the limit
    // grows (a guarantee can: the leftovers move), so a cost that fits at the lowest limit
    // fits at every limit above it.
    const exact = Math.ceil((limit * classes[i]!.share) / total - 1e-9);
    ceiling[i] = Math.max(exact, Math.floor(limit * classes[i]!.maxShare));
  }
  return { guarantee, ceiling, kept };
}

/** One class's line as `nextClass` sees it. */
export interface ClassLine {
  /** Permits the class holds. */
  readonly used: number;
  /** The cost of the head of its line, or undefined when nobody waits. */
  readonly headCost: number | undefined;
  /** When the head arrived (any clock that orders arrivals; ties go to the earlier class). */
  readonly headAt: number;
}

/**
 * The class whose head goes next with `free` permits free, or -1 when none may go now (nobody
 * waits, the first in line does not fit, or every class that waits is at its ceiling). See the
 * rule in the header.
 */
export function nextClass(
  lines: readonly ClassLine[],
  bounds: ClassBounds,
  classes: readonly ClassConfig[],
  free: number,
): number {
  let first = -1;
  let owed = false;
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i]!;
    const cost = line.headCost;
    if (cost === undefined || line.used + cost > bounds.ceiling[i]!) continue;
    const isOwed = line.used < bounds.guarantee[i]!;
    if (first === -1 || ahead(line, isOwed, classes[i]!, lines[first]!, owed, classes[first]!)) {
      first = i;
      owed = isOwed;
    }
  }
  if (first === -1) return -1;
  let room = free;
  // A borrower leaves the others the part of their guarantee they do not lend.
  if (!owed) {
    for (let i = 0; i < lines.length; i++) {
      if (i !== first) room -= Math.max(0, bounds.kept[i]! - lines[i]!.used);
    }
  }
  return lines[first]!.headCost! <= room ? first : -1;
}

/** Whether head `a` goes before head `b`: owed before borrowers, then priority among borrowers, then arrival. */
function ahead(
  a: ClassLine,
  aOwed: boolean,
  ac: ClassConfig,
  b: ClassLine,
  bOwed: boolean,
  bc: ClassConfig,
): boolean {
  if (aOwed !== bOwed) return aOwed;
  if (!aOwed && ac.priority !== bc.priority) return ac.priority > bc.priority;
  return a.headAt < b.headAt;
}

/**
 * How many permits to ask each class's borrowed tickets to give back (`reclaim: "signal"`),
 * written into `out`; returns their sum. The owed classes that wait want what their guarantee
 * lacks, up to what they wait for (`waiting[i]`: the cost of class i's calls in line); what is
 * free and what was asked back already (`asked[i]`: the cost of class i's tickets asked, still
 * held) cover part of it; the rest is asked of the borrowers (classes holding more than their
 * guarantee), at most what each borrows beyond what it was asked, lowest priority first, the
 * later class first on a tie. Pure; the twin of `c.reclaim` in lua/prelude.lua.
 */
export function reclaimPlan(
  used: readonly number[],
  guarantee: readonly number[],
  waiting: readonly number[],
  asked: readonly number[],
  free: number,
  classes: readonly ClassConfig[],
  out: number[],
): number {
  let short = -free;
  for (let i = 0; i < used.length; i++) {
    out[i] = 0;
    short -= asked[i]!;
    const lack = guarantee[i]! - used[i]!;
    if (lack > 0 && waiting[i]! > 0) short += Math.min(lack, waiting[i]!);
  }
  if (short <= 0) return 0;
  let total = 0;
  for (const j of byPriority(classes)) {
    const borrowed = used[j]! - guarantee[j]! - asked[j]!;
    if (borrowed <= 0) continue;
    const take = Math.min(borrowed, short);
    out[j] = take;
    total += take;
    short -= take;
    if (short <= 0) break;
  }
  return total;
}

/** Class indices, lowest priority first, the later class first on a tie. */
function byPriority(classes: readonly ClassConfig[]): number[] {
  const order = classes.map((_, i) => i);
  return order.sort((a, b) => classes[a]!.priority - classes[b]!.priority || b - a);
}
