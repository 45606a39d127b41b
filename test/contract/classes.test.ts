import fc from "fast-check";
import {
  type Backend,
  Gate,
  InvalidOptionsError,
  isFloodgateError,
  memory,
  ReclaimedError,
  type SemaphoreOptions,
  type Stage,
  type Ticket,
} from "floodgate";
import { FakeClock } from "floodgate/testing";
import { beforeEach, describe, expect, it, vi } from "vitest";
import { backends, track, useBackend } from "./backends.js";

/** Interactive and bulk on a limit of 10: guarantees 8 and 2. */
const TWO = { interactive: { share: 8, priority: 1 }, bulk: { share: 2 } };

/** Admissions of `cls` on `stage`, each tracked. */
function admits(stage: Stage, cls: string, n: number, cost = 1) {
  return Array.from({ length: n }, () => track(stage.admit({ class: cls, cost })));
}

const granted = (waits: ReturnType<typeof admits>) => waits.filter((w) => w.settled && !w.error).length;
const ticketOf = (w: { value?: Ticket }) => w.value!;

describe.each(backends)("traffic classes on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;
  let mem: Backend;
  const sem = (options: Partial<SemaphoreOptions> = {}) =>
    mem.semaphore("sem", { limit: 10, classes: TWO, ...options });

  beforeEach(() => {
    clock = new FakeClock();
    mem = backend.make(clock);
  });

  describe("the guarantee", () => {
    it("bulk saturating the limit: interactive gets each freed permit until it holds its share", async () => {
      const s = sem();
      const bulk = admits(s, "bulk", 10);
      const moreBulk = admits(s, "bulk", 5);
      await clock.flush();
      expect(granted(bulk)).toBe(10);
      const interactive = admits(s, "interactive", 9);
      await clock.flush();
      expect(granted(interactive)).toBe(0);
      for (let k = 1; k <= 10; k++) {
        await ticketOf(bulk[k - 1]!).release("success");
        await clock.flush();
        // One release per permit: interactive gains one each time up to its share of 8; bulk
        // waits meanwhile, then takes back what it needs to keep its own guarantee of 2.
        expect(granted(interactive)).toBe(Math.min(k, 8));
        expect(granted(moreBulk)).toBe(Math.max(0, k - 8));
      }
      expect(s.snapshot().classes).toMatchObject({
        interactive: { guarantee: 8, held: 8, waiting: 1 },
        bulk: { guarantee: 2, held: 2, waiting: 3 },
      });
    });

    it("bulk alone uses the whole limit, and so does interactive alone", async () => {
      for (const cls of ["bulk", "interactive"]) {
        const s = mem.semaphore(`alone-${cls}`, { limit: 10, classes: TWO });
        const waits = admits(s, cls, 11);
        await clock.flush();
        expect(granted(waits)).toBe(10);
        expect(s.snapshot()).toMatchObject({ inFlight: 10, waiting: 1 });
      }
    });

    it("a free permit goes to a class below its guarantee before a borrower that asked first", async () => {
      const s = sem();
      const bulk = admits(s, "bulk", 10);
      await clock.flush();
      const bulkLater = admits(s, "bulk", 1);
      const interactive = admits(s, "interactive", 1);
      // Both in line (on Redis, once their acquires have reached it) before the release.
      await clock.flush();
      await ticketOf(bulk[0]!).release();
      await clock.flush();
      expect(granted(interactive)).toBe(1);
      expect(granted(bulkLater)).toBe(0);
    });

    it("nothing in flight is taken back: an owner reclaims its share only as borrowed permits come back", async () => {
      const s = sem();
      const bulk = admits(s, "bulk", 10);
      await clock.flush();
      const interactive = admits(s, "interactive", 3);
      await clock.flush();
      expect(granted(interactive)).toBe(0);
      expect(bulk.every((w) => !ticketOf(w).released && !ticketOf(w).signal.aborted)).toBe(true);
    });

    it("a call of a class within its guarantee goes at once even while a borrower waits", async () => {
      const s = sem();
      const bulk = admits(s, "bulk", 8);
      await clock.flush();
      // Bulk holds 8 (6 borrowed); 2 permits are free.
      const bulkMore = admits(s, "bulk", 3);
      await clock.flush();
      expect(granted(bulkMore)).toBe(2);
      await ticketOf(bulk[0]!).release();
      await clock.flush();
      // Bulk's third waiter takes the freed permit: nobody else wants it.
      expect(granted(bulkMore)).toBe(3);
      const interactive = admits(s, "interactive", 1);
      await clock.flush();
      expect(granted(interactive)).toBe(0);
      await ticketOf(bulk[1]!).release();
      await clock.flush();
      expect(granted(interactive)).toBe(1);
    });
  });

  describe("lendable: the part of a guarantee kept free", () => {
    const keeping = { interactive: { share: 8, priority: 1, lendable: 0.5 }, bulk: { share: 2 } };

    it("bulk alone borrows only what interactive lends, and interactive then starts at once", async () => {
      const s = mem.semaphore("keep", { limit: 10, classes: keeping });
      const bulk = admits(s, "bulk", 10);
      await clock.flush();
      expect(granted(bulk)).toBe(6);
      expect(s.snapshot().classes!.interactive).toMatchObject({ guarantee: 8, kept: 4 });
      const interactive = admits(s, "interactive", 5);
      await clock.flush();
      // Four start at once on the kept permits; the fifth waits for a release, which is its own.
      expect(granted(interactive)).toBe(4);
      await ticketOf(bulk[0]!).release();
      await clock.flush();
      expect(granted(interactive)).toBe(5);
      expect(granted(bulk)).toBe(6);
    });

    it("what interactive holds of its kept part is not kept twice", async () => {
      const s = mem.semaphore("keep2", { limit: 10, classes: keeping });
      await Promise.all([s.admit({ class: "interactive" }), s.admit({ class: "interactive" })]);
      const bulk = admits(s, "bulk", 10);
      await clock.flush();
      // Interactive holds 2 of the 4 it keeps: 2 more stay free; bulk gets 10 - 2 - 2.
      expect(granted(bulk)).toBe(6);
    });

    it("refuses a lendable outside [0, 1]", () => {
      for (const lendable of [-0.1, 1.5, Number.NaN]) {
        expect(() =>
          mem.semaphore(`bad-${lendable}`, { limit: 4, classes: { a: { share: 1, lendable } } }),
        ).toThrow("classes.a.lendable must be a number in [0, 1]");
      }
    });
  });

  describe("priority among borrowers, with each guarantee as the floor", () => {
    // Three classes of 2 each on 6 permits; `idle` leaves its 2 to be borrowed.
    const three = {
      hi: { share: 1, priority: 2 },
      lo: { share: 1, priority: 0 },
      idle: { share: 1 },
    };

    it("the higher priority borrows first, whoever asked first", async () => {
      const s = mem.semaphore("p", { limit: 6, classes: three });
      // lo and hi each take their guarantee of 2.
      admits(s, "lo", 2);
      admits(s, "hi", 2);
      await clock.flush();
      const loMore = admits(s, "lo", 2);
      const hiMore = admits(s, "hi", 2);
      await clock.flush();
      // Both hold their guarantee; the 2 idle permits went to lo, which asked first...
      expect(granted(loMore)).toBe(2);
      expect(granted(hiMore)).toBe(0);
      admits(s, "hi", 1);
      const loLast = admits(s, "lo", 1);
      // ...but once freed, a borrowed permit goes to the higher priority.
      await ticketOf(loMore[0]!).release();
      await clock.flush();
      expect(granted(hiMore)).toBe(1);
      expect(granted(loLast)).toBe(0);
    });

    it("the lower priority still gets its guarantee under a flood of the higher", async () => {
      const s = mem.semaphore("p", { limit: 6, classes: three });
      const hi = admits(s, "hi", 200);
      await clock.flush();
      // hi borrowed everything while nobody else asked.
      expect(granted(hi)).toBe(6);
      const lo = admits(s, "lo", 40);
      const oldest = (of = [...hi, ...lo]) =>
        of.map((w) => w.value).find((t): t is Ticket => t !== undefined && !t.released)!;
      // Each release frees one permit. lo reclaims its guarantee of 2 with the first two...
      for (let k = 1; k <= 2; k++) {
        await oldest().release();
        await clock.flush();
        expect(s.snapshot().classes!.lo!.held).toBe(k);
      }
      // ...and then holds it whatever the flood: a freed borrowed permit goes to hi (the higher
      // priority), and one lo gives back comes straight back to lo.
      for (let round = 0; round < 60; round++) {
        await oldest(round % 3 === 0 ? lo : hi).release();
        await clock.flush();
        expect(s.snapshot().classes).toMatchObject({ lo: { held: 2 }, hi: { held: 4 } });
      }
      expect(granted(lo)).toBeGreaterThan(2);
      expect(granted(hi)).toBeGreaterThan(granted(lo));
    });
  });

  describe("costs", () => {
    it("a cost larger than its class's share goes first while the class holds less than its guarantee", async () => {
      const s = sem();
      const interactive = admits(s, "interactive", 9);
      await clock.flush();
      const big = track(s.admit({ class: "bulk", cost: 5 }));
      const interactiveMore = admits(s, "interactive", 3);
      await clock.flush();
      expect(big.settled).toBe(false);
      // Interactive holds 9 (one borrowed); bulk (owed) waits for 5 free permits, and nobody passes it.
      for (let k = 0; k < 4; k++) {
        await ticketOf(interactive[k]!).release();
        await clock.flush();
        expect(big.settled).toBe(k === 3);
        expect(granted(interactiveMore)).toBe(0);
      }
    });

    it("refuses at once a cost above its class's ceiling", async () => {
      const s = mem.semaphore("c", {
        limit: 10,
        classes: { a: { share: 1, maxShare: 0.5 }, b: { share: 1 } },
      });
      await expect(s.admit({ class: "a", cost: 6 })).rejects.toThrow(
        'semaphore "c": cost must be <= the ceiling of class "a" (5), got 6 (number); it could never be admitted',
      );
      await expect(s.admit({ class: "b", cost: 10 })).resolves.toBeDefined();
    });

    it("a class at its ceiling waits while another class borrows past it", async () => {
      const s = mem.semaphore("c", {
        limit: 10,
        classes: { a: { share: 1, maxShare: 0.6 }, b: { share: 1 } },
      });
      const a = admits(s, "a", 7);
      await clock.flush();
      expect(granted(a)).toBe(6);
      const b = admits(s, "b", 4);
      await clock.flush();
      expect(granted(b)).toBe(4);
      expect(s.snapshot().classes).toMatchObject({
        a: { inFlight: 6, ceiling: 6, waiting: 1 },
        b: { inFlight: 4 },
      });
    });

    it("a cost of 0 goes at once, past any line", async () => {
      const s = sem();
      admits(s, "bulk", 11);
      await clock.flush();
      await expect(s.admit({ class: "interactive", cost: 0 })).resolves.toBeDefined();
    });
  });

  describe("timeouts, aborts and refunds go back to the right class", () => {
    it("an owed head that times out lets the borrower behind it through", async () => {
      const s = sem();
      const bulk = admits(s, "bulk", 10);
      await clock.flush();
      const owed = track(s.admit({ class: "interactive", cost: 3, timeoutMs: 100 }));
      const borrower = admits(s, "bulk", 1);
      await ticketOf(bulk[0]!).release();
      await clock.flush();
      expect(granted(borrower)).toBe(0);
      await clock.advance(100);
      await clock.flush();
      expect(owed.error).toMatchObject({ code: "ADMIT_TIMEOUT" });
      expect(granted(borrower)).toBe(1);
      expect(s.snapshot().classes).toMatchObject({
        interactive: { inFlight: 0, waiting: 0 },
        bulk: { inFlight: 10 },
      });
    });

    it("an aborted waiter leaves its class's line; a refund gives back to its class", async () => {
      const s = sem();
      const bulk = admits(s, "bulk", 10);
      await clock.flush();
      const controller = new AbortController();
      const aborted = track(s.admit({ class: "interactive", signal: controller.signal }));
      await clock.flush();
      expect(s.snapshot().classes!.interactive!.waiting).toBe(1);
      controller.abort(new Error("stop"));
      await clock.flush();
      expect(aborted.error).toEqual(new Error("stop"));
      expect(s.snapshot().classes!.interactive!.waiting).toBe(0);
      await ticketOf(bulk[0]!).refund();
      expect(s.snapshot().classes).toMatchObject({
        bulk: { inFlight: 9, held: 9 },
        interactive: { inFlight: 0 },
      });
      expect(s.snapshot().inFlight).toBe(9);
    });

    it("closing rejects the waiters of every class", async () => {
      const s = sem();
      admits(s, "bulk", 10);
      const waits = [...admits(s, "bulk", 1), ...admits(s, "interactive", 2)];
      await clock.flush();
      await s.close();
      await clock.flush();
      expect(waits.every((w) => (w.error as { code?: string })?.code === "CLOSED")).toBe(true);
    });
  });

  it("holds the limit and every ceiling, and leaves nothing behind, under random calls", async () => {
    // (A semaphore of its own each run, on the row's backend.)
    let run = 0;
    await fc.assert(
      fc.asyncProperty(
        fc.array(
          fc.oneof(
            fc.record({
              op: fc.constant("admit" as const),
              cls: fc.constantFrom("a", "b", "c"),
              cost: fc.integer({ min: 0, max: 4 }),
            }),
            fc.record({ op: fc.constant("release" as const), at: fc.nat(30) }),
            fc.record({ op: fc.constant("abort" as const), at: fc.nat(30) }),
          ),
          { minLength: 10, maxLength: 60 },
        ),
        async (ops) => {
          const s = mem.semaphore(`f${++run}`, {
            limit: 7,
            classes: { a: { share: 3, priority: 1 }, b: { share: 2, maxShare: 0.5 }, c: { share: 1 } },
          });
          const calls: {
            w: ReturnType<typeof track<Ticket>>;
            c: AbortController;
            cls: string;
            cost: number;
          }[] = [];
          const check = () => {
            const snap = s.snapshot();
            // (A call of cost 0 holds a ticket but no permit: the limit bounds the others.)
            const costFree = calls.filter(
              (call) => call.cost === 0 && call.w.value && !call.w.value.released,
            );
            expect(snap.inFlight - costFree.length).toBeLessThanOrEqual(7);
            let sum = 0;
            let inFlight = 0;
            for (const cls of Object.values(snap.classes!)) {
              expect(cls.held).toBeLessThanOrEqual(cls.ceiling);
              sum += cls.held;
              inFlight += cls.inFlight;
            }
            expect(sum).toBeLessThanOrEqual(7);
            expect(inFlight).toBe(snap.inFlight);
            // Once things settle, the earliest waiting head of a class below its guarantee (within
            // its ceiling) is one that does not fit: an owed class is never left waiting for room
            // that is free. (Calls arrive in array order; a class's head is its first still waiting.)
            const free = 7 - sum;
            const owedHead = calls.find((call) => {
              if (call.w.settled || call.c.signal.aborted) return false;
              const k = snap.classes![call.cls]!;
              const first = calls.find((o) => o.cls === call.cls && !o.w.settled && !o.c.signal.aborted);
              return first === call && k.held < k.guarantee && k.held + call.cost <= k.ceiling;
            });
            if (owedHead) expect(owedHead.cost).toBeGreaterThan(free);
          };
          for (const op of ops) {
            if (op.op === "admit") {
              const c = new AbortController();
              calls.push({
                w: track(s.admit({ class: op.cls, cost: op.cost, signal: c.signal })),
                c,
                cls: op.cls,
                cost: op.cost,
              });
            } else {
              const call = calls[op.at % Math.max(1, calls.length)];
              if (call && op.op === "release" && call.w.value) await call.w.value.release();
              if (call && op.op === "abort") call.c.abort();
            }
            await clock.flush();
            check();
          }
          // Release everything granted until nobody waits: every call is then granted or aborted.
          for (let round = 0; round < 100 && s.snapshot().waiting + s.snapshot().inFlight > 0; round++) {
            for (const call of calls)
              if (call.w.value && !call.w.value.released) await call.w.value.release();
            await clock.flush();
            check();
          }
          expect(s.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
          expect(calls.every((call) => call.w.settled)).toBe(true);
          await s.close();
        },
      ),
      { numRuns: 60 },
    );
  });

  describe('reclaim: "signal": borrowed tickets are asked back through their signal', () => {
    /** Whether each ticket's signal aborted, as a string of 0s and 1s, once the asks have arrived. */
    async function aborted(tickets: Ticket[], expected: string) {
      const read = () => tickets.map((t) => (t.signal.aborted ? "1" : "0")).join("");
      await vi.waitFor(() => expect(read()).toBe(expected), { timeout: 5_000, interval: 5 });
    }

    it("asks back as many borrowed permits as the owed class waits for, the latest first", async () => {
      const s = sem({ reclaim: "signal" });
      const bulk = await Promise.all(admits(s, "bulk", 10).map((w) => w));
      await clock.flush();
      const tickets = bulk.map((w) => ticketOf(w));
      // Signals handed out before the ask (to fetches on their way) are the ones that abort,
      // however often a ticket's signal is read.
      const handedOut = tickets.map((t) => t.signal);
      for (const t of tickets) expect(t.signal.aborted).toBe(false);
      const interactive = admits(s, "interactive", 2);
      await clock.flush();
      // Two permits wanted, none free: the two latest bulk tickets are asked back.
      await aborted(tickets, "0000000011");
      expect(handedOut.map((signal) => (signal.aborted ? "1" : "0")).join("")).toBe("0000000011");
      const reason = tickets[9]!.signal.reason;
      expect(reason).toBeInstanceOf(ReclaimedError);
      expect(isFloodgateError(reason, "RECLAIMED")).toBe(true);
      expect(reason.message).toContain('class "bulk" borrowed');
      // Nothing is taken before its release: the limit holds, and interactive waits for it.
      expect(granted(interactive)).toBe(0);
      await tickets[9]!.release("success");
      await tickets[8]!.release("success");
      await clock.flush();
      expect(granted(interactive)).toBe(2);
      // Asked back once: the rest of bulk is not asked for what is already coming back.
      await aborted(tickets.slice(0, 8), "00000000");
    });

    it("never asks for more than a class borrows beyond its guarantee", async () => {
      const s = sem({ reclaim: "signal" });
      const bulk = admits(s, "bulk", 10);
      await clock.flush();
      const tickets = bulk.map((w) => ticketOf(w));
      // Interactive wants all 8 of its guarantee (and 2 more): bulk borrowed 8, keeps its 2.
      const interactive = admits(s, "interactive", 10);
      await clock.flush();
      await aborted(tickets, "0011111111");
      for (const t of tickets.slice(2)) await t.release("success");
      await clock.flush();
      expect(granted(interactive)).toBe(8);
      await aborted(tickets.slice(0, 2), "00");
    });

    it("asks nothing while the waiting class holds its guarantee, and nothing by default", async () => {
      for (const reclaim of ["signal", undefined] as const) {
        const s = mem.semaphore(`sem-${reclaim}`, {
          limit: 10,
          classes: TWO,
          ...(reclaim ? { reclaim } : {}),
        });
        const held = admits(s, "interactive", 8);
        const bulk = admits(s, "bulk", 2);
        await clock.flush();
        // Bulk holds its guarantee; interactive asks beyond its own: it borrows, nobody is owed.
        const more = admits(s, "interactive", 1);
        await clock.flush();
        expect(granted(more)).toBe(0);
        const tickets = [...held, ...bulk].map((w) => ticketOf(w));
        await aborted(tickets, "0".repeat(10));
        if (!reclaim) {
          // Without reclaim, an owed class waits for releases alone.
          const bulkMore = admits(s, "bulk", 1);
          await clock.flush();
          await aborted(tickets, "0".repeat(10));
          expect(granted(bulkMore)).toBe(0);
        }
      }
    });

    it("asks only the borrowers it needs, lowest priority first, the later class on a tie", async () => {
      const s = mem.semaphore("three", {
        limit: 4,
        classes: { interactive: { share: 2, priority: 1 }, bulk: { share: 1 }, batch: { share: 1 } },
        reclaim: "signal",
      });
      // Guarantees 2, 1, 1: bulk and batch each borrow 1 beyond theirs.
      const bulk = admits(s, "bulk", 2);
      const batch = admits(s, "batch", 2);
      await clock.flush();
      const tickets = [...bulk, ...batch].map((w) => ticketOf(w));
      const interactive = admits(s, "interactive", 1);
      await clock.flush();
      await aborted(tickets, "0001");
      await tickets[3]!.release("success");
      await clock.flush();
      expect(granted(interactive)).toBe(1);
      // Closing aborts the signals of the tickets still held, with the close's reason.
      const held = tickets[0]!.signal;
      await s.close();
      expect(held.aborted).toBe(true);
      expect(held.reason?.constructor.name).toBe("ClosedError");
    });

    it("is refused without classes, and on a token bucket, naming the field", () => {
      expect(() => mem.semaphore("plain", { limit: 2, reclaim: "signal" })).toThrow(/reclaim needs classes/);
      expect(() => mem.semaphore("bad", { limit: 2, classes: TWO, reclaim: "now" as never })).toThrow(
        /reclaim must be "wait" or "signal"/,
      );
      expect(() =>
        mem.tokenBucket("tb", { capacity: 1, refillPerSecond: 1, classes: TWO, reclaim: "signal" } as never),
      ).toThrow(InvalidOptionsError);
    });
  });

  describe("on an AIMD limiter, shares are of the current limit", () => {
    it("moves the guarantees with the limit", async () => {
      const a = mem.aimd("ai", { initial: 10, max: 20, min: 2, backoffRatio: 0.5, classes: TWO });
      expect(a.snapshot().classes).toMatchObject({ interactive: { guarantee: 8 }, bulk: { guarantee: 2 } });
      const t = await a.admit({ class: "bulk" });
      await t.release("dropped");
      expect(a.snapshot().limit).toBe(5);
      expect(a.snapshot().classes).toMatchObject({ interactive: { guarantee: 4 }, bulk: { guarantee: 1 } });
      const waits = admits(a, "bulk", 6);
      await clock.flush();
      expect(granted(waits)).toBe(5);
    });

    it("after a cut below what is held, grants nothing until the held permits fit the new limit, then the owed class first", async () => {
      const a = mem.aimd("cut", { initial: 10, max: 10, min: 2, backoffRatio: 0.5, classes: TWO });
      const bulk = admits(a, "bulk", 10);
      await clock.flush();
      expect(granted(bulk)).toBe(10);
      const interactive = admits(a, "interactive", 3);
      const bulkMore = admits(a, "bulk", 3);
      await clock.flush();
      // A drop cuts the limit to 5 while bulk still holds 9.
      await ticketOf(bulk[0]!).release("dropped");
      await clock.flush();
      expect(a.snapshot()).toMatchObject({ limit: 5, inFlight: 9 });
      expect(a.snapshot().classes).toMatchObject({ interactive: { guarantee: 4 }, bulk: { guarantee: 1 } });
      for (let k = 1; k < 10; k++) {
        await ticketOf(bulk[k]!).release("ignored");
        await clock.flush();
        const snap = a.snapshot();
        // Never more held than the limit once it is back under it; interactive (owed) goes first.
        if (10 - k - 1 < 5)
          expect(snap.classes!.bulk!.held + snap.classes!.interactive!.held).toBeLessThanOrEqual(5);
        if (granted(bulkMore) > 0) expect(granted(interactive)).toBe(3);
      }
      expect(granted(interactive)).toBe(3);
    });

    it("refuses a cost above its class's ceiling at min", async () => {
      const a = mem.aimd("ai", {
        initial: 10,
        max: 20,
        min: 4,
        classes: { a: { share: 1, maxShare: 0.5 }, b: { share: 1 } },
      });
      await expect(a.admit({ class: "a", cost: 3 })).rejects.toThrow('ceiling of class "a" (2)');
      await expect(a.admit({ class: "a", cost: 2 })).resolves.toBeDefined();
    });
  });

  describe("in a gate", () => {
    it("hands the class to the stages with classes and waits in that class's line", async () => {
      const s = sem();
      const bucket = mem.tokenBucket("tb", { capacity: 100, refillPerSecond: 1 });
      const gate = new Gate([s, bucket], { clock });
      const bulk = Array.from({ length: 10 }, () => track(gate.admit({ class: "bulk" })));
      await clock.flush();
      expect(granted(bulk)).toBe(10);
      const bulkMore = track(gate.admit({ class: "bulk" }));
      const interactive = track(gate.admit({ class: "interactive" }));
      const run = track(gate.run(async () => "done", { class: "interactive" }));
      await clock.flush();
      expect(interactive.settled || run.settled).toBe(false);
      // The freed permit goes to interactive (owed), not to bulk which asked first (borrowing).
      await ticketOf(bulk[0]!).release();
      await clock.flush();
      expect(interactive.settled).toBe(true);
      expect(bulkMore.settled || run.settled).toBe(false);
      // The run waits in interactive's line the same way, and goes next.
      await ticketOf(bulk[1]!).release();
      await clock.flush();
      expect(run.value).toBe("done");
      expect(s.snapshot().classes!.interactive!.admitted).toBe(2);
    });

    it("refuses a class no stage has, or one a stage with classes does not know, before taking anything", async () => {
      const plain = new Gate([mem.semaphore("p", { limit: 1 })]);
      await expect(plain.admit({ class: "bulk" })).rejects.toThrow(
        'gate "gate": class given, got "bulk" (string), but no stage of the gate has classes',
      );
      const s = sem();
      const gate = new Gate([s]);
      await expect(gate.run(async () => 1, { class: "batch" })).rejects.toThrow(
        `gate "gate": class "batch" is not one of semaphore "sem"'s classes (interactive, bulk)`,
      );
      await expect(gate.admit()).rejects.toThrow('semaphore "sem": class is required');
      expect(s.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    });
  });

  describe("each call keeps its place", () => {
    it("a new call does not pass its own class's waiting head", async () => {
      const s = sem();
      const interactive = admits(s, "interactive", 8);
      await clock.flush();
      // Bulk holds its 2; 0 free. A bulk call of 3 waits; then 2 permits come free.
      admits(s, "bulk", 2);
      await clock.flush();
      const big = track(s.admit({ class: "bulk", cost: 3 }));
      await ticketOf(interactive[0]!).release();
      await ticketOf(interactive[1]!).release();
      await clock.flush();
      expect(big.settled).toBe(false);
      const small = track(s.admit({ class: "bulk", cost: 1 }));
      await clock.flush();
      expect(small.settled).toBe(false);
    });

    it("a new call of an owed class does not pass an owed head that arrived first", async () => {
      const s = sem();
      const held = [...admits(s, "interactive", 7), ...admits(s, "bulk", 1)];
      await clock.flush();
      expect(granted(held)).toBe(8);
      // 2 free; interactive (owed) waits for 3.
      const head = track(s.admit({ class: "interactive", cost: 3 }));
      await clock.flush();
      expect(head.settled).toBe(false);
      // Bulk is owed too (1 of 2), and 1 would fit, but interactive's head came first.
      const later = track(s.admit({ class: "bulk" }));
      await clock.flush();
      expect(later.settled).toBe(false);
      expect(s.snapshot().classes).toMatchObject({ interactive: { waiting: 1 }, bulk: { waiting: 1 } });
    });

    it("a cost of 0 goes at once even with its own class in line", async () => {
      const s = sem();
      admits(s, "bulk", 11);
      await clock.flush();
      expect(s.snapshot().classes!.bulk!.waiting).toBe(1);
      await expect(s.admit({ class: "bulk", cost: 0 })).resolves.toBeDefined();
    });

    it("says its classes and default class", () => {
      expect(sem().classes).toEqual(["interactive", "bulk"]);
      expect(sem().defaultClass).toBeUndefined();
      const d = mem.semaphore("d", { limit: 10, classes: TWO, defaultClass: "bulk" });
      expect(d.defaultClass).toBe("bulk");
      expect(mem.semaphore("none", { limit: 1 }).classes).toBeUndefined();
    });
  });

  describe("bad input names the field", () => {
    it.each([
      [{ classes: {} }, "classes must name 1 to 16 classes"],
      [{ classes: { a: { share: 0 } } }, "classes.a.share must be a finite number > 0"],
      [{ classes: { a: { share: Number.NaN } } }, "classes.a.share must be a finite number > 0"],
      [{ classes: { a: { share: 1, priority: 1.5 } } }, "classes.a.priority must be an integer"],
      [{ classes: { a: { share: 1, maxShare: 0 } } }, "classes.a.maxShare must be a number in (0, 1]"],
      [{ classes: { a: { share: 1, maxShare: 1.5 } } }, "classes.a.maxShare must be a number in (0, 1]"],
      [{ classes: { a: { share: 1, weight: 2 } } }, "weight"],
      [{ classes: { a: { share: 1 } }, defaultClass: "b" }, "defaultClass must name one of classes"],
      [{ defaultClass: "b" }, "defaultClass must name one of classes"],
      [{ classes: [1] }, "classes"],
      [
        { classes: Object.fromEntries(Array.from({ length: 17 }, (_, i) => [`c${i}`, { share: 1 }])) },
        "classes must name 1 to 16 classes",
      ],
    ])("%j", (bad, message) => {
      let error: unknown;
      try {
        mem.semaphore("bad", { limit: 4, ...(bad as object) });
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(InvalidOptionsError);
      expect((error as Error).message).toContain(message);
    });

    it("refuses a call's bad class", async () => {
      const s = sem();
      for (const bad of [{}, { class: "batch" }]) {
        const error = await s.admit(bad).catch((e: unknown) => e);
        expect(error).toMatchObject({ code: "INVALID_OPTIONS", field: "class" });
      }
      const none = await mem
        .semaphore("none", { limit: 1 })
        .admit({ class: "bulk" })
        .catch((e: unknown) => e);
      expect(none).toMatchObject({ code: "INVALID_OPTIONS", field: "class" });
      await expect(s.admit()).rejects.toThrow(
        'semaphore "sem": class is required: name each call\'s class (one of interactive, bulk), or build the semaphore with defaultClass',
      );
      await expect(s.admit({ class: "batch" })).rejects.toThrow(
        'semaphore "sem": class must be one of interactive, bulk, got "batch" (string)',
      );
      await expect(s.admit({ class: "" })).rejects.toThrow(
        'semaphore "sem": class must be a non-empty string, got ""',
      );
      await expect(s.admit({ class: 7 as unknown as string })).rejects.toThrow(
        "class must be a non-empty string",
      );
      await expect(s.tryAdmit({ class: "batch" })).rejects.toThrow("class must be one of");
      await expect(s.run!(async () => 1, { class: "batch" })).rejects.toThrow("class must be one of");
      await expect(mem.semaphore("p", { limit: 1 }).admit({ class: "bulk" })).rejects.toThrow(
        'semaphore "p": class given, got "bulk" (string), but the semaphore has no classes',
      );
      expect(s.snapshot()).toMatchObject({ inFlight: 0, waiting: 0 });
    });

    it("takes a call with no class as the default class", async () => {
      const s = sem({ defaultClass: "bulk" });
      await s.admit();
      expect(s.snapshot().classes!.bulk).toMatchObject({ inFlight: 1, held: 1 });
    });
  });
});

// admitNow is the memory stages' synchronous path for a Gate; Redis stages have none.
describe("traffic classes in memory", () => {
  const mem = memory({ clock: new FakeClock() });
  it("admitNow refuses what admit would refuse, and takes from the call's class", () => {
    const s = mem.semaphore("sem", { limit: 10, classes: TWO }) as unknown as {
      admitNow(o: object, cost: number): Ticket | undefined;
      snapshot(): { classes?: Record<string, { held: number }>; inFlight: number };
    };
    for (const cost of [-1, 1.5, 11, Number.NaN]) expect(s.admitNow({ class: "bulk" }, cost)).toBeUndefined();
    expect(s.admitNow({ class: "bulk", signal: AbortSignal.abort() }, 1)).toBeUndefined();
    expect(s.admitNow({ class: "bulk" }, 2)).toBeDefined();
    expect(s.admitNow({ class: "bulk" }, 0)).toBeDefined();
    expect(s.snapshot().classes!.bulk!.held).toBe(2);
    expect(s.snapshot().inFlight).toBe(2);
    const plain = mem.semaphore("plain", { limit: 2 }) as unknown as typeof s;
    for (const cost of [-1, 1.5, 3]) expect(plain.admitNow({}, cost)).toBeUndefined();
    expect(plain.snapshot().inFlight).toBe(0);
  });
});

/** Interactive and bulk on 100 tokens a second, 20 at most: shares of 80 and 20 a second. */
const BUCKET = { capacity: 20, refillPerSecond: 100, classes: TWO };

/**
 * Callers of `cls` on bucket `b`, each asking again as soon as it is admitted, while `running()`;
 * returns the admission times.
 */
function saturate(b: Stage, clock: FakeClock, cls: string, running: () => boolean, cost = 1): number[] {
  const times: number[] = [];
  const loop = async () => {
    while (running()) {
      try {
        await b.admit({ class: cls, cost });
      } catch {
        return;
      }
      times.push(clock.now());
    }
  };
  void loop();
  return times;
}

describe.each(backends)("traffic classes on a token bucket on $name", (backend) => {
  useBackend(backend);
  let clock: FakeClock;
  let mem: Backend;
  beforeEach(() => {
    clock = new FakeClock();
    mem = backend.make(clock);
  });

  it("bulk alone takes the whole bucket: its capacity, then the whole refill", async () => {
    const b = mem.tokenBucket("tb", BUCKET);
    let on = true;
    const bulk = saturate(b, clock, "bulk", () => on);
    await clock.advance(1_000);
    on = false;
    await b.close();
    expect(bulk.length).toBeGreaterThanOrEqual(20 + 99);
    expect(bulk.length).toBeLessThanOrEqual(20 + 100);
  });

  it("bulk saturating, then interactive arrives: it goes within one token's refill, and gets its share after", async () => {
    const b = mem.tokenBucket("tb", BUCKET);
    let on = true;
    const bulk = saturate(b, clock, "bulk", () => on);
    await clock.advance(2_000);
    const first = track(b.admit({ class: "interactive" }));
    await clock.advance(10);
    expect(first.settled).toBe(true);
    const interactive = saturate(b, clock, "interactive", () => on);
    const bulkBefore = bulk.length;
    await clock.advance(5_000);
    on = false;
    await b.close();
    // Over 5 s both wanting all: interactive at least its 80 a second, bulk at least its 20 (what
    // it borrowed before is not held against it).
    expect(interactive.length).toBeGreaterThanOrEqual(400 - 2);
    expect(bulk.length - bulkBefore).toBeGreaterThanOrEqual(100 - 2);
    expect(b.snapshot().classes).toMatchObject({
      interactive: { guarantee: 80, ceiling: 100, priority: 1 },
      bulk: { guarantee: 20, ceiling: 100, priority: 0 },
    });
  });

  it("a low priority keeps its share under a flood of a higher one", async () => {
    const b = mem.tokenBucket("tb", {
      capacity: 10,
      refillPerSecond: 100,
      classes: { low: { share: 1 }, high: { share: 1, priority: 5 } },
    });
    let on = true;
    const low = saturate(b, clock, "low", () => on);
    const high = saturate(b, clock, "high", () => on);
    await clock.advance(4_000);
    on = false;
    await b.close();
    expect(low.length).toBeGreaterThanOrEqual(200 - 2);
    expect(high.length).toBeGreaterThanOrEqual(200 - 2);
    expect(low.length + high.length).toBeLessThanOrEqual(10 + 400);
  });

  it("never grants more than the bucket allows, whatever the classes ask (random costs and arrivals)", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(
          fc.record({
            cls: fc.constantFrom("interactive", "bulk"),
            cost: fc.integer({ min: 1, max: 6 }),
            after: fc.integer({ min: 0, max: 30 }),
          }),
          { minLength: 1, maxLength: 60 },
        ),
        async (ops) => {
          const c = new FakeClock();
          const b = backend.make(c).tokenBucket("tb", {
            capacity: 10,
            refillPerSecond: 50,
            classes: TWO,
          });
          const granted: { at: number; cost: number }[] = [];
          const waits = ops.map(async (op) => {
            await c.advance(op.after);
            const t = await b.admit({ class: op.cls, cost: op.cost });
            granted.push({ at: c.now(), cost: t.cost });
          });
          for (let i = 0; i < 400 && granted.length < ops.length; i++) await c.advance(10);
          await Promise.all(waits);
          // Every window [from, to] granted at most capacity + rate × its length.
          for (const from of granted) {
            const sum = granted.filter((g) => g.at >= from.at).reduce((n, g) => n + g.cost, 0);
            const last = Math.max(...granted.map((g) => g.at));
            expect(sum).toBeLessThanOrEqual(10 + (50 * (last - from.at)) / 1000 + 1e-9);
          }
          await b.close();
        },
      ),
      { numRuns: backend.name === "memory" ? 60 : 12 },
    );
  });

  it("refuses at once a cost above its class's ceiling, and serves a cost above its share", async () => {
    const b = mem.tokenBucket("tb", {
      capacity: 20,
      refillPerSecond: 100,
      classes: { a: { share: 1, maxShare: 0.25 }, b: { share: 3 } },
    });
    await expect(b.admit({ class: "a", cost: 6 })).rejects.toThrow(
      'tokenBucket "tb": cost must be <= the ceiling of class "a" (5)',
    );
    await expect(b.admit({ class: "a", cost: 5 })).resolves.toBeDefined();
    await expect(b.admit({ class: "b", cost: 15 })).resolves.toBeDefined();
  });

  it("a timed-out or aborted waiter leaves its class's line; a refund gives back to its class", async () => {
    const b = mem.tokenBucket("tb", BUCKET);
    const all = await Promise.all(Array.from({ length: 20 }, () => b.admit({ class: "bulk" })));
    const controller = new AbortController();
    const aborted = track(b.admit({ class: "interactive", signal: controller.signal }));
    const timed = track(b.admit({ class: "bulk", timeoutMs: 5 }));
    expect(b.snapshot().classes).toMatchObject({ interactive: { waiting: 1 }, bulk: { waiting: 1 } });
    controller.abort();
    await clock.advance(6);
    expect(aborted.error).toBeDefined();
    expect(timed.error).toBeDefined();
    expect(b.snapshot().classes).toMatchObject({
      interactive: { waiting: 0 },
      bulk: { waiting: 0, inFlight: 20 },
    });
    // The latest grant's tokens come back to the bucket and to bulk's share.
    await all[19]!.refund();
    expect(b.snapshot().classes!.bulk).toMatchObject({ inFlight: 19, held: 19 });
    // Without the refund the bucket would hold 0.6: now it holds a call's worth.
    await expect(b.tryAdmit({ class: "bulk" })).resolves.toBeDefined();
    await expect(b.tryAdmit({ class: "bulk" })).resolves.toBeUndefined();
  });

  it("keeps the shares per key on a keyed bucket", async () => {
    const b = mem.tokenBucket("tb", { ...BUCKET, keyed: true });
    const k1 = await Promise.all(Array.from({ length: 20 }, () => b.admit({ key: "k1", class: "bulk" })));
    // k2 is untouched by k1's draw.
    await expect(b.tryAdmit({ key: "k2", class: "interactive" })).resolves.toBeDefined();
    expect(k1.length).toBe(20);
    await expect(b.admit({ class: "bulk" })).rejects.toThrow("key");
  });

  it("a newcomer does not pass an owed head of another class that came first", async () => {
    const b = mem.tokenBucket("tb", BUCKET);
    await Promise.all(Array.from({ length: 18 }, () => b.admit({ class: "interactive" })));
    // Bulk (owed: it has drawn nothing) asks for 4 with 2 in the bucket: it waits.
    const bulk = track(b.admit({ class: "bulk", cost: 4 }));
    await clock.flush();
    expect(bulk.settled).toBe(false);
    // Interactive asks for 1, which the bucket holds: bulk came first, so it waits behind.
    expect(await b.tryAdmit({ class: "interactive" })).toBeUndefined();
    await clock.advance(20);
    expect(bulk.settled).toBe(true);
  });

  it("a class whose calls cost more than its share of the capacity still gets its share of the rate", async () => {
    // Bulk's share: 20 a second, 4 of the capacity; its calls cost 10.
    const b = mem.tokenBucket("tb", BUCKET);
    let on = true;
    const interactive = saturate(b, clock, "interactive", () => on);
    const bulk = saturate(b, clock, "bulk", () => on, 10);
    await clock.advance(5_000);
    on = false;
    await b.close();
    expect(bulk.length * 10).toBeGreaterThanOrEqual(100 - 10);
    expect(interactive.length).toBeGreaterThanOrEqual(400 - 10);
  });

  it("settles a class's ticket on the class too: what it holds, and its share", async () => {
    const b = mem.tokenBucket("tb", BUCKET);
    const t = await b.admit({ class: "interactive", cost: 4 });
    expect(b.snapshot().classes!.interactive).toMatchObject({ inFlight: 1, held: 4 });
    await t.settle(6);
    expect(b.snapshot().classes!.interactive).toMatchObject({ inFlight: 1, held: 6 });
    await t.settle(1);
    expect(b.snapshot().classes!.interactive).toMatchObject({ inFlight: 1, held: 1 });
    await t.release("success");
    expect(b.snapshot().classes!.interactive).toMatchObject({ inFlight: 0, held: 0, admitted: 1 });
    // A settle that charges bulk more than its share leaves it borrowing: interactive, asking
    // after it, goes first.
    const drained = await Promise.all(
      Array.from({ length: 4 }, () => b.admit({ class: "interactive", cost: 4 })),
    );
    const big = await b.admit({ class: "bulk", cost: 3 });
    await big.settle(4);
    // The bucket is at -1 (the settle's debt): its next token comes in 20 ms.
    const bulkNext = track(b.admit({ class: "bulk" }));
    const interactiveNext = track(b.admit({ class: "interactive" }));
    await clock.advance(20);
    expect(interactiveNext.settled).toBe(true);
    expect(bulkNext.settled).toBe(false);
    expect(drained.length).toBe(4);
  });

  it("shows each class's ceiling in tokens a second", () => {
    const b = mem.tokenBucket("tb", {
      ...BUCKET,
      classes: { a: { share: 1, maxShare: 0.5 }, b: { share: 3 } },
    });
    expect(b.snapshot().classes).toMatchObject({
      a: { guarantee: 25, ceiling: 50, kept: 0 },
      b: { guarantee: 75, ceiling: 100 },
    });
  });

  it("rejects the waiters of every class on close", async () => {
    const b = mem.tokenBucket("tb", BUCKET);
    await Promise.all(Array.from({ length: 20 }, () => b.admit({ class: "bulk" })));
    const waiting = [track(b.admit({ class: "interactive" })), track(b.admit({ class: "bulk" }))];
    await b.close();
    await clock.flush();
    expect(waiting.map((w) => w.error?.constructor.name)).toEqual(["ClosedError", "ClosedError"]);
  });

  it("takes its class from a gate", async () => {
    const b = mem.tokenBucket("tb", BUCKET);
    const gate = new Gate([b], { clock });
    await Promise.all(Array.from({ length: 20 }, () => gate.admit({ class: "bulk" })));
    const interactive = track(gate.admit({ class: "interactive" }));
    const bulk = track(gate.admit({ class: "bulk" }));
    await clock.advance(10);
    expect(interactive.settled).toBe(true);
    expect(bulk.settled).toBe(false);
    expect(b.snapshot().classes!.interactive!.admitted).toBe(1);
    await gate.close();
  });

  it("says its classes, and refuses a bad class", async () => {
    const b = mem.tokenBucket("tb", { ...BUCKET, defaultClass: "bulk" });
    expect(b.classes).toEqual(["interactive", "bulk"]);
    await b.admit();
    expect(b.snapshot().classes!.bulk!.admitted).toBe(1);
    await expect(b.admit({ class: "batch" })).rejects.toThrow("class must be one of interactive, bulk");
    expect(() => mem.tokenBucket("bad", { ...BUCKET, defaultClass: "nope" })).toThrow("defaultClass");
  });
});

