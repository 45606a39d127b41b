/**
 * Runs one example: `npm run example -- <name> [flags]`. `--help` (or no name, or a name it does
 * not know) lists the examples; `npm run example -- <name> --help` shows an example's flags.
 * Each example runs in memory, or on Redis when REDIS_URL is set.
 */
import { UsageError } from "./common.js";

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

async function list(): Promise<string> {
  const lines = ["usage: npm run example -- <name> [--small] [flags]", "", "examples:"];
  for (const [name, { load }] of Object.entries(EXAMPLES)) {
    lines.push(`  ${name.padEnd(10)} ${(await load()).about}`);
  }
  lines.push(
    "",
    "Each runs in memory; set REDIS_URL=redis://host:port to run it on Redis.",
    "`npm run example -- <name> --help` shows an example's flags; --small is a short run.",
  );
  return `${lines.join("\n")}\n`;
}

async function run(argv: string[]): Promise<number> {
  const [name, ...rest] = argv;
  if (name === undefined || name === "--help" || name === "-h" || name === "help") {
    process.stdout.write(await list());
    return 0;
  }
  const entry = EXAMPLES[name];
  if (!entry) {
    process.stderr.write(`example: no example named ${JSON.stringify(name)}\n\n${await list()}`);
    return 2;
  }
  try {
    return await (await entry.load()).main(rest);
  } catch (error) {
    if (error instanceof UsageError) {
      process.stderr.write(`${name}: ${error.message}\n(npm run example -- ${name} --help for the flags)\n`);
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
