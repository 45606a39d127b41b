import { execFile } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { expect, it } from "vitest";

/**
 * The API reference builds from the TSDoc with typedoc.json (entry points, treatWarningsAsErrors)
 * and with no warning at all: a broken {@link}, a type referenced but not documented, a bad tag.
 * TypeScript's own errors are not looked for again here (`--skipErrorChecking`: 9 s against 27 s
 * for the build): `npm run typecheck` checks every file (CI runs it before the suite).
 */

const root = fileURLToPath(new URL("../../", import.meta.url));
const typedoc = join(root, "node_modules", "typedoc", "bin", "typedoc");

it("builds the API reference with no warning", async () => {
  const out = mkdtempSync(join(tmpdir(), "floodgate-api-"));
  try {
    const result = await new Promise<{ code: number; output: string }>((resolve, reject) => {
      execFile(
        process.execPath,
        [typedoc, "--out", out, "--logLevel", "Info", "--skipErrorChecking"],
        { cwd: root, env: { ...process.env, NO_COLOR: "1", FORCE_COLOR: "0" }, maxBuffer: 16 << 20 },
        (error, stdout, stderr) => {
          const code = error ? (typeof error.code === "number" ? error.code : -1) : 0;
          if (error && code === -1) reject(error);
          else resolve({ code, output: `${stdout}${stderr}` });
        },
      );
    });
    const problems = result.output.split("\n").filter((line) => /\[(warning|error)\]/.test(line));
    expect(problems, result.output).toEqual([]);
    expect(result.code, result.output).toBe(0);
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
}, 180_000);
