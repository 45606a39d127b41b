/** A worker process of a benchmark, spoken to over IPC: its replies in order, and its stop. */
import { type ChildProcess, type ForkOptions, fork } from "node:child_process";
import { once } from "node:events";
import { fileURLToPath } from "node:url";
import { bundleEntry } from "../test/setup/bundle.js";

/**
 * Fork the TypeScript `script` with `args`, as `fork` does, from one bundled file (see
 * `bundleEntry`): with `--built`, the build's tsconfig leaves "floodgate" to Node, the package.
 */
export function forkScript(script: URL, args: readonly string[], options: ForkOptions): ChildProcess {
  return fork(bundleEntry(fileURLToPath(script), process.env.TSX_TSCONFIG_PATH), args, {
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
