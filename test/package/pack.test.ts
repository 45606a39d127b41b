import { execFile } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { promisify } from "node:util";
import ts from "typescript";
import { beforeAll, describe, expect, it } from "vitest";
import { expectedDist, filesUnder, problems, ROOT } from "./contents.js";

const run = promisify(execFile);
const npm = process.platform === "win32" ? "npm.cmd" : "npm";

/** The paths `npm pack` would put in the tarball, from the tree as it is (no build is run). */
async function packList(): Promise<string[]> {
  const { stdout } = await run(npm, ["pack", "--dry-run", "--json", "--ignore-scripts"], {
    cwd: ROOT,
    maxBuffer: 64 * 1024 * 1024,
  });
  const [result] = JSON.parse(stdout) as { files: { path: string }[] }[];
  return result!.files.map((file) => file.path).sort();
}

const read = (path: string) => readFileSync(join(ROOT, path), "utf8");
const pkg = JSON.parse(read("package.json")) as { exports: Record<string, unknown> };

let files: string[];

beforeAll(async () => {
  files = await packList();
  const dist = files.filter((path) => path.startsWith("dist/"));
  if (dist.join("\n") !== expectedDist().join("\n")) {
    // No build yet, or one of other sources: build (dist/ is emptied first) and list again.
    await run(npm, ["run", "build"], { cwd: ROOT, maxBuffer: 64 * 1024 * 1024 });
    files = await packList();
  }
}, 180_000);

describe("the package", () => {
  it("holds dist (modules, types, maps with their sources), lua, docs and the top-level files, nothing else", () => {
    expect(problems(files, read)).toEqual([]);
    expect(files.filter((path) => /^(src|test|bench|examples|soak|build|docs\/api)\//.test(path))).toEqual(
      [],
    );
  });

  it("ships every Lua script and the docs but for the generated API site", () => {
    for (const lua of filesUnder("lua")) expect(files).toContain(lua);
    expect(files.filter((path) => path.startsWith("docs/"))).toEqual(
      filesUnder("docs").filter((path) => !path.startsWith("docs/api/")),
    );
  });

  it("has types first, then import, then default (one build, for import and require) in every export", () => {
    for (const [subpath, entry] of Object.entries(pkg.exports)) {
      if (subpath === "./package.json") continue;
      const conditions = entry as Record<string, string>;
      expect(Object.keys(conditions), subpath).toEqual(["types", "import", "default"]);
      expect(conditions.default, subpath).toBe(conditions.import);
      expect(conditions.types, subpath).toBe(conditions.import!.replace(/\.js$/, ".d.ts"));
    }
  });
});

/** `file:line` of each top-level `await` (also `for await` and `await using`) in a module. */
function topLevelAwaits(file: string, text: string): string[] {
  const source = ts.createSourceFile(file, text, ts.ScriptTarget.Latest, true);
  const found: string[] = [];
  const at = (node: ts.Node) => `${file}:${source.getLineAndCharacterOfPosition(node.getStart()).line + 1}`;
  const visit = (node: ts.Node): void => {
    if (ts.isFunctionLike(node) || ts.isClassStaticBlockDeclaration(node)) return;
    if (ts.isAwaitExpression(node)) found.push(at(node));
    else if (ts.isForOfStatement(node) && node.awaitModifier) found.push(at(node));
    else if (
      ts.isVariableDeclarationList(node) &&
      (node.flags & ts.NodeFlags.AwaitUsing) === ts.NodeFlags.AwaitUsing
    ) {
      found.push(at(node));
    }
    ts.forEachChild(node, visit);
  };
  visit(source);
  return found;
}

describe("require() from CommonJS", () => {
  it("finds no top-level await in src (require of an ES module refuses one)", () => {
    const sources = filesUnder("src").filter((path) => path.endsWith(".ts"));
    expect(sources.length).toBeGreaterThan(10);
    expect(sources.flatMap((path) => topLevelAwaits(path, read(path)))).toEqual([]);
    // The scan itself sees one.
    expect(topLevelAwaits("x.ts", "const a = await f();\nasync function g() { await h(); }")).toEqual([
      "x.ts:1",
    ]);
  });

  it("loads every entry point with require(), the same modules that import gives", async () => {
    const subpaths = Object.keys(pkg.exports)
      .filter((subpath) => subpath !== "./package.json")
      .map((subpath) => `floodgate${subpath.slice(1)}`);
    // The package by its own name, from its own directory: resolved through `exports` as a
    // dependency would be, into dist/ as built above.
    const program = `
      const subpaths = ${JSON.stringify(subpaths)};
      (async () => {
        for (const subpath of subpaths) {
          const required = require(subpath);
          const imported = await import(subpath);
          const names = Object.keys(imported).filter((name) => name !== "default");
          if (names.length === 0) throw new Error(subpath + " exports nothing");
          for (const name of names) {
            if (required[name] !== imported[name]) throw new Error(subpath + ": require and import differ on " + name);
          }
          console.log(subpath + " " + names.length);
        }
      })().catch((error) => { console.error(error); process.exit(1); });
    `;
    const { stdout } = await run(process.execPath, ["--input-type=commonjs", "-e", program], { cwd: ROOT });
    expect(
      stdout
        .trim()
        .split("\n")
        .map((line) => line.split(" ")[0]),
    ).toEqual(subpaths);
  }, 30_000);
});
