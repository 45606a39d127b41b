/**
 * A TypeScript entry (a test fixture, a benchmark's worker) as one JavaScript file that plain
 * `node` starts: the library's sources bundled in (or, with the build's tsconfig, the package
 * itself left to Node), every other package left to Node. Through tsx's loader a process took
 * 1.2–1.5 s of CPU to load the library, ioredis and undici (tsx resolves and compiles every
 * module a process imports, the packages' too); from one bundled file 0.6–0.7 s. Suites that
 * fork a fleet of processes (the chaos run forks about thirty a fleet) start them so.
 */
import { createHash, randomBytes } from "node:crypto";
import { existsSync, mkdirSync, readdirSync, renameSync, rmSync, statSync, writeFileSync } from "node:fs";
import { basename, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { buildSync } from "esbuild";

/** The repository root: fixture processes run from here, and relative entries are found from it. */
export const ROOT = fileURLToPath(new URL("../../", import.meta.url));

/**
 * Where bundles go, each named by its content, so that processes bundling the same entry share
 * one file and none removes another's: two levels below the project, as src/redis/ is (the
 * library finds lua/ at ../../lua from its module, here the bundle).
 */
const DIR = `${ROOT}.cache/entries`;

/** Bundles older than this go at the start of a test run (`pruneEntries`): a day. */
const STALE_MS = 24 * 60 * 60 * 1000;

/** Each entry bundled once in this process, by its path and tsconfig: the file that runs it. */
const bundled = new Map<string, string>();

/**
 * The bundled file of the entry at `path` (absolute, or from the project's root), made on the
 * first call in this process. `tsconfig` maps "floodgate" (default: the project's, which maps it
 * to src/).
 */
export function bundleEntry(path: string, tsconfig = `${ROOT}tsconfig.json`): string {
  const entry = resolve(ROOT, path);
  const id = `${entry}|${tsconfig}`;
  let out = bundled.get(id);
  if (out !== undefined) return out;
  if (bundled.size === 0) mkdirSync(DIR, { recursive: true });
  const text = buildSync({
    entryPoints: [entry],
    write: false,
    bundle: true,
    platform: "node",
    format: "esm",
    target: "node20",
    packages: "external",
    sourcemap: "inline",
    tsconfig,
    logLevel: "warning",
  }).outputFiles[0]!.text;
  const hash = createHash("sha256").update(text).digest("hex").slice(0, 16);
  out = `${DIR}/${basename(entry, ".ts")}-${hash}.mjs`;
  if (!existsSync(out)) {
    // Written whole under another name, then renamed: a process starting from it never reads half.
    const tmp = `${out}.${process.pid}-${randomBytes(4).toString("hex")}.tmp`;
    writeFileSync(tmp, text);
    renameSync(tmp, out);
  }
  bundled.set(id, out);
  return out;
}

/**
 * Remove bundles (and unfinished writes) older than STALE_MS: called where no other process of
 * the run can be using one yet (the test run's global setup), so none is removed under a process
 * about to start from it.
 */
export function pruneEntries(): void {
  if (!existsSync(DIR)) return;
  const now = Date.now();
  for (const name of readdirSync(DIR)) {
    const file = `${DIR}/${name}`;
    try {
      if (now - statSync(file).mtimeMs > STALE_MS) rmSync(file, { force: true });
    } catch {
      // Removed by another process meanwhile.
    }
  }
}
