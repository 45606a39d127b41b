import { ClosedError, InvalidOptionsError } from "../errors.js";
import type { Stage, StageKind } from "../types.js";
import { checkName } from "../validate.js";

/** Options data (not clock, logger or random) as a string that ignores key order. */
function fingerprint(options: object): string {
  return JSON.stringify(options, (key, value) => {
    if (key === "clock" || key === "logger" || key === "random") return undefined;
    if (value && typeof value === "object" && !Array.isArray(value)) {
      return Object.fromEntries(Object.entries(value).sort(([a], [b]) => (a < b ? -1 : 1)));
    }
    return value;
  });
}

/**
 * The stages a backend built, one per kind and name: asking again for the same kind and name
 * returns the same stage (as two processes naming one Redis stage share it), asking with other
 * options throws, and a closed backend builds nothing more.
 */
export class StageRegistry {
  readonly #stages = new Map<string, { stage: Stage; fingerprint: string }>();
  #closed = false;

  build<O extends object, S extends Stage>(kind: StageKind, name: string, options: O, make: () => S): S {
    checkName(kind, name);
    if (this.#closed) throw new ClosedError(name, `${kind} "${name}": the backend is closed`);
    if (typeof options !== "object" || options === null) {
      throw new InvalidOptionsError(name, "options", `${kind} "${name}": options must be an object`);
    }
    const id = `${kind}:${name}`;
    const print = fingerprint(options);
    const existing = this.#stages.get(id);
    if (existing) {
      if (existing.fingerprint !== print) {
        throw new InvalidOptionsError(
          name,
          "options",
          `${kind} "${name}": already built with other options (${existing.fingerprint}); one name, one configuration`,
        );
      }
      return existing.stage as S;
    }
    const stage = make();
    this.#stages.set(id, { stage, fingerprint: print });
    return stage;
  }

  /** Close every stage built, and build no more. */
  async close(): Promise<void> {
    this.#closed = true;
    for (const { stage } of this.#stages.values()) await stage.close();
  }
}
