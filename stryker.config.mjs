// @ts-check
/**
 * Mutation testing of the core: `npm run mutation`. Slow (minutes to hours), so not part of CI.
 * It mutates the algorithms, the memory backend and the Gate, and runs the memory-only suites of
 * vitest.mutation.config.ts against each mutant. Narrow it from the command line:
 * `npm run mutation -- --mutate "src/algorithms/**"`. The report goes to build/mutation/.
 * @type {import("@stryker-mutator/api/core").PartialStrykerOptions}
 */
export default {
  testRunner: "vitest",
  vitest: { configFile: "vitest.mutation.config.ts" },
  checkers: ["typescript"],
  tsconfigFile: "tsconfig.build.json",
  typescriptChecker: { prioritizePerformanceOverAccuracy: true },
  mutate: ["src/algorithms/**/*.ts", "src/memory/**/*.ts", "src/gate.ts"],
  coverageAnalysis: "perTest",
  reporters: ["clear-text", "progress", "html"],
  htmlReporter: { fileName: "build/mutation/index.html" },
  tempDirName: "build/.stryker-tmp",
  ignorePatterns: ["build", "dist", "coverage", "bench", "soak"],
  concurrency: 2,
  timeoutMS: 20_000,
};
