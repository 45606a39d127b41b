/**
 * One Delaware poll worker: takes an entity from its job source, waits for a fleet-wide permit
 * of the entity's class (at most `acquireTimeoutMs`), polls the registry, reports the result. A
 * permit that does not come in time is never forced: the entity is handed back (deferred) and
 * the worker steps aside for a moment before it takes the next one.
 *
 * `examples/delaware.ts` runs twelve of these as async workers in its own process (memory), or
 * forks this file twelve times (Redis): each child then connects to Redis itself and shares the
 * Redis semaphore with the others. A child talks to the parent over the IPC channel:
 *
 *   child → parent  {type:"ready"} · {type:"next"} · a Report · {type:"done", snapshot}
 *   parent → child  {type:"go"} · {type:"job", job: Job | null}
 */
import { pathToFileURL } from "node:url";
import { Gate, isFloodgateError, type Snapshot } from "floodgate";
import { redis } from "floodgate/redis";
import { connectRedis, sleep } from "./common.js";

/**
 * The traffic classes of the fleet's permits: the main sweep, and a small priority channel for
 * deadline-critical entities that were deferred once. The channel is guaranteed its share when
 * it has work and lends it to the sweep when it has none.
 */
export type EntityClass = "sweep" | "priority";

/** The classes of the fleet-wide semaphore with `permits` permits: a quarter (at least 1) for the priority channel. */
export function entityClasses(permits: number) {
  const priority = Math.max(1, Math.floor(permits / 4));
  return {
    sweep: { share: Math.max(1, permits - priority) },
    priority: { share: priority, priority: 1 },
  };
}

/** One entity to poll, and the class its poll draws on. */
export interface Job {
  id: string;
  cls: EntityClass;
}

/** What a worker tells the job source about one entity. */
export type Report =
  | {
      type: "result";
      id: string;
      cls: EntityClass;
      worker: number;
      status: number;
      ms: number;
      waitedMs: number;
    }
  | {
      type: "deferred";
      id: string;
      cls: EntityClass;
      worker: number;
      reason: "timeout" | "backend" | "lease";
    }
  | { type: "failed"; id: string; cls: EntityClass; worker: number; message: string };

/** Where a worker gets entities and sends what became of them. */
export interface JobSource {
  /** The next entity, or `undefined` when there is none left for anyone. */
  next(): Promise<Job | undefined>;
  report(report: Report): void;
}

export interface WorkerOptions {
  worker: number;
  providerUrl: string;
  /** Longest wait for a permit; then the entity is deferred. A priority poll waits four times as long. */
  acquireTimeoutMs: number;
  /** After a deferral the worker steps aside for up to this long (jittered). */
  backoffMs: number;
  /** Stops the worker: the wait, the call in flight and the loop. */
  stop: AbortSignal;
}

