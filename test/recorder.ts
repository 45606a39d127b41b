import type { Logger } from "floodgate";

/** One record of a `recorder` logger: its level, its message, its fields and its bindings. */
export type Entry = { level: string; msg: string | undefined } & Record<string, unknown>;

/** A logger that records every call, bindings merged in; `debug` says whether debug is on. */
export function recorder(debug = true): { logger: Logger; entries: Entry[] } {
  const entries: Entry[] = [];
  const make = (bindings: Record<string, unknown>): Logger => {
    const at =
      (level: string) =>
      (obj: object, msg?: string): void => {
        entries.push({ ...bindings, ...obj, level, msg });
      };
    return {
      child: (more) => make({ ...bindings, ...more }),
      debug: at("debug"),
      info: at("info"),
      warn: at("warn"),
      error: at("error"),
      isLevelEnabled: (level) => debug || level !== "debug",
    };
  };
  return { logger: make({}), entries };
}
