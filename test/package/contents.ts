import { readdirSync, statSync } from "node:fs";
import { join, relative, sep } from "node:path";
import { fileURLToPath } from "node:url";

/** The repository's root. */
export const ROOT = fileURLToPath(new URL("../../", import.meta.url));

/** Files at the top of the package, besides package.json. */
const TOP = ["README.md", "CHANGELOG.md", "LICENSE"];

/** Every file under `dir` (relative to ROOT, with `/`), or none when it does not exist. */
export function filesUnder(dir: string): string[] {
  const out: string[] = [];
  const walk = (path: string) => {
    let names: string[];
    try {
      names = readdirSync(path);
    } catch {
      return;
    }
    for (const name of names) {
      const full = join(path, name);
      if (statSync(full).isDirectory()) walk(full);
      else out.push(relative(ROOT, full).split(sep).join("/"));
    }
  };
  walk(join(ROOT, dir));
  return out.sort();
}

/** What `npm run build` writes into dist/ for the sources in src/: a .js, its map and a .d.ts each. */
export function expectedDist(): string[] {
  return filesUnder("src")
    .filter((path) => path.endsWith(".ts") && !path.endsWith(".d.ts"))
    .flatMap((path) => {
      const base = `dist/${path.slice("src/".length, -".ts".length)}`;
      return [`${base}.js`, `${base}.js.map`, `${base}.d.ts`];
    })
    .sort();
}

/** Every target named in package.json's `exports` (and `main`/`types`), without the leading `./`. */
export function exportTargets(pkg: { exports: unknown; main?: string; types?: string }): string[] {
  const out = new Set<string>();
  const visit = (value: unknown) => {
    if (typeof value === "string") out.add(value.replace(/^\.\//, ""));
    else if (value && typeof value === "object") for (const inner of Object.values(value)) visit(inner);
  };
  visit(pkg.exports);
  visit(pkg.main);
  visit(pkg.types);
  return [...out].sort();
}

/**
 * What is wrong with a package made of `files` (paths inside the package), each readable by
 * `read`; an empty list when nothing is. The package holds exactly: package.json, README.md,
 * CHANGELOG.md, LICENSE, the build's dist/ (each module's .js, its .d.ts and a source map that
 * carries its sources, since src/ is not shipped; no declaration maps, which would point at
 * src/), every lua/*.lua of the repository, and docs/ but for the generated API site docs/api.
 */
export function problems(files: readonly string[], read: (path: string) => string): string[] {
  const out: string[] = [];
  const have = new Set(files);

  for (const path of files) {
    const allowed =
      path === "package.json" ||
      TOP.includes(path) ||
      /^dist\/.+\.(js|js\.map|d\.ts)$/.test(path) ||
      /^lua\/[^/]+\.lua$/.test(path) ||
      (path.startsWith("docs/") && !path.startsWith("docs/api/"));
    if (!allowed) out.push(`${path} should not be in the package`);
  }

  for (const path of ["package.json", ...TOP]) {
    if (!have.has(path)) out.push(`${path} is missing`);
  }

  const pkg = JSON.parse(read("package.json")) as { exports: unknown; main?: string; types?: string };
  for (const target of exportTargets(pkg)) {
    if (!have.has(target)) out.push(`${target} (named in package.json) is missing`);
  }

  for (const lua of filesUnder("lua").filter((path) => path.endsWith(".lua"))) {
    if (!have.has(lua)) out.push(`${lua} is missing`);
  }
  for (const doc of filesUnder("docs").filter((path) => !path.startsWith("docs/api/"))) {
    if (!have.has(doc)) out.push(`${doc} is missing`);
  }

  const dist = files.filter((path) => path.startsWith("dist/")).sort();
  const expected = expectedDist();
  for (const path of expected) if (!have.has(path)) out.push(`${path} is missing`);
  const wanted = new Set(expected);
  for (const path of dist) {
    if (!wanted.has(path)) out.push(`${path} has no source in src/ (a stale build?)`);
  }

  for (const js of dist.filter((path) => path.endsWith(".js"))) {
    const ref = /\/\/# sourceMappingURL=(\S+)\s*$/.exec(read(js))?.[1];
    const name = js.slice(js.lastIndexOf("/") + 1);
    if (ref !== `${name}.map`) out.push(`${js} does not point at ${name}.map (it names ${ref ?? "no map"})`);
  }
  for (const map of dist.filter((path) => path.endsWith(".map"))) {
    let parsed: { sources?: unknown; sourcesContent?: unknown };
    try {
      parsed = JSON.parse(read(map));
    } catch (error) {
      out.push(`${map} cannot be read as JSON (${(error as Error).message})`);
      continue;
    }
    const sources = Array.isArray(parsed.sources) ? parsed.sources : [];
    const contents = Array.isArray(parsed.sourcesContent) ? parsed.sourcesContent : [];
    if (
      sources.length === 0 ||
      contents.length !== sources.length ||
      !contents.every((text) => typeof text === "string" && text.length > 0)
    ) {
      out.push(`${map} does not carry its sources (sourcesContent), and src/ is not shipped`);
    }
  }
  return out;
}

/**
 * Relative links of README.md (to files, not anchors or URLs) whose target is not among `files`:
 * links that break in the installed package.
 */
export function brokenReadmeLinks(files: readonly string[], readme: string): string[] {
  const have = new Set(files);
  const dirs = new Set<string>();
  for (const path of files) {
    const parts = path.split("/");
    for (let i = 1; i < parts.length; i++) dirs.add(parts.slice(0, i).join("/"));
  }
  const out = new Set<string>();
  for (const match of readme.matchAll(/\]\(([^)\s]+)(?:\s+"[^"]*")?\)/g)) {
    const link = match[1]!;
    if (/^[a-z][a-z0-9+.-]*:/i.test(link) || link.startsWith("#")) continue;
    const path = link
      .replace(/[#?].*$/, "")
      .replace(/^\.\//, "")
      .replace(/\/$/, "");
    if (path && !have.has(path) && !dirs.has(path)) out.add(link);
  }
  return [...out];
}
