import { spawn } from "node:child_process";
import { mkdirSync, rmSync, writeFileSync } from "node:fs";
import { join, relative } from "node:path";
import { fileURLToPath } from "node:url";
import { build } from "esbuild";
import ts from "typescript";
import { afterAll, beforeAll, describe, expect, inject, it } from "vitest";
import { markdownFiles, type Snippet, snippets } from "./snippets.js";

/**
 * Every TypeScript block of README.md and docs/ is type-checked against src/ (through the same
 * `floodgate`, `floodgate/redis`, … mapping as tsconfig.json), and every block marked `run` is run
 * as a program of its own that must exit 0 by itself, print nothing on stderr, and end within
 * RUN_TIMEOUT_MS. A block marked `run redis` gets the test Redis in `REDIS_URL`.
 *
 * A runnable block is bundled with src/ by esbuild (the packages stay outside) and run by plain
 * node, which costs a fraction of a process that compiles src/ on the way. The bundles sit two
 * levels below the root, as src/redis/scripts.ts does, so that it finds lua/ where it looks.
 */

const root = fileURLToPath(new URL("../../", import.meta.url));
const RUN_TIMEOUT_MS = 15_000;

interface Block extends Snippet {
  /** Where the block is written as a module of its own. */
  path: string;
  /** Where a runnable block is bundled with src/. */
  bundle: string;
  /** `docs/gate.md:42`, for messages. */
  where: string;
}

const dir = join(root, "build", `snippets-${process.pid}-${Date.now().toString(36)}`);
const blocks: Block[] = markdownFiles().flatMap((file) =>
  snippets(file).map((s) => {
    const rel = relative(root, file);
    const name = `${rel.replace(/\.md$/, "").replace(/[^A-Za-z0-9]+/g, "-")}-${s.line}.ts`;
    return {
      ...s,
      path: join(dir, name),
      bundle: join(dir, name.replace(/\.ts$/, ".mjs")),
      where: `${rel}:${s.line}`,
    };
  }),
);
const files = [...new Set(blocks.map((b) => relative(root, b.file)))];

/** Type errors by Markdown file, each as `file:line: message`. */
const errors = new Map<string, string[]>();

function typeCheck(): void {
  const src = (path: string) => [join(root, "src", path)];
  const config = {
    extends: join(root, "tsconfig.json"),
    compilerOptions: {
      noEmit: true,
      paths: {
        floodgate: src("index.ts"),
        "floodgate/redis": src("redis/index.ts"),
        "floodgate/fetch": src("http/fetch.ts"),
        "floodgate/undici": src("http/undici.ts"),
        "floodgate/testing": src("testing/index.ts"),
        "floodgate/otel": src("otel/index.ts"),
      },
    },
    include: ["*.ts"],
  };
  const configPath = join(dir, "tsconfig.json");
  writeFileSync(configPath, JSON.stringify(config, null, 2));
  const parsed = ts.getParsedCommandLineOfConfigFile(
    configPath,
    {},
    {
      ...ts.sys,
      onUnRecoverableConfigFileDiagnostic: (d) => {
        throw new Error(ts.flattenDiagnosticMessageText(d.messageText, "\n"));
      },
    },
  );
  if (!parsed) throw new Error(`could not read ${configPath}`);
  const program = ts.createProgram(parsed.fileNames, parsed.options);
  const byPath = new Map(blocks.map((b) => [b.path, b]));
  for (const d of [...program.getGlobalDiagnostics(), ...program.getOptionsDiagnostics()]) {
    throw new Error(ts.flattenDiagnosticMessageText(d.messageText, "\n"));
  }
  for (const block of blocks) {
    const source = program.getSourceFile(block.path);
    if (!source) throw new Error(`${block.where}: not in the program`);
    for (const d of [...program.getSyntacticDiagnostics(source), ...program.getSemanticDiagnostics(source)]) {
      const at = d.start === undefined ? 0 : source.getLineAndCharacterOfPosition(d.start).line;
      const b = byPath.get(source.fileName) ?? block;
      const message = `${relative(root, b.file)}:${b.line + 1 + at}: ${ts.flattenDiagnosticMessageText(d.messageText, " ")}`;
      const list = errors.get(relative(root, b.file)) ?? [];
      list.push(message);
      errors.set(relative(root, b.file), list);
    }
  }
}

