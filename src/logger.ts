import { pino } from "pino";
import type { Logger, StageKind } from "./types.js";

let silent: Logger | undefined;

/** The logger stages use when none is given: pino at level `silent`. */
export function silentLogger(): Logger {
  silent ??= pino({ level: "silent" }) as unknown as Logger;
  return silent;
}

/** A stage's child logger, bound to `{ stage, kind, backend }`. */
export function stageLogger(
  parent: Logger | undefined,
  stage: string,
  kind: StageKind,
  backend: string,
): Logger {
  return (parent ?? silentLogger()).child({ stage, kind, backend });
}

/** True when `level` would be written; lets hot paths skip building log objects. */
export function enabled(log: Logger, level: "debug" | "info"): boolean {
  return log.isLevelEnabled ? log.isLevelEnabled(level) : true;
}
