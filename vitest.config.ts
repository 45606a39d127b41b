import { fileURLToPath } from "node:url";
import { defineConfig } from "vitest/config";
import SlowFirst from "./test/setup/sequencer.js";

const src = (path: string) => fileURLToPath(new URL(`./src/${path}`, import.meta.url));

/** Suites that freeze, kill or restart processes and judge real-time bounds: run alone. */
const SERIAL = ["test/faults/**/*.test.ts"];

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
    globalSetup: ["test/setup/global.ts"],
    sequence: { sequencer: SlowFirst },
    testTimeout: 20_000,
    projects: [
      {
        extends: true,
        test: {
          name: "suite",
          include: ["test/**/*.test.ts"],
          exclude: [...SERIAL],
          typecheck: { enabled: true, include: ["test/**/*.test-d.ts"] },
          // Most files wait on Redis, child processes and sockets, not on the CPU: three side by
          // side on two cores. A file that counts what Redis ran has a server of its own.
          maxWorkers: 3,
          sequence: { groupOrder: 0 },
        },
      },
      {
        extends: true,
        test: {
          name: "faults",
          include: [...SERIAL],
          // Frozen, killed and restarted processes, measured against bounds in real time: one
          // file at a time, after the rest.
          fileParallelism: false,
          sequence: { groupOrder: 1 },
        },
      },
    ],
  },
});
