import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";

/**
 * Every Lua script floodgate runs, with its number of KEYS. Each lives in `lua/<name>.lua`; the
 * definitions of the shared prelude (`lua/prelude.lua`) that it uses are put in front of it.
 */
export const SCRIPTS = {
  "semaphore-acquire": 5,
  "semaphore-release": 5,
  "semaphore-renew": 2,
  "aimd-release": 5,
  "token-bucket-take": 1,
  "token-bucket-take-many": 1,
  "token-bucket-refund": 1,
  "token-bucket-penalize": 1,
  "token-bucket-settle": 1,
  "token-bucket-classes": 5,
  "interval-gate-take": 1,
  "interval-gate-pause": 1,
  "interval-gate-refund": 1,
  /** A whole Gate's admission or release in one call (lua/gate.lua); its keys are counted per call. */
  gate: -1,
} as const;

/**
 * The scripts a `gate` call runs as its steps: each body is wrapped as a function of its own
 * KEYS and ARGV (`step_semaphore_acquire(KEYS, ARGV)`), so a step runs exactly as the script
 * would alone.
 */
export const GATE_STEPS = [
  "semaphore-acquire",
  "semaphore-release",
  "aimd-release",
  "token-bucket-take",
  "token-bucket-refund",
  "token-bucket-settle",
  "interval-gate-take",
  "interval-gate-refund",
] as const satisfies readonly ScriptName[];

/** A script a `gate` call can run as one of its steps. */
export type GateStep = (typeof GATE_STEPS)[number];

/** Scripts the gate script runs itself (a turn's admissions of one bucket key at once), never sent as steps. */
const GATE_HELPERS = ["token-bucket-take-many"] as const satisfies readonly ScriptName[];

/** The Lua function a step's body is wrapped in. */
function stepFunction(name: GateStep | (typeof GATE_HELPERS)[number]): string {
  return `step_${name.replaceAll("-", "_")}`;
}

export type ScriptName = keyof typeof SCRIPTS;

const LUA_DIR = new URL("../../lua/", import.meta.url);
const sources = new Map<ScriptName | "prelude" | "gate-first", string>();

function read(name: ScriptName | "prelude" | "gate-first"): string {
  let source = sources.get(name);
  if (source === undefined) {
    source = readFileSync(fileURLToPath(new URL(`${name}.lua`, LUA_DIR)), "utf8");
    sources.set(name, source);
  }
  return source;
}

/** A top-level definition of the prelude: its name, its text (with the comment above it), what it uses. */
interface Definition {
  name: string;
  text: string;
  uses: Set<string>;
}

/** Lua code with comments and string literals blanked out, so only code is scanned for names. */
function codeOnly(lua: string): string {
  return lua.replace(
    /--\[(=*)\[[\s\S]*?\]\1\]|--[^\n]*|"(?:\\[\s\S]|[^"\\\n])*"|'(?:\\[\s\S]|[^'\\\n])*'|\[(=*)\[[\s\S]*?\]\2\]/g,
    " ",
  );
}

/** Every identifier in the code of `lua`. */
function identifiers(lua: string): Set<string> {
  return new Set(codeOnly(lua).match(/[A-Za-z_][A-Za-z0-9_]*/g) ?? []);
}

/**
 * The prelude cut into its top-level definitions, in file order: each `local function name(...)`
 * up to its closing `end` at the start of a line, or each one-line `local name = ...`, with the
 * comment lines right above it. Any other top-level code is kept as a definition every script
 * gets (named ""); comments between definitions are left out.
 */
function preludeDefinitions(): Definition[] {
  const lines = read("prelude").split("\n");
  const definitions: Definition[] = [];
  let comment: string[] = [];
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i]!;
    if (line.startsWith("--")) {
      comment.push(line);
      continue;
    }
    if (line.trim() === "") {
      comment = [];
      continue;
    }
    const fn = /^local\s+function\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(/.exec(line);
    const value = fn ? undefined : /^local\s+([A-Za-z_][A-Za-z0-9_]*)\s*=/.exec(line);
    let end = i;
    if (fn) while (end < lines.length - 1 && !/^end\b/.test(lines[end]!)) end++;
    const body = lines.slice(i, end + 1);
    const name = fn?.[1] ?? value?.[1] ?? "";
    const uses = identifiers(body.join("\n"));
    uses.delete(name);
    definitions.push({ name, text: [...comment, ...body].join("\n"), uses });
    comment = [];
    i = end;
  }
  return definitions;
}

let definitions: Definition[] | undefined;

/**
 * The prelude definitions `body` needs: those it names, and those they name in turn, in the
 * prelude's order (so each is defined before the ones that use it); but for those in `made`
 * (defined already, in front), to which the names of those returned are added.
 */
function preludeFor(body: string, made = new Set<string>()): string {
  definitions ??= preludeDefinitions();
  const byName = new Map(definitions.map((d) => [d.name, d]));
  const needed = new Set<string>([""]);
  const pending = [...identifiers(body)];
  for (let id = pending.pop(); id !== undefined; id = pending.pop()) {
    const d = byName.get(id);
    if (!d || needed.has(id)) continue;
    needed.add(id);
    pending.push(...d.uses);
  }
  const wanted = definitions.filter((d) => needed.has(d.name) && !made.has(d.name));
  for (const d of wanted) made.add(d.name);
  return wanted.map((d) => `${d.text}\n`).join("");
}

/**
 * `body` with the prelude definitions it uses in front, as a script is sent: for the tests that
 * run a prelude function against its TypeScript twin.
 */
export function withPrelude(body: string): string {
  return `${preludeFor(body)}\n${body}`;
}

const full = new Map<ScriptName, string>();

/**
 * The full text sent to Redis for `name`: the prelude definitions it uses (found by scanning the
 * script, so a script carries no closures it never calls), then the script.
 */
export function scriptSource(name: ScriptName): string {
  let source = full.get(name);
  if (source === undefined && name === "gate") {
    // The first pass (lua/gate-first.lua) with only the prelude definitions it uses, so a call it
    // decides makes nothing more; then the other definitions the rest uses, each step's body as a
    // function of its own KEYS and ARGV, and the gate's own body.
    const made = new Set<string>();
    const first = read("gate-first");
    const firstPrelude = preludeFor(first, made);
    const steps = [...GATE_STEPS, ...GATE_HELPERS].map(
      (step) => `local function ${stepFunction(step)}(KEYS, ARGV)\n${read(step)}\nend\n`,
    );
    const body = `${steps.join("\n")}\n${read("gate")}`;
    source = `${firstPrelude}\n${first}\n${preludeFor(body, made)}\n${body}`;
    full.set(name, source);
  }
  if (source === undefined) {
    const body = read(name);
    const prelude = preludeFor(body);
    source = prelude === "" ? body : `${prelude}\n${body}`;
    full.set(name, source);
  }
  return source;
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
    // A script whose keys are counted per call takes their number as its first argument.
    const keys = numberOfKeys < 0 ? {} : { numberOfKeys };
    client.defineCommand(commandName(name), { ...keys, lua: scriptSource(name) });
  }
  defined.add(client);
}
