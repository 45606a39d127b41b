import { defineConfig } from "vitest/config";
import base from "./vitest.config.ts";

/**
 * The suites `npm run mutation` (Stryker) runs for each mutant: the algorithms, the memory backend
 * and the contract suites on memory only. No Redis is started; the two contract files that
 * compare memory with Redis step by step (extremes, valid-extremes) need one and are left out.
 */
export default defineConfig({
  resolve: base.resolve,
  test: {
    include: ["test/algorithms/**/*.test.ts", "test/memory/**/*.test.ts", "test/contract/**/*.test.ts"],
    exclude: ["**/node_modules/**", "test/contract/extremes.test.ts", "test/contract/valid-extremes.test.ts"],
    env: { FLOODGATE_BACKENDS: "memory" },
    testTimeout: 20_000,
  },
});
