import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";

/**
 * Every Lua script floodgate runs, with its number of KEYS. Each lives in `lua/<name>.lua`; the
 * shared prelude (`lua/prelude.lua`: reading `now`) is put in front when it is loaded.
 */
export const SCRIPTS = {
  "semaphore-acquire": 4,
  "semaphore-release": 4,
  "semaphore-renew": 1,
  "aimd-release": 4,
  "token-bucket-take": 1,
  "token-bucket-refund": 1,
  "token-bucket-penalize": 1,
  "token-bucket-settle": 1,
  "interval-gate-take": 1,
  "interval-gate-pause": 1,
  "interval-gate-refund": 1,
} as const;

export type ScriptName = keyof typeof SCRIPTS;

const LUA_DIR = new URL("../../lua/", import.meta.url);
const sources = new Map<ScriptName | "prelude", string>();

function read(name: ScriptName | "prelude"): string {
  let source = sources.get(name);
  if (source === undefined) {
    source = readFileSync(fileURLToPath(new URL(`${name}.lua`, LUA_DIR)), "utf8");
    sources.set(name, source);
  }
  return source;
}

/** The full text sent to Redis for `name`: prelude, then the script. */
export function scriptSource(name: ScriptName): string {
  return `${read("prelude")}\n${read(name)}`;
}

/** SHA1 of the script as Redis names it (what `SCRIPT LOAD` returns). */
export function scriptSha(name: ScriptName): string {
  return createHash("sha1").update(scriptSource(name)).digest("hex");
}

/** The ioredis command name a script is defined under: `floodgate_semaphore_acquire`. */
export function commandName(name: ScriptName): string {
  return `floodgate_${name.replaceAll("-", "_")}`;
}

interface Definer {
  defineCommand(name: string, definition: { numberOfKeys?: number; lua: string }): void;
}

const defined = new WeakSet<object>();

/**
 * Define every script on `client` once (ioredis sends the body once per connection, then only
 * the SHA, and resends it after NOSCRIPT). Tracked per client in a WeakSet.
 */
export function defineScripts(client: Definer): void {
  if (defined.has(client)) return;
  for (const [name, numberOfKeys] of Object.entries(SCRIPTS) as [ScriptName, number][]) {
    client.defineCommand(commandName(name), { numberOfKeys, lua: scriptSource(name) });
  }
  defined.add(client);
}
