/**
 * The child side of a benchmark's worker process (the parent side is `BenchWorker` in
 * worker.ts): a client of the Redis the parent names on the command line, the clock shared by
 * every process of the machine, and the message loop.
 */
import { Redis } from "ioredis";

/** Monotonic milliseconds (process.hrtime), comparable across the processes of one machine. */
export const nowMs = () => Number(process.hrtime.bigint()) / 1e6;

export const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** A client of the Redis URL given as the first argument, configured as floodgate's README asks, once ready. */
export async function workerClient(): Promise<Redis> {
  const [url] = process.argv.slice(2) as [string];
  const client = new Redis(url, { enableOfflineQueue: false, maxRetriesPerRequest: 1 });
  client.on("error", () => {});
  await new Promise((r) => client.once("ready", r));
  return client;
}

/**
 * Answer each `run` message from the parent with what `run` resolves to (or `error`), and say
 * `ready`. On `exit`, `close` runs and the process leaves; it also leaves when the parent goes.
 */
export function serve<M extends { kind: "run" }>(
  run: (m: M) => Promise<{ kind: string }>,
  close: () => Promise<unknown>,
): void {
  process.on("message", (m: M | { kind: "exit" }) => {
    if (m.kind === "exit") {
      void close().finally(() => process.exit(0));
      return;
    }
    run(m as M).then(
      (r) => process.send!(r),
      (error: unknown) => process.send!({ kind: "error", message: String(error) }),
    );
  });
  process.on("disconnect", () => process.exit(0));
  process.send!({ kind: "ready" });
}