/** Poll entities until the source has none left or `stop` aborts. */
export async function pollWorker(gate: Gate, source: JobSource, o: WorkerOptions): Promise<void> {
  while (!o.stop.aborted) {
    const job = await source.next();
    if (job === undefined) return;
    const { id, cls } = job;
    const started = performance.now();
    let waitedMs = 0;
    try {
      const { status } = await gate.run(
        async (ticket) => {
          waitedMs = performance.now() - started;
          // ticket.signal aborts if the permit is lost (a Redis lease that ran out): a call that no
          // longer holds its permit must not go on counting against the portal's cap.
          const res = await fetch(`${o.providerUrl}/entities/${id}/franchise-status`, {
            signal: AbortSignal.any([ticket.signal, o.stop]),
          });
          await res.arrayBuffer();
          return { status: res.status };
        },
        {
          class: cls,
          timeoutMs: cls === "priority" ? 4 * o.acquireTimeoutMs : o.acquireTimeoutMs,
          signal: o.stop,
        },
      );
      source.report({
        type: "result",
        id,
        cls,
        worker: o.worker,
        status,
        ms: performance.now() - started,
        waitedMs,
      });
    } catch (error) {
      if (o.stop.aborted) return;
      if (isFloodgateError(error, "ADMIT_TIMEOUT")) {
        // The fleet stayed at its cap for the whole acquire budget: defer this entity rather than
        // force the cap, and step aside so the workers holding permits drain the surge.
        source.report({ type: "deferred", id, cls, worker: o.worker, reason: "timeout" });
        await sleep(o.backoffMs * (0.5 + Math.random()), o.stop).catch(() => {});
      } else if (isFloodgateError(error, "BACKEND_UNAVAILABLE")) {
        // Redis could not be reached. The Redis semaphore fails closed by default
        // (onBackendError: "fail-closed"): a worker that cannot confirm a free permit does not
        // send the request, because assuming a permit during an outage is exactly how a fleet
        // overshoots the portal's cap and gets its origin blocked. Defer and back off longer.
        source.report({ type: "deferred", id, cls, worker: o.worker, reason: "backend" });
        await sleep(4 * o.backoffMs * (0.5 + Math.random()), o.stop).catch(() => {});
      } else if (isFloodgateError(error, "LEASE_LOST")) {
        // The permit ran out while the poll was under way (this process stalled past its lease,
        // or past a grant's claim window on a starved machine): ticket.signal aborted the request,
        // so it no longer counts against the portal's cap. The poll did not complete: defer the
        // entity, to be polled again with a permit of its own.
        source.report({ type: "deferred", id, cls, worker: o.worker, reason: "lease" });
      } else {
        source.report({ type: "failed", id, cls, worker: o.worker, message: (error as Error).message });
      }
    }
  }
}

/** Arguments the parent hands a forked worker (as one JSON argument). */
export interface ChildArgs {
  worker: number;
  providerUrl: string;
  redisUrl: string;
  prefix: string;
  permits: number;
  leaseMs: number;
  acquireTimeoutMs: number;
  backoffMs: number;
}

/** Semaphore name every worker uses: the cap is only global if the name (and prefix) is shared. */
export const SEMAPHORE = "de-inflight";

async function child(args: ChildArgs): Promise<void> {
  const send = (message: object) => process.send?.(message);
  const stop = new AbortController();
  // The parent went away: stop at once, leave nothing behind (the lease would expire anyway).
  process.on("disconnect", () => {
    stop.abort(new Error("parent went away"));
    setTimeout(() => process.exit(1), 2000).unref();
  });
  process.on("SIGTERM", () => stop.abort(new Error("terminated")));

  const client = await connectRedis(args.redisUrl);
  const backend = redis(client, { prefix: args.prefix });
  const gate = new Gate(
    [
      backend.semaphore(SEMAPHORE, {
        limit: args.permits,
        leaseMs: args.leaseMs,
        classes: entityClasses(args.permits),
      }),
    ],
    { name: `worker-${args.worker}` },
  );

  let answer: ((job: Job | undefined) => void) | undefined;
  const go = new Promise<void>((resolve) => {
    process.on("message", (m: { type: string; job?: Job | null }) => {
      if (m.type === "go") resolve();
      else if (m.type === "job" && answer) {
        const a = answer;
        answer = undefined;
        a(m.job ?? undefined);
      }
    });
  });
  const source: JobSource = {
    next: () =>
      new Promise((resolve) => {
        if (stop.signal.aborted) return resolve(undefined);
        answer = resolve;
        send({ type: "next" });
      }),
    report: (r) => send(r),
  };

  send({ type: "ready" });
  await go;
  await pollWorker(gate, source, {
    worker: args.worker,
    providerUrl: args.providerUrl,
    acquireTimeoutMs: args.acquireTimeoutMs,
    backoffMs: args.backoffMs,
    stop: stop.signal,
  });
  const snapshot: Snapshot = gate.snapshot();
  await gate.close();
  await backend.close();
  await client.quit().catch(() => client.disconnect());
  send({ type: "done", snapshot: { permitWaitMs: snapshot.permitWaitMs, timedOut: snapshot.timedOut } });
  process.disconnect?.();
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) {
  const args = JSON.parse(process.argv[2] ?? "{}") as ChildArgs;
  child(args).catch((error: unknown) => {
    process.stderr.write(`delaware worker ${args.worker}: ${(error as Error).stack ?? error}\n`);
    process.exitCode = 1;
    process.disconnect?.();
  });
}
