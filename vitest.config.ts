import { fileURLToPath } from "node:url";
import { defineConfig } from "vitest/config";

const src = (path: string) => fileURLToPath(new URL(`./src/${path}`, import.meta.url));

export default defineConfig({
  resolve: {
    alias: [
      { find: /^floodgate\/redis$/, replacement: src("redis/index.ts") },
      { find: /^floodgate\/fetch$/, replacement: src("http/fetch.ts") },
      { find: /^floodgate\/undici$/, replacement: src("http/undici.ts") },
      { find: /^floodgate\/testing$/, replacement: src("testing/index.ts") },
      { find: /^floodgate\/otel$/, replacement: src("otel/index.ts") },
      { find: /^floodgate$/, replacement: src("index.ts") },
    ],
  },
  test: {
    include: ["test/**/*.test.ts"],
    globalSetup: ["test/setup/global.ts"],
    typecheck: { enabled: true, include: ["test/**/*.test-d.ts"] },
    testTimeout: 20_000,
  },
});
