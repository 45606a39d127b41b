import { existsSync, readFileSync } from "node:fs";
import { dirname, join, relative } from "node:path";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";
import { markdownFiles } from "./snippets.js";

/** Every relative link of README.md and docs/ points at a file that exists, and at a heading in it. */

const root = fileURLToPath(new URL("../../", import.meta.url));

/** The text outside fenced blocks. */
function prose(text: string): string {
  return text.replace(/^```[^\n]*\n[\s\S]*?^```\s*$/gm, "");
}

/** The anchors GitHub gives a file's headings. */
function anchors(file: string): Set<string> {
  const seen = new Map<string, number>();
  const out = new Set<string>();
  for (const line of prose(readFileSync(file, "utf8")).split("\n")) {
    const heading = /^#{1,6}\s+(.*)$/.exec(line);
    if (!heading) continue;
    const slug = heading[1]!
      .trim()
      .toLowerCase()
      .replace(/[^\p{L}\p{N}\s_-]/gu, "")
      .replace(/\s/g, "-");
    const n = seen.get(slug) ?? 0;
    seen.set(slug, n + 1);
    out.add(n === 0 ? slug : `${slug}-${n}`);
  }
  return out;
}

describe("documentation links", () => {
  it.each(markdownFiles().map((f) => relative(root, f)))("the relative links of %s resolve", (rel) => {
    const file = join(root, rel);
    const broken: string[] = [];
    const text = prose(readFileSync(file, "utf8"));
    for (const match of text.matchAll(/\]\(([^)\s]+)\)/g)) {
      const target = match[1]!;
      if (/^[a-z]+:/i.test(target)) continue;
      const [path, anchor] = target.split("#") as [string, string | undefined];
      const resolved = path === "" ? file : join(dirname(file), path);
      if (!existsSync(resolved)) {
        broken.push(`${target}: no such file`);
        continue;
      }
      if (anchor !== undefined && resolved.endsWith(".md") && !anchors(resolved).has(anchor)) {
        broken.push(`${target}: no such heading`);
      }
    }
    expect(broken).toEqual([]);
  });
});
