import { fileURLToPath } from "node:url";
import { build } from "esbuild";
import { expect, it } from "vitest";

/**
 * Without the peer installed, nothing changes and nothing is paid: of the entry points, only
 * `floodgate/otel` imports `@opentelemetry/api`, and no module the others load does.
 */
const root = fileURLToPath(new URL("../../", import.meta.url));

/** The packages the modules reached from `entry` import. */
async function packagesOf(entry: string): Promise<string[]> {
  const result = await build({
    entryPoints: [`${root}${entry}`],
    bundle: true,
    write: false,
    platform: "node",
    format: "esm",
    packages: "external",
    metafile: true,
    logLevel: "silent",
  });
  const found = new Set<string>();
  for (const input of Object.values(result.metafile.inputs)) {
    for (const i of input.imports) if (i.external) found.add(i.path);
  }
  return [...found].sort();
}

it.each([
  "src/index.ts",
  "src/redis/index.ts",
  "src/http/fetch.ts",
  "src/http/undici.ts",
  "src/testing/index.ts",
])("%s reaches no @opentelemetry package", async (entry) => {
  const found = await packagesOf(entry);
  expect(found.length).toBeGreaterThan(0);
  expect(found.filter((p) => p.startsWith("@opentelemetry/"))).toEqual([]);
});

it("floodgate/otel imports @opentelemetry/api, and no other package of OpenTelemetry", async () => {
  expect((await packagesOf("src/otel/index.ts")).filter((p) => p.startsWith("@opentelemetry/"))).toEqual([
    "@opentelemetry/api",
  ]);
});