/** The URL of the test Redis, or an error saying how to get one. Never a skip. */
function redisUrl(): string {
  const url = inject("redisUrl");
  if (!url) throw new Error(inject("redisError") || "no Redis for the `ts run redis` blocks");
  return url;
}

interface Exit {
  code: number | null;
  signal: NodeJS.Signals | null;
  stdout: string;
  stderr: string;
  timedOut: boolean;
}

function runBlock(block: Block, env: NodeJS.ProcessEnv): Promise<Exit> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ["--enable-source-maps", block.bundle], {
      cwd: root,
      env,
      stdio: ["ignore", "pipe", "pipe"],
    });
    let stdout = "";
    let stderr = "";
    let timedOut = false;
    child.stdout.on("data", (chunk) => {
      stdout += chunk;
    });
    child.stderr.on("data", (chunk) => {
      stderr += chunk;
    });
    const timer = setTimeout(() => {
      timedOut = true;
      child.kill("SIGKILL");
    }, RUN_TIMEOUT_MS);
    child.on("error", (error) => {
      clearTimeout(timer);
      reject(error);
    });
    child.on("close", (code, signal) => {
      clearTimeout(timer);
      resolve({ code, signal, stdout, stderr, timedOut });
    });
  });
}

beforeAll(async () => {
  mkdirSync(dir, { recursive: true });
  for (const block of blocks) writeFileSync(block.path, `${block.code}\n`);
  typeCheck();
  const runnable = blocks.filter((b) => b.run !== "none");
  if (runnable.length === 0) return;
  await build({
    entryPoints: runnable.map((b) => b.path),
    outdir: dir,
    outExtension: { ".js": ".mjs" },
    bundle: true,
    platform: "node",
    format: "esm",
    target: "node20",
    packages: "external",
    tsconfig: join(dir, "tsconfig.json"),
    sourcemap: "inline",
    logLevel: "silent",
  });
}, 60_000);

afterAll(() => {
  rmSync(dir, { recursive: true, force: true });
});

describe("documentation blocks", () => {
  it("has runnable blocks of both kinds", () => {
    expect(blocks.filter((b) => b.run === "memory").length).toBeGreaterThan(0);
    expect(blocks.filter((b) => b.run === "redis").length).toBeGreaterThan(0);
  });

  it("each block is a whole module (its own imports)", () => {
    const scripts = blocks.filter((b) => !/^\s*(import|export)\s/m.test(b.code)).map((b) => b.where);
    expect(scripts, "blocks with neither an import nor an export").toEqual([]);
  });

  it.each(files)("type-checks the blocks of %s", (file) => {
    expect(errors.get(file) ?? [], "type errors").toEqual([]);
  });

  const runnable = blocks.filter((b) => b.run !== "none");
  it.concurrent.each(runnable.map((b) => [`${b.where} (${b.run})`, b] as const))(
    "runs %s to its end",
    async (_, block) => {
      const env: NodeJS.ProcessEnv = { ...process.env };
      delete env.REDIS_URL;
      delete env.NODE_OPTIONS;
      if (block.run === "redis") env.REDIS_URL = redisUrl();
      const exit = await runBlock(block, env);
      const said = `\n--- stdout\n${exit.stdout}\n--- stderr\n${exit.stderr}`;
      expect(exit.timedOut, `${block.where} did not end by itself within ${RUN_TIMEOUT_MS} ms${said}`).toBe(
        false,
      );
      expect(exit.code, `${block.where} exited with ${exit.code ?? exit.signal}${said}`).toBe(0);
      expect(exit.stderr, `${block.where} wrote to stderr`).toBe("");
    },
    RUN_TIMEOUT_MS + 5_000,
  );
});
