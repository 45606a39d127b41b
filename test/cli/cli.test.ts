import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";
import { command, parseCommandLine, UsageError, usage } from "../../examples/cli.js";

const root = fileURLToPath(new URL("../..", import.meta.url));

interface Outcome {
  code: number | null;
  stdout: string;
  stderr: string;
}

/** At most this many programs start at once: each is a Node process compiling TypeScript. */
const AT_ONCE = 3;
let running = 0;
const queue: (() => void)[] = [];

/** Run `node --import tsx <file> ...args` from the repository's root, a few at a time. */
async function run(file: string, args: string[]): Promise<Outcome> {
  if (running >= AT_ONCE) await new Promise<void>((resolve) => queue.push(resolve));
  running++;
  try {
    return await new Promise<Outcome>((resolve, reject) => {
      const env = { ...process.env };
      delete env.REDIS_URL;
      const child = spawn(process.execPath, ["--import", "tsx", file, ...args], {
        cwd: root,
        env,
        stdio: ["ignore", "pipe", "pipe"],
      });
      let stdout = "";
      let stderr = "";
      child.stdout.setEncoding("utf8").on("data", (d: string) => (stdout += d));
      child.stderr.setEncoding("utf8").on("data", (d: string) => (stderr += d));
      const timer = setTimeout(() => child.kill("SIGKILL"), 30_000);
      child.on("error", reject);
      child.on("close", (code) => {
        clearTimeout(timer);
        resolve({ code, stdout, stderr });
      });
    });
  } finally {
    running--;
    queue.shift()?.();
  }
}

/** Every program, how it is named in its messages, and a line its usage must have. */
const PROGRAMS = [
  { program: "demo", file: "examples/demo.ts", args: [], usage: "--requests N" },
  { program: "example", file: "examples/run.ts", args: [], usage: "rateshop" },
  { program: "rateshop", file: "examples/run.ts", args: ["rateshop"], usage: "--shops N" },
  { program: "soak", file: "soak/soak.ts", args: [], usage: "--faults, --no-faults" },
  { program: "chaos", file: "soak/chaos.ts", args: [], usage: "--phase NAME" },
  { program: "bench", file: "bench/index.ts", args: [], usage: "--quick" },
] as const;

/** Command lines each program must refuse: the arguments, and what its one line says. */
const REFUSED: { program: string; file: string; args: string[]; says: RegExp }[] = [
  { program: "demo", file: "examples/demo.ts", args: ["--reqests", "80"], says: /unknown flag --reqests/ },
  { program: "demo", file: "examples/demo.ts", args: ["--requests", "abc"], says: /--requests must be/ },
  { program: "example", file: "examples/run.ts", args: ["nosuch"], says: /unknown example "nosuch"/ },
  {
    program: "ingest",
    file: "examples/run.ts",
    args: ["ingest", "--records", "-1"],
    says: /--records must be/,
  },
  {
    program: "llm",
    file: "examples/run.ts",
    args: ["llm", "--small", "--docs"],
    says: /--docs needs a value/,
  },
  { program: "soak", file: "soak/soak.ts", args: ["--seconds", "abc"], says: /--seconds must be/ },
  { program: "soak", file: "soak/soak.ts", args: ["--seconds", "-1"], says: /--seconds must be/ },
  { program: "chaos", file: "soak/chaos.ts", args: ["--phase", "calmish"], says: /--phase must be one of/ },
  { program: "bench", file: "bench/index.ts", args: ["--quikc"], says: /unknown flag --quikc/ },
  {
    program: "bench",
    file: "bench/index.ts",
    args: ["nosuch", "--quick"],
    says: /unknown benchmark "nosuch"/,
  },
];

// Started together here, a few at a time; each test waits for its own.
const helps = PROGRAMS.map((p) => ({ ...p, outcome: run(p.file, [...p.args, "--help"]) }));
const shortHelp = run("examples/demo.ts", ["-h"]);
const refusals = REFUSED.map((r) => ({ ...r, outcome: run(r.file, r.args) }));

