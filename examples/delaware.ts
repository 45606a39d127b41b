/**
 * Seed 000 — the Delaware fleet. Twelve workers poll a corporate registry that tolerates 8
 * simultaneous connections and blocks the whole origin for a while when a ninth arrives (the
 * March 1 surge). A fleet-wide semaphore holds them to 8 permits; a worker that cannot get a
 * permit within its acquire budget defers the entity instead of forcing the cap, and deferred
 * entities are polled after the main sweep.
 *
 * Every tenth entity has a filing deadline. Deferred once, it goes to a small priority channel:
 * a traffic class of the same semaphore (`priority`, a quarter of the permits, guaranteed when
 * it has work and lent to the sweep when it has none), taken before the sweep's next entity and
 * with a longer acquire budget. The summary prints each class.
 *
 * In memory the twelve workers are async workers in this one process, sharing one in-memory
 * semaphore. With REDIS_URL set they are twelve child processes (`fork`), each with its own Redis
 * connection, sharing the Redis semaphore: the cap holds across processes, and a worker that
 * dies holding a permit gives it back when its lease runs out.
 *
 * When Redis is down, the Redis semaphore fails closed (the default, onBackendError:
 * "fail-closed"): admit rejects with BackendUnavailableError within commandTimeoutMs and the
 * request is not sent. The worker defers the entity and backs off (see delaware-worker.ts).
 *
 * Fails (exit 1) when the provider saw more than its cap at once, answered any 429, or an entity
 * was not polled.
 */
import { type ChildProcess, fork } from "node:child_process";
import { fileURLToPath } from "node:url";
import { Gate } from "floodgate";
import { startChart, writeChart } from "./chart.js";
import {
  deadline,
  exampleCommand,
  msText,
  newPrefix,
  openBackend,
  parseFlags,
  perSec,
  progress,
  quantile,
  secs,
  where,
} from "./common.js";
import {
  type ChildArgs,
  type EntityClass,
  entityClasses,
  type Job,
  type JobSource,
  pollWorker,
  type Report,
  SEMAPHORE,
} from "./delaware-worker.js";
import { startProvider } from "./provider.js";

export const about =
  "12 workers (processes on Redis) share 8 permits against a registry that blocks above 8; a priority class for deadlines";

/** Every tenth entity has a filing deadline. */
const critical = (id: string) => Number(id.slice(3)) % 10 === 0;

const COMMAND = exampleCommand(
  "delaware",
  about,
  {
    entities: { type: "int", default: 240, small: 60, help: "entities to poll" },
    workers: { type: "int", default: 12, help: "workers" },
    permits: { type: "int", default: 8, help: "fleet-wide permits" },
    cap: { type: "int", default: 8, help: "connections the registry tolerates" },
    "service-ms": {
      type: "int",
      default: 80,
      min: 0,
      help: "registry answer time, plus up to half of it at random",
    },
    "acquire-timeout-ms": {
      type: "int",
      default: 60,
      min: 0,
      help: "longest wait for a permit before the entity is deferred",
    },
    "lease-ms": {
      type: "int",
      default: 15_000,
      min: 100,
      help: "permit lease; a dead worker's permit returns after it",
    },
  },
  ["REDIS_URL=redis://host:port runs the workers as processes sharing a Redis semaphore."],
);

/** Per class: polls done, deferrals, and the permit waits of the polls done. */
interface ClassFigures {
  polled: number;
  deferred: number;
  waits: number[];
}

/** The entities still to poll: deadline-critical ones deferred once first, then the main sweep, then what was deferred. */
class EntityQueue implements JobSource {
  readonly pending: string[];
  readonly deferred: string[] = [];
  /** Deadline-critical entities that were deferred: polled next, through the priority class. */
  readonly urgent: string[] = [];
  readonly byClass: Record<EntityClass, ClassFigures> = {
    sweep: { polled: 0, deferred: 0, waits: [] },
    priority: { polled: 0, deferred: 0, waits: [] },
  };
  outstanding = 0;
  done = 0;
  ok = 0;
  rejected = 0;
  failed = 0;
  deferrals = 0;
  deferredForBackend = 0;
  /** Deferrals of polls whose permit ran out under way (their request aborted; polled again). */
  deferredForLease = 0;
  stopped = false;
  /** When the last entity was polled (performance.now()). */
  finishedAt = 0;
  readonly failures: string[] = [];
  #waiters: (() => void)[] = [];

  constructor(ids: string[]) {
    this.pending = ids;
  }

