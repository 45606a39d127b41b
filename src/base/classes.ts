/**
 * Traffic classes as a stage holds them, whatever its backend: the configured classes in
 * declaration order, the check of a call's `class`, the bounds at the current limit, and what
 * each class holds and has been granted. The rule itself is `src/algorithms/classes.ts`.
 */

import { tooCostly } from "../admit.js";
import { type ClassBounds, type ClassConfig, guarantees } from "../algorithms/classes.js";
import type { CallRule } from "../call-rule.js";
import { InvalidOptionsError } from "../errors.js";
import type { TrafficClassOptions } from "../options.js";
import type { AdmitOptions, ClassSnapshot, StageKind } from "../types.js";
import { got } from "../validate.js";

/** The classes of one stage, with what each holds. */
export class ClassBook {
  readonly names: readonly string[];
  readonly configs: readonly ClassConfig[];
  readonly #index = new Map<string, number>();
  readonly #default: number;
  /** Permits each class holds. */
  readonly used: number[];
  /** Admissions granted to each class. */
  readonly admitted: number[];
  /** Calls of each class holding a ticket. */
  readonly calls: number[];
  #bounds: ClassBounds;
  #boundsLimit: number;
  /** Each class's ceiling at the lowest limit the stage can have: the largest cost it can ever admit. */
  readonly #maxCost: readonly number[];

  constructor(
    readonly kind: StageKind,
    readonly stage: string,
    classes: Readonly<Record<string, TrafficClassOptions>>,
    defaultClass: string | undefined,
    limit: number,
    lowestLimit: number,
  ) {
    this.names = Object.keys(classes);
    this.configs = this.names.map((n) => {
      const c = classes[n]!;
      return {
        share: c.share,
        priority: c.priority ?? 0,
        maxShare: c.maxShare ?? 1,
        lendable: c.lendable ?? 1,
      };
    });
    for (let i = 0; i < this.names.length; i++) this.#index.set(this.names[i]!, i);
    this.#default = defaultClass === undefined ? -1 : this.#index.get(defaultClass)!;
    this.used = this.names.map(() => 0);
    this.admitted = this.names.map(() => 0);
    this.calls = this.names.map(() => 0);
    this.#bounds = guarantees(limit, this.configs);
    this.#boundsLimit = limit;
    this.#maxCost = guarantees(lowestLimit, this.configs).ceiling;
  }

  /** The configured default class, if any. */
  get defaultClass(): string | undefined {
    return this.#default < 0 ? undefined : this.names[this.#default];
  }

  /** Guarantees and ceilings at `limit` (worked out again only when the limit moved). */
  bounds(limit: number): ClassBounds {
    if (limit !== this.#boundsLimit) {
      this.#bounds = guarantees(limit, this.configs);
      this.#boundsLimit = limit;
    }
    return this.#bounds;
  }

  /**
   * The index of the class a call draws on: its `class`, else the default. Throws
   * `InvalidOptionsError` for a call that names none (with no default), names an unknown class,
   * or costs (`cost`, its cost at this stage) more than its class could ever hold.
   */
  indexOf(o: AdmitOptions, cost: number): number {
    const name = o.class;
    const i = name === undefined ? this.#default : (this.#index.get(name) ?? -2);
    if (i < 0) {
      const known = this.names.join(", ");
      throw new InvalidOptionsError(
        this.stage,
        "class",
        i === -1
          ? `${this.kind} "${this.stage}": class is required: name each call's class (one of ${known}), or build the ${this.kind} with defaultClass`
          : `${this.kind} "${this.stage}": class must be one of ${known}, ${got(name)}`,
      );
    }
    if (cost > this.#maxCost[i]!) {
      throw tooCostly(
        this.kind,
        this.stage,
        cost,
        this.#maxCost[i]!,
        `the ceiling of class "${this.names[i]}"`,
      );
    }
    return i;
  }

  /** `cost` permits granted to class `i`. */
  take(i: number, cost: number): void {
    this.used[i]! += cost;
    this.admitted[i]!++;
    this.calls[i]!++;
  }

  /** `cost` permits granted to the class named `name` (a ticket's key). */
  takeNamed(name: string, cost: number): void {
    const i = this.#index.get(name);
    if (i !== undefined) this.take(i, cost);
  }

  /** A ticket of class `i` re-priced by `delta` (a settle): what the class's tickets cost. */
  reprice(i: number, delta: number): void {
    this.used[i]! += delta;
  }

  /** `cost` permits of the class named `name` given back. */
  giveBack(name: string, cost: number): void {
    const i = this.#index.get(name);
    if (i !== undefined) this.giveBackAt(i, cost);
  }

  /** `cost` permits of class `i` given back. */
  giveBackAt(i: number, cost: number): void {
    this.used[i]! -= cost;
    this.calls[i]!--;
  }

  /** Every class's permits given back at once (a drain released every ticket). */
  giveBackAll(): void {
    this.used.fill(0);
    this.calls.fill(0);
  }

  /** Each class as the snapshot shows it; `waiting` by class index. */
  snapshot(limit: number, waiting: (i: number) => number): Record<string, ClassSnapshot> {
    const b = this.bounds(limit);
    const out: Record<string, ClassSnapshot> = {};
    this.names.forEach((n, i) => {
      out[n] = {
        guarantee: b.guarantee[i]!,
        ceiling: b.ceiling[i]!,
        kept: b.kept[i]!,
        priority: this.configs[i]!.priority,
        inFlight: this.calls[i]!,
        held: this.used[i]!,
        waiting: waiting(i),
        admitted: this.admitted[i]!,
      };
    });
    return out;
  }
}

/** The class book of a stage built with `classes`, or undefined. */
export function classBook(
  kind: StageKind,
  stage: string,
  o: { classes?: Readonly<Record<string, TrafficClassOptions>>; defaultClass?: string },
  limit: number,
  lowestLimit: number,
): ClassBook | undefined {
  if (o.classes === undefined) return undefined;
  return new ClassBook(kind, stage, o.classes, o.defaultClass, limit, lowestLimit);
}

/** The refusal of a `class` given to a stage that has no classes. */
export function noClasses(kind: StageKind, stage: string, name: unknown): InvalidOptionsError {
  return new InvalidOptionsError(
    stage,
    "class",
    `${kind} "${stage}": class given, ${got(name)}, but the ${kind} has no classes (a semaphore, an AIMD limiter or a token bucket built with classes has them: docs/classes.md)`,
  );
}

/** The call rule of a stage with classes: a call names a known class (or has the default). */
export function classRule(book: ClassBook): CallRule {
  return { keyedBy: undefined, check: (_name, o) => void book.indexOf(o, o.cost ?? 1) };
}

/**
 * Classes (a book's `configs`) as the Redis permit scripts take them (`floodgate_classes` in
 * lua/prelude.lua): "share,maxShare,lendable,priority" per class, in order, joined by ";"; ""
 * without classes. Numbers as JavaScript writes them, which Lua reads back to the same double.
 */
export function classSpec(configs: readonly ClassConfig[] | undefined): string {
  if (configs === undefined) return "";
  return configs.map((c) => `${c.share},${c.maxShare},${c.lendable},${c.priority}`).join(";");
}
