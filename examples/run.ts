/**
 * Runs one example: `npm run example -- <name> [flags]`. `--help` (or no name) lists the
 * examples; `npm run example -- <name> --help` shows an example's flags. Each example runs in
 * memory, or on Redis when REDIS_URL is set. A name or flag it cannot use exits 2 with one line.
 */
import { refusal, UsageError } from "./cli.js";

interface Example {
  about: string;
  main(argv: string[]): Promise<number>;
}

const EXAMPLES: Record<string, { seed: string; load: () => Promise<Example> }> = {
  delaware: { seed: "000", load: () => import("./delaware.js") },
  autoscale: { seed: "001", load: () => import("./autoscale.js") },
  llm: { seed: "002", load: () => import("./llm.js") },
  ingest: { seed: "003", load: () => import("./ingest.js") },
  rateshop: { seed: "004", load: () => import("./rateshop.js") },
};

const RUNNER = { name: "example" };

async function list(): Promise<string> {
  const lines = [
    "usage: npm run example -- <name> [flags]",
    "",
    "Runs one example against its own simulated provider; prints a summary ending in OK or FAILED",
    "(exit 1). Each runs in memory; set REDIS_URL=redis://host:port to run it on Redis.",
    "",
    "examples:",
  ];
  for (const [name, { load }] of Object.entries(EXAMPLES)) {
    lines.push(`  ${name.padEnd(10)} ${(await load()).about}`);
  }
  lines.push(
    "",
    "flags:",
    "  --small           a short run (a few seconds); every example takes it",
    "  --chart FILE.svg  draw the run (in flight, waiting, 429s and sheds over time) to FILE.svg",
    "  -h, --help        this list; after a name, that example's flags and their defaults",
  );
  return `${lines.join("\n")}\n`;
}

async function run(argv: string[]): Promise<number> {
  const [name, ...rest] = argv;
  if (name === undefined || name === "--help" || name === "-h" || name === "help") {
    process.stdout.write(await list());
    return 0;
  }
  if (name.startsWith("-")) {
    process.stderr.write(
      refusal(RUNNER, new UsageError(`the example's name comes first: npm run example -- <name> ${name}`)),
    );
    return 2;
  }
  const entry = EXAMPLES[name];
  if (!entry) {
    const known = Object.keys(EXAMPLES).join(", ");
    process.stderr.write(
      refusal(RUNNER, new UsageError(`unknown example ${JSON.stringify(name)}; known: ${known}`)),
    );
    return 2;
  }
  try {
    return await (await entry.load()).main(rest);
  } catch (error) {
    if (error instanceof UsageError) {
      process.stderr.write(refusal({ name, hint: `try: npm run example -- ${name} --help` }, error));
      return 2;
    }
    throw error;
  }
}

run(process.argv.slice(2)).then(
  (code) => {
    process.exitCode = code;
    // Everything is closed by now; if a handle still holds the process open, do not hang CI.
    setTimeout(() => {
      process.stderr.write("example: something was still open 5 s after the run; exiting\n");
      process.exit(code);
    }, 5000).unref();
  },
  (error: unknown) => {
    process.stderr.write(`example failed: ${(error as Error).stack ?? error}\n`);
    process.exit(1);
  },
);
