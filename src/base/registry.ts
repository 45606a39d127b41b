import { ClosedError, InvalidOptionsError, isFloodgateError } from "../errors.js";
import type { Stage, StageKind } from "../types.js";
import { checkName, got, unreadable } from "../validate.js";

/**
 * Options data (not clock, logger or random) as a string that ignores key order, or `undefined`
 * when the options cannot be read as data (a BigInt, a cycle, a getter or Proxy that throws):
 * those are not valid options, which building the stage then says.
 */
function fingerprint(options: object): string | undefined {
  try {
    return JSON.stringify(options, (key, value) => {
      if (key === "clock" || key === "logger" || key === "random") return undefined;
      if (value && typeof value === "object" && !Array.isArray(value)) {
        return Object.fromEntries(Object.entries(value).sort(([a], [b]) => (a < b ? -1 : 1)));
      }
      return value;
    });
  } catch {
    return undefined;
  }
}

/** Build a stage; anything but a floodgate error on the way (a getter that threw) names the options. */
function make<S>(kind: StageKind, name: string, build: () => S): S {
  try {
    return build();
  } catch (error) {
    if (isFloodgateError(error)) throw error;
    throw unreadable(`${kind} "${name}"`, name, "options", error);
  }
}

/**
 * The stages a backend built, one per name: asking again for the same kind and name returns the
 * same stage (as two processes naming one Redis stage share it), asking with other options, or
 * for another kind under a name taken, throws (on Redis a semaphore, a bounded queue and an AIMD
 * limiter of one name would share their keys, and in every backend a name is what metrics,
 * snapshots and a gate's `costs` know a stage by), and a closed backend builds nothing more.
 */
export class StageRegistry {
  readonly #stages = new Map<string, { kind: StageKind; stage: Stage; fingerprint: string }>();
  #closed = false;

  build<O extends object, S extends Stage>(kind: StageKind, name: string, options: O, build: () => S): S {
    checkName(kind, name);
    if (this.#closed) throw new ClosedError(name, `${kind} "${name}": the backend is closed`);
    if (typeof options !== "object" || options === null) {
      throw new InvalidOptionsError(
        name,
        "options",
        `${kind} "${name}": options must be an object, ${got(options)}`,
      );
    }
    const taken = this.#stages.get(name);
    if (taken !== undefined && taken.kind !== kind) {
      throw new InvalidOptionsError(
        name,
        "name",
        `${kind} "${name}": this backend has a ${taken.kind} of that name already; one name, one stage (give each its own name)`,
      );
    }
    const print = fingerprint(options);
    if (print === undefined) {
      // Not data: building says which option is wrong; options it somehow accepts are still refused.
      const stage = make(kind, name, build);
      void stage.close();
      throw new InvalidOptionsError(name, "options", `${kind} "${name}": options must be plain data`);
    }
    if (taken) {
      if (taken.fingerprint !== print) {
        throw new InvalidOptionsError(
          name,
          "options",
          `${kind} "${name}": already built with other options (${taken.fingerprint}); one name, one configuration`,
        );
      }
      return taken.stage as S;
    }
    const stage = make(kind, name, build);
    this.#stages.set(name, { kind, stage, fingerprint: print });
    return stage;
  }

  /** Close every stage built, and build no more. */
  async close(): Promise<void> {
    this.#closed = true;
    for (const { stage } of this.#stages.values()) await stage.close();
  }
}
