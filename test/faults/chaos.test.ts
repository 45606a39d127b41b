import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  type ChaosReport,
  type ChaosSettings,
  countsOff,
  DEFAULTS,
  formatReport,
  MIN_CHURN_RATIO,
  PHASES,
  type PhaseFigures,
  runChaos,
  STALL_BOUND_MS,
  stallBound,
} from "../../soak/chaos.js";
import { startPersistentRedis } from "./harness.js";

/**
 * Length of each phase: CHAOS_SECONDS, 3 s by default (three runs of seven, five and seven
 * phases: about two minutes in all, with each run's start and end; two runs at 3 s kept kill
 * churn at 84–102% of calm against a bound of 70%).
 */
const PHASE_MS = Number(process.env.CHAOS_SECONDS ?? 3) * 1000;

/** `{ phase: value }` for every phase and the whole run. */
function byPhase(report: ChaosReport, value: (p: PhaseFigures) => number): Record<string, number> {
  return Object.fromEntries([...report.phases, report.whole].map((p) => [p.name, Math.round(value(p))]));
}

function zeros(report: ChaosReport): Record<string, number> {
  return byPhase(report, () => 0);
}

/** Breaches by phase, but those of a holder frozen after its signal check. */
const overCap = (report: ChaosReport) => byPhase(report, (p) => p.breaches - p.causes.frozenHolder);
/** Calls sent by phase on a grant that reached a waiter while it was frozen. */
const staleGrants = (report: ChaosReport) => byPhase(report, (p) => p.staleGrantSends);
/** The longest stall of each phase that passed its bound (0 for the others): see stallBound. */
const overStall = (report: ChaosReport) =>
  byPhase(report, (p) => (p.stallMs > stallBound(p) ? p.stallMs : 0));
/** What Redis holds once every worker has stopped cleanly. */
const NOTHING_LEFT = { keys: [], liveLeases: 0, expiredLeases: 0, waiters: 0, used: 0, classesUsed: 0 };

/**
 * One chaos run (soak/chaos.ts) on a redis-server of its own, in `beforeAll`, its figures printed
 * under `label`; returns the report's getter for the checks.
 */
function useChaosRun(label: string, settings: Omit<ChaosSettings, "server" | "phaseMs">): () => ChaosReport {
  let redis: Awaited<ReturnType<typeof startPersistentRedis>> | undefined;
  let report: ChaosReport | undefined;
  const phases = settings.phases ?? PHASES;
  beforeAll(
    async () => {
      redis = await startPersistentRedis();
      report = await runChaos({ server: redis.server, phaseMs: PHASE_MS, ...settings });
      console.log(`${label}, ${PHASE_MS / 1000} s per phase:\n${formatReport(report)}`);
    },
    PHASE_MS * phases.length + 90_000,
  );
  afterAll(async () => {
    await redis?.remove();
  });
  return () => report!;
}

/** A run through every phase: each worker stopped cleanly, each fault injected, the limit reached. */
function itInjectsEveryFault(run: () => ChaosReport): void {
  it("runs every worker to a clean stop and injects every fault of every phase", () => {
    const report = run();
    expect(report.problems).toEqual([]);
    const faulted = report.phases.filter((p) => p.name !== "calm");
    expect(faulted.map((p) => p.name)).toEqual(PHASES.filter((n) => n !== "calm"));
    for (const p of faulted) expect(p.faults, p.name).toBeGreaterThan(0);
    expect(new Set(report.freezes.map((f) => f.kind))).toEqual(new Set(["holder", "waiter"]));
    // The callers did contend: the provider had the whole limit at once.
    expect(report.phases[0]!.peak).toBeGreaterThanOrEqual(DEFAULTS.limit);
  });
}

/** A run's throughput checks through every phase: the churn bound and the stall bound. */
function itKeepsGoing(run: () => ChaosReport): void {
  it(`keeps at least ${MIN_CHURN_RATIO * 100}% of the calm throughput while a worker is killed every ${DEFAULTS.killEveryMs} ms`, () => {
    expect(run().ratio).toBeGreaterThanOrEqual(MIN_CHURN_RATIO);
  });

  it(`never goes ${STALL_BOUND_MS} ms without a successful call while callers wait, beyond Redis's own downtime`, () => {
    expect(overStall(run())).toEqual(zeros(run()));
  });
}

/**
 * Ten worker processes × three callers share a Redis semaphore of limit 6 (leaseMs 1500; pollMs,
 * livenessMs and claimMs at their defaults) in front of a provider that answers 429 to any
 * request above 6, through seven phases:
 * calm, SIGKILL churn, holders frozen (SIGSTOP) past their lease, waiters frozen past the grant
 * made to them, CLIENT KILL, SCRIPT FLUSH, and redis-server restarted with its append-only file.
 * One run (soak/chaos.ts) in `beforeAll` prints the figures; each `it` checks one bound.
 */
