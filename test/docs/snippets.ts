import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("../../", import.meta.url));

/** How a documented block is checked: type-checked only, or also run (in memory, or against Redis). */
export type SnippetRun = "none" | "memory" | "redis";

/** One TypeScript block of a Markdown file. */
export interface Snippet {
  /** The Markdown file, as given. */
  file: string;
  /** Line of the opening fence (1-based). */
  line: number;
  /** The block's text. */
  code: string;
  /** From the fence's info string: ```ts (none), ```ts run (memory), ```ts run redis (redis). */
  run: SnippetRun;
}

const FENCE = /^```(\S*)(.*)$/;

/**
 * Every ```ts / ```typescript block of a Markdown file. A block marked `run` is a whole program
 * that ends by itself; `run redis` reads `process.env.REDIS_URL`.
 */
export function snippets(file: string): Snippet[] {
  const lines = readFileSync(file, "utf8").split("\n");
  const out: Snippet[] = [];
  for (let i = 0; i < lines.length; i++) {
    const open = FENCE.exec(lines[i]!);
    if (!open) continue;
    const lang = open[1]!;
    const words = open[2]!.trim().split(/\s+/);
    let end = i + 1;
    while (end < lines.length && !lines[end]!.startsWith("```")) end++;
    if (lang === "ts" || lang === "typescript") {
      const run: SnippetRun = words[0] !== "run" ? "none" : words[1] === "redis" ? "redis" : "memory";
      out.push({ file, line: i + 1, code: lines.slice(i + 1, end).join("\n"), run });
    }
    i = end;
  }
  return out;
}

/** README.md and every Markdown file under docs/, as absolute paths. */
export function markdownFiles(): string[] {
  const files = [join(root, "README.md")];
  const walk = (dir: string) => {
    for (const entry of readdirSync(dir).sort()) {
      const path = join(dir, entry);
      if (statSync(path).isDirectory()) walk(path);
      else if (entry.endsWith(".md")) files.push(path);
    }
  };
  if (existsSync(join(root, "docs"))) walk(join(root, "docs"));
  return files;
}
