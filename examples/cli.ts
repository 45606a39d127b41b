/**
 * The command line of every program here (the demo, the examples, the soak, the chaos run and the
 * benchmarks): one parser, one usage format, one way to refuse.
 *
 * A program describes its flags once, with their defaults and a line of help each; from that
 * description come the typed values, the `--help` text and the refusals. `--help` (or `-h`)
 * prints the usage on stdout and exits 0. An unknown flag, a flag without its value, a value that
 * is not what the flag takes (`--seconds abc`, `--seconds -1`) or an argument the program does
 * not know exits 2 with one line on stderr:
 *
 *   demo: unknown flag --reqests (try --help)
 *
 * It depends on nothing but `node:util`, so the soak and the benchmarks import it as well.
 */
import { parseArgs } from "node:util";

/** A command line the program cannot use: one line for stderr, exit code 2. */
export class UsageError extends Error {
  override name = "UsageError";
}

interface FlagBase {
  /** One line of help (the default is added to it). */
  help: string;
  /** A one-letter alias: `-n`. */
  short?: string;
}

/** `--name`: true when given. */
export interface BooleanFlag extends FlagBase {
  type: "boolean";
  /** Default when neither `--name` nor `--no-name` is given. @default false */
  default?: boolean;
  /** Also accept `--no-name` (for a flag that is on by default). */
  negatable?: boolean;
}

/** `--name N`: an integer (`int`) or a finite number (`number`), at least `min`. */
export interface NumberFlag extends FlagBase {
  type: "int" | "number";
  /** Without one the value is `undefined` when the flag is not given. */
  default?: number;
  /** The default when `--small` is given (programs that have a short form). */
  small?: number;
  /** Least value. @default 1 for `int`, 0 for `number` */
  min?: number;
  /** How the usage names the value. @default "N" */
  value?: string;
  /** How the usage states the default when it is not a fixed number. */
  defaultText?: string;
}

/** `--name VALUE`: a string, one of `choices` when given; `multiple` collects every occurrence. */
export interface StringFlag extends FlagBase {
  type: "string";
  default?: string;
  choices?: readonly string[];
  multiple?: boolean;
  value?: string;
  defaultText?: string;
}

export type Flag = BooleanFlag | NumberFlag | StringFlag;
export type Flags = Record<string, Flag>;

/** What a program takes on its command line. */
export interface Command<F extends Flags = Flags> {
  /** The program's name in messages: `demo: unknown flag --x (try --help)`. */
  name: string;
  /** How it is run, for the first line of the usage: `npm run demo -- [flags]`. */
  synopsis: string;
  /** What it does: a sentence or two. */
  about: string;
  flags: F;
  /** Positional arguments, when it takes any; each must be one of `choices` when given. */
  args?: { name: string; help: string; choices?: readonly string[]; what?: string };
  /** Lines after the flags: environment variables, exit codes, examples. */
  notes?: readonly string[];
  /** What the refusal line suggests. @default "try --help" */
  hint?: string;
}

type ValueOf<F> = F extends BooleanFlag
  ? boolean
  : F extends { type: "int" | "number"; default: number }
    ? number
    : F extends NumberFlag
      ? number | undefined
      : F extends { multiple: true }
        ? string[]
        : F extends { default: string }
          ? string
          : string | undefined;

/** The parsed values, one per flag, typed by its description. */
export type Values<F extends Flags> = { -readonly [K in keyof F]: ValueOf<F[K]> };

export interface Parsed<F extends Flags> {
  values: Values<F>;
  /** Positional arguments, in order. */
  args: string[];
}

/** Describe a command (keeps the flags' literal types, so the values are typed). */
export function command<const F extends Flags>(c: Command<F>): Command<F> {
  return c;
}

const HELP: BooleanFlag = { type: "boolean", short: "h", help: "print this help and exit" };

const quote = (s: string) => JSON.stringify(s);

/**
 * Parse `argv` against `c`. Returns `undefined` when `--help` (or `-h`) was given anywhere, so the
 * caller prints `usage(c)`; throws `UsageError` for anything it cannot use.
 */