describe("traffic classes on a memory token bucket: idle keys", () => {
  let clock: FakeClock;
  let mem: Backend;
  beforeEach(() => {
    clock = new FakeClock();
    mem = memory({ clock });
  });

  it("forgets an idle key only once every class's share has refilled too", async () => {
    const b = mem.tokenBucket("tb", { ...BUCKET, keyed: true }) as unknown as Stage & {
      evictIdle(): number;
      keyCount: number;
    };
    for (let k = 0; k < 4; k++) await b.admit({ key: "k", class: "bulk" });
    // The bucket is full again after 40 ms; bulk's share (4 tokens at 20 a second) after 200 ms.
    await clock.advance(100);
    expect(b.evictIdle()).toBe(0);
    expect(b.keyCount).toBe(1);
    await clock.advance(100);
    expect(b.evictIdle()).toBe(1);
    expect(b.keyCount).toBe(0);
  });

  it("keeps a key whose class waits at its ceiling, even with its bucket full", async () => {
    const b = mem.tokenBucket("tb", {
      capacity: 20,
      refillPerSecond: 100,
      keyed: true,
      classes: { a: { share: 1, maxShare: 0.5 }, b: { share: 3 } },
    }) as unknown as Stage & { evictIdle(): number; keyCount: number };
    // Class a spends its ceiling of 10, then waits for 10 more while the bucket refills.
    await b.admit({ key: "k", class: "a", cost: 10 });
    const waiting = track(b.admit({ key: "k", class: "a", cost: 10 }));
    await clock.advance(150);
    expect(waiting.settled).toBe(false);
    expect(b.evictIdle()).toBe(0);
    await clock.advance(100);
    expect(waiting.settled).toBe(true);
  });
});
