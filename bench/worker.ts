/** A worker process of a benchmark, spoken to over IPC: its replies in order, and its stop. */
import { type ChildProcess, type ForkOptions, fork } from "node:child_process";
import { once } from "node:events";
import { mkdirSync, rmSync } from "node:fs";
import { basename } from "node:path";
import { fileURLToPath } from "node:url";
import { buildSync } from "esbuild";

const ROOT = fileURLToPath(new URL("..", import.meta.url));

/** Each worker script bundled once per run, by its path: the file that runs it. */
const bundled = new Map<string, string>();

/**
 * `script` (TypeScript) as one JavaScript file with the library in it (its sources, or with
 * `--built` the built package), packages left to Node: a process starts from it in about half
 * the CPU it takes through tsx's loader, which resolves and compiles every module it imports
 * (1.2–1.5 s a process against 0.6–0.7 s here, and a fleet starts twelve).
 */
function bundle(script: URL): string {
  const path = fileURLToPath(script);
  let out = bundled.get(path);
  if (out === undefined) {
    // (Two levels below the project, as dist/redis/ is: the library finds lua/ at ../../lua.)
    const dir = `${ROOT}.cache/bench-${process.pid}`;
    if (bundled.size === 0) {
      mkdirSync(dir, { recursive: true });
      process.once("exit", () => rmSync(dir, { recursive: true, force: true }));
    }
    out = `${dir}/${basename(path, ".ts")}.mjs`;
    buildSync({
      entryPoints: [path],
      outfile: out,
      bundle: true,
      platform: "node",
      format: "esm",
      target: "node20",
      packages: "external",
      sourcemap: "inline",
      // The build's tsconfig maps no paths: "floodgate" is then the package itself (dist/).
      tsconfig: process.env.TSX_TSCONFIG_PATH ?? `${ROOT}tsconfig.json`,
      logLevel: "warning",
    });
    bundled.set(path, out);
  }
  return out;
}

/** Fork the TypeScript `script` (bundled: see `bundle`) with `args`, as `fork` does. */
export function forkScript(script: URL, args: readonly string[], options: ForkOptions): ChildProcess {
  return fork(bundle(script), args, {
    ...options,
    execArgv: ["--enable-source-maps", ...(options.execArgv ?? [])],
  });
}

/** A reply of a worker: its own kinds, or `error` (thrown by `next`). */
type Reply = { kind: string } | { kind: "error"; message: string };

/** One forked worker (`script`, bundled: see `forkScript`) and the replies it has sent, taken in order. */
export class BenchWorker<R extends { kind: string }> {
  readonly child: ChildProcess;
  readonly #replies: Reply[] = [];
  #notify: (() => void) | undefined;

  constructor(
    script: URL,
    args: string[],
    readonly label: string,
  ) {
    this.child = forkScript(script, args, { stdio: ["ignore", "inherit", "inherit", "ipc"] });
    this.child.on("message", (m: Reply) => {
      this.#replies.push(m);
      this.#notify?.();
    });
  }

  /** The next reply; throws the worker's error, or when none comes within `timeoutMs` or it exits. */
  async next(timeoutMs: number): Promise<R> {
    const deadline = Date.now() + timeoutMs;
    while (this.#replies.length === 0) {
      if (Date.now() > deadline || this.child.exitCode !== null)
        throw new Error(`${this.label} did not answer`);
      await new Promise<void>((resolve) => {
        this.#notify = resolve;
        setTimeout(resolve, 200);
      });
    }
    const r = this.#replies.shift()!;
    if (r.kind === "error") throw new Error(`${this.label}: ${(r as { message: string }).message}`);
    return r as R;
  }
}

/** Tell every worker to exit, and wait until each has. */
export async function stopWorkers(workers: readonly BenchWorker<{ kind: string }>[]): Promise<void> {
  for (const w of workers) if (w.child.connected) w.child.send({ kind: "exit" });
  await Promise.all(workers.map((w) => (w.child.exitCode === null ? once(w.child, "exit") : undefined)));
}
