/** One instrumented stage or gate, and the walk over a gate's snapshot that finds them. */
import type { Attributes } from "@opentelemetry/api";
import type { Snapshot } from "../types.js";
import { isArray } from "../validate.js";
import { ATTRIBUTES } from "./names.js";

/** One instrumented stage (or gate): its attributes, and per class and outcome. */
export class Row {
  readonly attributes: Attributes;
  readonly #byClass = new Map<string, Attributes>();
  readonly #byOutcome = new Map<string, Attributes>();
  /** Waiting calls its drains rejected. */
  drained = 0;

  constructor(
    readonly name: string,
    readonly kind: string,
    readonly backend: string,
    readonly classed: boolean,
  ) {
    this.attributes = { [ATTRIBUTES.stage]: name, [ATTRIBUTES.kind]: kind, [ATTRIBUTES.backend]: backend };
  }

  /** The attributes of a call under `key` (its class, at a stage with classes). */
  of(key: string): Attributes {
    if (!this.classed || key === "") return this.attributes;
    let a = this.#byClass.get(key);
    if (a === undefined) {
      a = { ...this.attributes, [ATTRIBUTES.class]: key };
      this.#byClass.set(key, a);
    }
    return a;
  }

  /** The attributes of a release under `key` with `outcome`. */
  released(key: string, outcome: string): Attributes {
    const k = `${this.classed ? key : ""}\0${outcome}`;
    let a = this.#byOutcome.get(k);
    if (a === undefined) {
      a = { ...this.of(key), [ATTRIBUTES.outcome]: outcome };
      this.#byOutcome.set(k, a);
    }
    return a;
  }
}

/** Every snapshot in `s`'s tree: itself, then a gate's stages. */
export function* walk(s: Snapshot): Generator<Snapshot> {
  yield s;
  const stages = (s as { stages?: unknown }).stages;
  if (isArray(stages)) for (const inner of stages) yield* walk(inner as Snapshot);
}