describe("every program's --help", () => {
  for (const { program, usage: line, outcome } of helps) {
    it(`${program}: prints its usage on stdout and exits 0`, { timeout: 60_000 }, async () => {
      const { code, stdout, stderr } = await outcome;
      expect(stderr).toBe("");
      expect(code).toBe(0);
      expect(stdout).toMatch(/^usage: /);
      expect(stdout).toContain(line);
      expect(stdout).toContain("-h, --help");
    });
  }

  it("-h is --help", { timeout: 60_000 }, async () => {
    const [short, long] = await Promise.all([shortHelp, helps[0]!.outcome]);
    expect(short).toEqual(long);
  });

  it("states each flag's default", { timeout: 60_000 }, async () => {
    const demo = (await helps[0]!.outcome).stdout;
    expect(demo).toMatch(/--requests N\s+requests to send \(default 400\)/);
    expect((await helps[2]!.outcome).stdout).toMatch(/--shops N .*\(default 20; --small: 6\)/);
    expect((await helps[3]!.outcome).stdout).toMatch(/--seconds N .*\(default 60\)/);
  });
});

describe("every program refuses a command line it cannot use", () => {
  for (const { program, args, says, outcome } of refusals) {
    it(`${program}: ${args.join(" ")}: one line on stderr, exit 2`, { timeout: 60_000 }, async () => {
      const { code, stdout, stderr } = await outcome;
      expect(code).toBe(2);
      expect(stdout).toBe("");
      expect(stderr.endsWith("\n")).toBe(true);
      expect(stderr.trimEnd().split("\n")).toHaveLength(1);
      expect(stderr).not.toMatch(/\bat /);
      expect(stderr.startsWith(`${program}: `)).toBe(true);
      expect(stderr).toMatch(says);
      expect(stderr).toMatch(/\(try.*--help\)\n$/);
    });
  }
});

describe("the parser", () => {
  const c = command({
    name: "t",
    synopsis: "t [flags]",
    about: "A test.",
    flags: {
      small: { type: "boolean", help: "short" },
      n: { type: "int", default: 10, small: 2, help: "count" },
      rate: { type: "number", min: 0.5, help: "rate" },
      faults: { type: "boolean", default: true, negatable: true, help: "faults" },
      phase: { type: "string", multiple: true, choices: ["a", "b c"], help: "phase" },
    },
  });
  const parse = (...argv: string[]) => parseCommandLine(c, argv)?.values;
  const refuse = (...argv: string[]) => {
    try {
      parseCommandLine(c, argv);
    } catch (error) {
      expect(error).toBeInstanceOf(UsageError);
      return (error as Error).message;
    }
    throw new Error(`accepted ${argv.join(" ")}`);
  };

  it("gives defaults, --small's defaults and the values given", () => {
    expect(parse()).toEqual({ small: false, n: 10, rate: undefined, faults: true, phase: [] });
    expect(parse("--small")).toMatchObject({ small: true, n: 2 });
    expect(parse("--small", "--n=7", "--rate", "0.5")).toMatchObject({ n: 7, rate: 0.5 });
    expect(parse("--no-faults", "--phase", "b c", "--phase", "a")).toMatchObject({
      faults: false,
      phase: ["b c", "a"],
    });
  });

  it("returns nothing for --help, wherever it stands and whatever else is wrong", () => {
    expect(parseCommandLine(c, ["--bogus", "-h"])).toBeUndefined();
  });

  it("says in one line what is wrong", () => {
    expect(refuse("--bogus")).toBe("unknown flag --bogus");
    expect(refuse("-x")).toBe("unknown flag -x");
    expect(refuse("--no-small")).toBe("unknown flag --no-small");
    expect(refuse("--n")).toBe("--n needs a value");
    expect(refuse("--n", "--small")).toBe("--n needs a value");
    expect(refuse("--n", "1.5")).toBe('--n must be an integer >= 1 (got "1.5")');
    expect(refuse("--n", "")).toBe('--n must be an integer >= 1 (got "")');
    expect(refuse("--rate", "0.1")).toBe('--rate must be a number >= 0.5 (got "0.1")');
    expect(refuse("--small=yes")).toBe('--small takes no value (got "yes")');
    expect(refuse("--phase", "c")).toBe('--phase must be one of "a", "b c" (got "c")');
    expect(refuse("extra")).toBe('unexpected argument "extra"');
  });

  it("writes a usage with every flag and its default", () => {
    const text = usage(c);
    expect(text).toMatch(/--n N\s+count \(default 10; --small: 2\)/);
    expect(text).toMatch(/--faults, --no-faults\s+faults \(default on\)/);
    expect(text).toContain('one of: "a", "b c"');
  });
});