export function parseCommandLine<F extends Flags>(
  c: Command<F>,
  argv: readonly string[],
): Parsed<F> | undefined {
  const specs: Record<string, { type: "string" | "boolean"; short?: string }> = {
    help: { type: "boolean", short: "h" },
  };
  for (const [name, flag] of Object.entries(c.flags)) {
    specs[name] = { type: flag.type === "boolean" ? "boolean" : "string" };
    if (flag.short) specs[name].short = flag.short;
    if (flag.type === "boolean" && flag.negatable) specs[`no-${name}`] = { type: "boolean" };
  }
  // Not strict: every token comes back, and the refusals below say what is wrong in one line.
  const { tokens } = parseArgs({
    args: [...argv],
    options: specs,
    strict: false,
    allowPositionals: true,
    tokens: true,
  });
  if (tokens.some((t) => t.kind === "option" && t.name === "help")) return undefined;

  const raw = new Map<string, string[]>();
  const switches = new Map<string, boolean>();
  const args: string[] = [];
  for (const t of tokens) {
    if (t.kind === "option-terminator") continue;
    if (t.kind === "positional") {
      if (!c.args) throw new UsageError(`unexpected argument ${quote(t.value)}`);
      const { choices, what = c.args.name } = c.args;
      if (choices && !choices.includes(t.value)) {
        throw new UsageError(`unknown ${what} ${quote(t.value)}; known: ${choices.join(", ")}`);
      }
      args.push(t.value);
      continue;
    }
    const negated = t.name.startsWith("no-") && specs[t.name] !== undefined && !(t.name in c.flags);
    const name = negated ? t.name.slice(3) : t.name;
    const flag = c.flags[name];
    if (flag === undefined) throw new UsageError(`unknown flag ${t.rawName}`);
    if (flag.type === "boolean") {
      if (t.inlineValue) throw new UsageError(`${t.rawName} takes no value (got ${quote(t.value ?? "")})`);
      switches.set(name, !negated);
      continue;
    }
    const value = t.value;
    // `--seconds --quick`: the next flag is not a value. (`--seconds -1` is a value, and refused below.)
    if (value === undefined || (!t.inlineValue && /^--?[a-z]/i.test(value))) {
      throw new UsageError(`${t.rawName} needs a value`);
    }
    raw.set(name, [...(raw.get(name) ?? []), value]);
  }

  const small = switches.get("small") === true;
  const values: Record<string, unknown> = {};
  for (const [name, flag] of Object.entries(c.flags)) {
    const given = raw.get(name);
    if (flag.type === "boolean") {
      values[name] = switches.get(name) ?? flag.default ?? false;
    } else if (flag.type === "string") {
      if (given) {
        for (const v of given) {
          if (flag.choices && !flag.choices.includes(v)) {
            throw new UsageError(
              `--${name} must be one of ${flag.choices.map(quote).join(", ")} (got ${quote(v)})`,
            );
          }
        }
      }
      values[name] = flag.multiple
        ? (given ?? (flag.default === undefined ? [] : [flag.default]))
        : (given?.at(-1) ?? flag.default);
    } else if (given) {
      values[name] = readNumber(name, flag, given.at(-1)!);
    } else {
      values[name] = small && flag.small !== undefined ? flag.small : flag.default;
    }
  }
  return { values: values as Values<F>, args };
}

function readNumber(name: string, flag: NumberFlag, text: string): number {
  const integer = flag.type === "int";
  const min = flag.min ?? (integer ? 1 : 0);
  const n = text.trim() === "" ? Number.NaN : Number(text);
  if (!Number.isFinite(n) || n < min || (integer && !Number.isInteger(n))) {
    throw new UsageError(
      `--${name} must be ${integer ? "an integer" : "a number"} >= ${min} (got ${quote(text)})`,
    );
  }
  return n;
}

/** The usage: how to run it, what it does, each flag with its default, then the notes. */
export function usage(c: Command): string {
  const rows: [string, string][] = [];
  if (c.args) rows.push([c.args.name, c.args.help]);
  for (const [name, flag] of Object.entries(c.flags)) {
    const alias = flag.short ? `-${flag.short}, ` : "";
    if (flag.type === "boolean") {
      const left = flag.negatable ? `--${name}, --no-${name}` : `--${name}`;
      rows.push([
        `${alias}${left}`,
        flag.negatable ? `${flag.help} (default ${flag.default ? "on" : "off"})` : flag.help,
      ]);
      continue;
    }
    const value = flag.value ?? (flag.type === "string" ? "VALUE" : "N");
    let fallback = flag.defaultText;
    if (fallback === undefined && flag.default !== undefined) {
      fallback = String(flag.default);
      if (flag.type !== "string" && flag.small !== undefined) fallback += `; --small: ${flag.small}`;
    }
    const repeat = flag.type === "string" && flag.multiple ? "; repeat it for more" : "";
    rows.push([
      `${alias}--${name} ${value}`,
      `${flag.help}${repeat}${fallback === undefined ? "" : ` (default ${fallback})`}`,
    ]);
    if (flag.type === "string" && flag.choices)
      rows.push(["", `one of: ${flag.choices.map(quote).join(", ")}`]);
  }
  rows.push(["-h, --help", HELP.help]);
  const width = Math.max(...rows.map(([left]) => left.length)) + 2;
  const lines = [
    `usage: ${c.synopsis}`,
    "",
    c.about,
    "",
    c.args ? "arguments and flags:" : "flags:",
    ...rows.map(([left, right]) => `  ${left.padEnd(width)}${right}`),
  ];
  if (c.notes && c.notes.length > 0) lines.push("", ...c.notes);
  return `${lines.join("\n")}\n`;
}

/** The one line a refusal prints: `demo: unknown flag --x (try --help)`. */
export function refusal(c: Pick<Command, "name" | "hint">, error: UsageError): string {
  return `${c.name}: ${error.message} (${c.hint ?? "try --help"})\n`;
}

/**
 * For a program's entry point: parse `argv` (default: the process's arguments), or print the
 * usage and exit 0 on `--help`, or print the one-line refusal and exit 2.
 */
export function parseOrExit<F extends Flags>(
  c: Command<F>,
  argv: readonly string[] = process.argv.slice(2),
): Parsed<F> {
  let parsed: Parsed<F> | undefined;
  try {
    parsed = parseCommandLine(c, argv);
  } catch (error) {
    if (!(error instanceof UsageError)) throw error;
    process.stderr.write(refusal(c, error));
    process.exit(2);
  }
  if (parsed === undefined) {
    process.stdout.write(usage(c as Command));
    process.exit(0);
  }
  return parsed;
}