  async next(): Promise<Job | undefined> {
    for (;;) {
      if (this.stopped) return undefined;
      const urgent = this.urgent.shift();
      if (urgent !== undefined) {
        this.outstanding++;
        return { id: urgent, cls: "priority" };
      }
      const id = this.pending.shift() ?? this.deferred.shift();
      if (id !== undefined) {
        this.outstanding++;
        return { id, cls: "sweep" };
      }
      // Nothing queued, but entities out with workers may still come back deferred.
      if (this.outstanding === 0) return undefined;
      await new Promise<void>((resolve) => this.#waiters.push(resolve));
    }
  }

  report(r: Report): void {
    this.outstanding--;
    if (r.type === "deferred") {
      this.deferrals++;
      this.byClass[r.cls].deferred++;
      if (r.reason === "backend") this.deferredForBackend++;
      if (r.reason === "lease") this.deferredForLease++;
      // A deadline-critical entity goes to the priority channel; anything else waits for the sweep's end.
      if (critical(r.id)) this.urgent.push(r.id);
      else this.deferred.push(r.id);
    } else {
      this.done++;
      if (r.type === "result") {
        this.byClass[r.cls].polled++;
        this.byClass[r.cls].waits.push(r.waitedMs);
      }
      if (r.type === "failed") {
        this.failed++;
        if (this.failures.length < 3) this.failures.push(`${r.id}: ${r.message}`);
      } else if (r.status === 200) this.ok++;
      else this.rejected++;
    }
    if (this.pending.length + this.deferred.length + this.urgent.length === 0 && this.outstanding === 0) {
      this.finishedAt = performance.now();
    }
    this.#wake();
  }

  /** A worker went away holding `job`: put it back. */
  requeue(job: Job): void {
    this.outstanding--;
    if (job.cls === "priority") this.urgent.unshift(job.id);
    else this.pending.unshift(job.id);
    this.#wake();
  }

  stop(): void {
    this.stopped = true;
    this.#wake();
  }

  #wake(): void {
    for (const w of this.#waiters.splice(0)) w();
  }
}

export async function main(argv: string[]): Promise<number> {
  const f = parseFlags(COMMAND, argv);
  if (!f) return 0;
  const { entities, workers, permits, cap, "service-ms": serviceMs } = f;
  const { "acquire-timeout-ms": acquireTimeoutMs, "lease-ms": leaseMs } = f;
  const backoffMs = Math.max(20, serviceMs);

  const provider = await startProvider({ cap, serviceMs, serviceJitterMs: serviceMs / 2, blockMs: 2000 });
  const handle = await openBackend(newPrefix("delaware"));
  const onRedis = handle.mode === "redis";
  const fleet = onRedis
    ? `${workers} worker processes share one Redis semaphore`
    : `${workers} async workers in one process share one in-memory semaphore`;
  process.stderr.write(
    `delaware: ${where(handle)}; ${fleet}; ${permits} permits; registry tolerates ${cap} connections, ` +
      `blocks itself 2 s above that\n`,
  );

  const chart = startChart(f.chart, {
    title: `delaware [${handle.mode}]: ${workers} workers, ${permits} permits, cap ${cap}`,
    cap,
  })?.watchProvider(provider);

  const queue = new EntityQueue(Array.from({ length: entities }, (_, i) => `DE-${5_000_000 + i}`));
  const idealMs = (entities / Math.min(permits, cap)) * serviceMs * 1.25;
  const limit = deadline("delaware", Math.max(30_000, 10 * idealMs));
  const stop = limit.signal;
  stop.addEventListener("abort", () => queue.stop(), { once: true });

  let started = performance.now();
  const ticker = progress(() => {
    const p = provider.stats();
    return (
      `${String(queue.done).padStart(String(entities).length)}/${entities} polled · deferred ${queue.deferrals}` +
      ` · provider in flight ${p.inFlight} (peak ${p.peak}/${cap}) · 429s ${p.rejected429}` +
      ` · ${secs(performance.now() - started)}`
    );
  });

  let permitWaitMs = 0;
  let timedOut = 0;
  let crashed = 0;
  if (!onRedis) {
    const gate = new Gate(
      [handle.backend.semaphore(SEMAPHORE, { limit: permits, leaseMs, classes: entityClasses(permits) })],
      { name: "delaware" },
    );
    chart?.watch(gate).start();
    started = performance.now();
    await Promise.all(
      Array.from({ length: workers }, (_, worker) =>
        pollWorker(gate, queue, { worker, providerUrl: provider.url, acquireTimeoutMs, backoffMs, stop }),
      ),
    );
    const s = gate.snapshot();
    permitWaitMs = s.permitWaitMs;
    timedOut = s.timedOut;
    await gate.close();
  } else {
    const script = fileURLToPath(new URL("./delaware-worker.ts", import.meta.url));
    const children: ChildProcess[] = [];
    const exited: Promise<void>[] = [];
    const ready: Promise<void>[] = [];
    for (let worker = 0; worker < workers; worker++) {
      const args: ChildArgs = {
        worker,
        providerUrl: provider.url,
        redisUrl: handle.url!,
        prefix: handle.prefix,
        permits,
        leaseMs,
        acquireTimeoutMs,
        backoffMs,
      };
      const child = fork(script, [JSON.stringify(args)], {
        execArgv: ["--import", "tsx"],
        stdio: ["ignore", "inherit", "inherit", "ipc"],
      });
      children.push(child);
      let holding: Job | undefined;
      ready.push(
        new Promise((resolve) => {
          child.on(
            "message",
            (m: { type: string; snapshot?: { permitWaitMs: number; timedOut: number } }) => {
              if (m.type === "ready") resolve();
              else if (m.type === "next") {
                void queue.next().then((job) => {
                  holding = job;
                  if (child.connected) child.send({ type: "job", job: job ?? null });
                  else if (job !== undefined) queue.requeue(job);
                });
              } else if (m.type === "done") {
                permitWaitMs += m.snapshot?.permitWaitMs ?? 0;
                timedOut += m.snapshot?.timedOut ?? 0;
              } else {
                holding = undefined;
                queue.report(m as unknown as Report);
              }
            },
          );
        }),
      );
      exited.push(
        new Promise((resolve) => {
          child.on("exit", (code) => {
            if (code !== 0) crashed++;
            // A worker that died holding an entity: poll it again elsewhere. (Its permit comes back
            // when its Redis lease runs out.)
            if (holding !== undefined) queue.requeue(holding);
            holding = undefined;
            resolve();
          });
        }),
      );
    }
    const killAll = () => {
      for (const c of children) if (c.exitCode === null) c.kill("SIGTERM");
    };
    stop.addEventListener("abort", killAll, { once: true });
    const forked = performance.now();
    await Promise.race([Promise.all(ready), new Promise((r) => stop.addEventListener("abort", r))]);
    process.stderr.write(
      `delaware: ${workers} worker processes connected in ${secs(performance.now() - forked)}\n`,
    );
    started = performance.now();
    chart?.start(); // the run starts now; the workers' stages are in their own processes
    for (const c of children) if (c.connected) c.send({ type: "go" });
    await Promise.all(exited);
  }
  const elapsedMs = (queue.finishedAt || performance.now()) - started;
  limit.clear();
  ticker.stop();
  await writeChart(chart);

  const p = provider.stats();
  await provider.close();
  await handle.close(true);

  const failures: string[] = [];
  if (p.peak > cap) failures.push(`provider saw ${p.peak} at once, above its cap of ${cap}`);
  if (p.rejected429 > 0) failures.push(`${p.rejected429} requests answered 429`);
  if (queue.ok < entities) failures.push(`${entities - queue.ok} entities not polled`);
  if (queue.failed > 0) failures.push(`${queue.failed} polls failed (${queue.failures.join("; ")})`);
  if (crashed > 0) failures.push(`${crashed} worker processes exited with an error`);
  if (stop.aborted) failures.push((stop.reason as Error).message);
  const classLine = (cls: EntityClass) => {
    const c = queue.byClass[cls];
    const share = entityClasses(permits)[cls].share;
    return (
      `${cls} (share ${share} of ${permits}) ${c.polled} polled, ${c.deferred} deferred,` +
      ` permit wait p95 ${msText(quantile(c.waits, 0.95))}`
    );
  };

  process.stdout.write(
    `delaware [${onRedis ? "redis" : "memory"}; ${fleet}]: ${queue.ok}/${entities} entities in ${secs(elapsedMs)}` +
      ` (${perSec(queue.ok, elapsedMs)}) · provider peak ${p.peak}/${cap} · 429s ${p.rejected429}` +
      ` · sheds 0 · deferred ${queue.deferrals} on a ${acquireTimeoutMs} ms acquire timeout, none forced` +
      (queue.deferredForBackend > 0 ? ` (${queue.deferredForBackend} with Redis unavailable)` : "") +
      (queue.deferredForLease > 0 ? ` (${queue.deferredForLease} after a permit ran out under way)` : "") +
      ` · ${failures.length === 0 ? "OK" : `FAILED: ${failures.join("; ")}`}\n` +
      `  permits: ${permits} shared by ${workers} workers · permit wait ${secs(permitWaitMs)} in total` +
      ` · ${timedOut} waits timed out · registry answers ${serviceMs}–${Math.round(serviceMs * 1.5)} ms\n` +
      `  classes: ${classLine("sweep")} · ${classLine("priority")}` +
      ` (deadline entities deferred once go through priority)\n`,
  );
  return failures.length === 0 ? 0 : 1;
}