describe("a Redis semaphore fleet under crashes, freezes and Redis faults", () => {
  const run = useChaosRun("chaos", {});

  itInjectsEveryFault(run);

  it("sees every breach the provider counts", () => {
    expect(run().tapBreaches).toBe(run().providerBreaches);
  });

  it("keeps the provider at or under its cap in every phase, save a holder frozen after its signal check", () => {
    expect(overCap(run())).toEqual(zeros(run()));
  });

  it("sends no call on a grant that reached a waiter while it was frozen", () => {
    expect(staleGrants(run())).toEqual(zeros(run()));
  });

  itKeepsGoing(run);

  it("keeps the stage's count the costs of the leases held, read every 100 ms through every phase", () => {
    // (A count off is also one of the problems above; this says how many reads there were.)
    expect(run().counts.reads).toBeGreaterThan(PHASE_MS / 100);
    expect(run().counts.off).toBe(0);
  });

  it("leaves no lease, waiter or key in Redis once the workers have stopped", () => {
    expect(run().left).toEqual(NOTHING_LEFT);
  });
});

/**
 * The same fleet with traffic classes (interactive: share 2, priority 1; bulk: share 1; each
 * worker's callers taking turns), through the phases that take processes and scripts away
 * under it: the class counts kept in Redis must come back to nothing, and the cap must hold as
 * without classes.
 */
describe("a Redis semaphore fleet with traffic classes under crashes, freezes and Redis faults", () => {
  const phases = ["calm", "kill churn", "frozen holders", "frozen waiters", "script flush"] as const;
  const run = useChaosRun("chaos with classes", { phases, classes: true });

  it("runs every worker to a clean stop and injects every fault", () => {
    const report = run();
    expect(report.problems).toEqual([]);
    for (const p of report.phases.filter((p) => p.name !== "calm"))
      expect(p.faults, p.name).toBeGreaterThan(0);
    expect(report.phases[0]!.peak).toBeGreaterThanOrEqual(DEFAULTS.limit);
  });

  it("keeps the provider at or under its cap in every phase, save a holder frozen after its signal check", () => {
    expect(overCap(run())).toEqual(zeros(run()));
    expect(staleGrants(run())).toEqual(zeros(run()));
  });

  it(`never goes ${STALL_BOUND_MS} ms without a successful call while callers wait, beyond Redis's own downtime`, () => {
    expect(overStall(run())).toEqual(zeros(run()));
  });

  it("keeps the stage's count, and each class's, the costs of the leases held, read every 100 ms", () => {
    expect(run().counts.reads).toBeGreaterThan(PHASE_MS / 100);
    expect(run().counts.off).toBe(0);
  });

  it("leaves no lease, waiter, class count or key in Redis once the workers have stopped", () => {
    expect(run().left).toEqual(NOTHING_LEFT);
  });
});

/**
 * The same fleet through a fused gate (test/redis/fixtures/chaos-gate.ts: a token bucket that binds now
 * and then, the semaphore, an AIMD limiter of the same limit, an interval gate that spaces
 * nothing), decided in one script call per admission and per release, through every phase: the
 * cap, the stall bound and the churn bound hold as for the semaphore alone, both permit stages'
 * counts stay the leases they hold, and no caller holds a lease of either while it waits in the
 * gate's line.
 */
describe("a fused Redis gate fleet under crashes, freezes and Redis faults", () => {
  const run = useChaosRun("chaos through a fused gate", { gate: true });

  itInjectsEveryFault(run);

  it("keeps the provider at or under its cap in every phase, save a holder frozen after its signal check", () => {
    expect(run().tapBreaches).toBe(run().providerBreaches);
    expect(overCap(run())).toEqual(zeros(run()));
    expect(staleGrants(run())).toEqual(zeros(run()));
  });

  itKeepsGoing(run);

  it("keeps both permit stages' counts the costs of their leases, with nobody in the gate's line holding one", () => {
    expect(run().counts.reads).toBeGreaterThan(PHASE_MS / 100);
    // The line was seen with callers in it: the check had something to look at.
    expect(run().counts.lineSeen).toBeGreaterThan(PHASE_MS / 1_000);
    expect(run().counts.off).toBe(0);
  });

  it("leaves no lease, waiter or key in Redis once the workers have stopped", () => {
    expect(run().left).toEqual(NOTHING_LEFT);
  });
});

describe("the chaos run's check of a stage's counts", () => {
  it("finds a count above the leases held, a class count off, and a member both holding and in line (its stage's or a fused gate's)", () => {
    expect(countsOff({ used: "2", u0: "1", u1: "1" }, ["a-1~0:1", "b-1~1:1"], ["c-1~0:1"])).toBe("");
    expect(countsOff({ used: "3" }, ["a-1:1", "b-1:2"], [])).toBe("");
    expect(countsOff({ used: "3", u0: "2", u1: "1" }, ["a-1~0:1", "b-1~1:1"], [])).toBe(
      "used 3, leases' costs 2; u0 2, class 0's leases' costs 1",
    );
    expect(countsOff({ used: "1" }, ["a-1:1"], ["a-1:1"])).toBe("holding and in line: a-1:1");
    expect(countsOff({}, [], [])).toBe("");
    // A fused call's leases are named by its member (a later try's with ".<try>" after it).
    expect(countsOff({ used: "1" }, ["g-7.2"], [], ["g-7"], ["g-8"])).toBe("");
    expect(countsOff({ used: "1" }, ["g-7.2"], [], ["g-7"], ["g-7"])).toBe(
      "holding while in the gate's line: g-7.2",
    );
  });
});
