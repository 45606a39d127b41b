import { BaseSequencer, type TestSpecification } from "vitest/node";

/**
 * The files of the side-by-side suite that take longest (each about 15–45 s on a 2-core
 * machine), in that order. Without a record of earlier runs (a clean clone, as CI has) vitest
 * starts the largest files first; several of these are small, and one started last held the
 * whole run up for its length while the other workers had nothing left to do.
 */
const SLOW = [
  "test/contract/races.test.ts",
  "test/docs/api.test.ts",
  "test/redis/bucket-classes.test.ts",
  "test/contract/classes.test.ts",
  "test/contract/hostile-input.test.ts",
  "test/docs/snippets.test.ts",
  "test/contract/valid-extremes.test.ts",
  "test/cli/cli.test.ts",
  "test/redis/libraries.test.ts",
  "test/redis/lua-twins.test.ts",
];

/** vitest's own order, with the slowest files of each project first (`SLOW`). */
export default class SlowFirst extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const sorted = await super.sort(files);
    // Each file's place, found once: its project's first place in vitest's order (which keeps
    // each project's files together, in the projects' order), its place in SLOW (the rest after
    // them), and its own place in vitest's order, which the rest of each project keeps.
    const projectAt = new Map<unknown, number>();
    const key = new Map<TestSpecification, [number, number, number]>();
    for (const [i, file] of sorted.entries()) {
      if (!projectAt.has(file.project)) projectAt.set(file.project, i);
      const slow = SLOW.findIndex((path) => file.moduleId.endsWith(path));
      key.set(file, [projectAt.get(file.project)!, slow < 0 ? SLOW.length : slow, i]);
    }
    return [...sorted].sort((a, b) => {
      const [x, y] = [key.get(a)!, key.get(b)!];
      return x[0] - y[0] || x[1] - y[1] || x[2] - y[2];
    });
  }
}
