/**
 * How fast a semaphore can be that keeps each caller's async context across the wait, as
 * floodgate's does (`AsyncLocalStorage` reads the caller's store in `fn`), against one that calls
 * `fn` straight from the release and so loses it, beside p-limit and `semaphore.run`. Not part of
 * `npm run bench`: it explains a target, it does not measure floodgate against its peers.
 *
 *   node --expose-gc --import tsx bench/context-floor.ts
 */
import { memory } from "floodgate";
import pLimit from "p-limit";

const task = async (): Promise<number> => 1;
const N = 200_000;

class Ticket {
  released = false;
  constructor(readonly s: { used: number; drain(): void }) {}
  release(): void {
    if (this.released) return;
    this.released = true;
    this.s.used--;
    this.s.drain();
  }
}

function callWith<T>(t: Ticket, fn: () => Promise<T>): Promise<T> {
  let r: Promise<T>;
  try {
    r = fn();
  } catch (e) {
    t.release();
    return Promise.reject(e);
  }
  return r.then(
    (v) => {
      t.release();
      return v;
    },
    (e: unknown) => {
      t.release();
      throw e;
    },
  );
}

/** Keeps the context: one promise per waiter, whose reaction (registered by the caller) calls `fn`. */
class KeepsContext {
  used = 0;
  #head: Waiting | null = null;
  #tail: Waiting | null = null;
  waitedMs = 0;
  constructor(readonly limit: number) {}
  drain(): void {
    for (let w = this.#head; w && this.used < this.limit; w = this.#head) {
      this.#head = w.next;
      if (!this.#head) this.#tail = null;
      this.used++;
      const now = performance.now();
      this.waitedMs += now - w.at;
      w.ticket = new Ticket(this);
      w.resolve(w);
    }
  }
  run<T>(fn: () => Promise<T>): Promise<T> {
    if (!this.#head && this.used < this.limit) {
      this.used++;
      return callWith(new Ticket(this), fn);
    }
    const w = new Waiting(fn as () => Promise<unknown>, performance.now());
    const granted = new Promise<Waiting>(capture);
    w.resolve = captured!;
    if (this.#tail) this.#tail.next = w;
    else this.#head = w;
    this.#tail = w;
    return granted.then(start) as Promise<T>;
  }
}

/** No closure per waiter: the executor and the reaction are shared functions. */
let captured: ((w: Waiting) => void) | undefined;
function capture(resolve: (w: Waiting) => void): void {
  captured = resolve;
}
function start(w: Waiting): Promise<unknown> {
  return callWith(w.ticket!, w.fn);
}

class Waiting {
  next: Waiting | null = null;
  ticket: Ticket | undefined = undefined;
  resolve!: (w: Waiting) => void;
  constructor(
    readonly fn: () => Promise<unknown>,
    readonly at: number,
  ) {}
}

/** Loses the context: the release calls the next waiter's `fn` itself. */
class LosesContext {
  used = 0;
  #head: Queued | null = null;
  #tail: Queued | null = null;
  constructor(readonly limit: number) {}
  drain(): void {
    for (let w = this.#head; w && this.used < this.limit; w = this.#head) {
      this.#head = w.next;
      if (!this.#head) this.#tail = null;
      this.used++;
      callWith(new Ticket(this), w.fn).then(w.resolve, w.reject);
    }
  }
  run<T>(fn: () => Promise<T>): Promise<T> {
    if (!this.#head && this.used < this.limit) {
      this.used++;
      return callWith(new Ticket(this), fn);
    }
    return new Promise<T>((resolve, reject) => {
      const w = new Queued(fn, resolve as (v: unknown) => void, reject);
      if (this.#tail) this.#tail.next = w;
      else this.#head = w;
      this.#tail = w;
    });
  }
}

class Queued {
  next: Queued | null = null;
  constructor(
    readonly fn: () => Promise<unknown>,
    readonly resolve: (v: unknown) => void,
    readonly reject: (e: unknown) => void,
  ) {}
}

/** `admit` → `release` with nothing but a FIFO of resolve functions: the floor of that shape. */
class MinimalAdmit {
  used = 0;
  #head: Pending | null = null;
  #tail: Pending | null = null;
  constructor(readonly limit: number) {}
  drain(): void {
    for (let w = this.#head; w && this.used < this.limit; w = this.#head) {
      this.#head = w.next;
      if (!this.#head) this.#tail = null;
      this.used++;
      w.resolve(new Ticket(this));
    }
  }
  admit(): Promise<Ticket> {
    if (!this.#head && this.used < this.limit) {
      this.used++;
      return Promise.resolve(new Ticket(this));
    }
    return new Promise<Ticket>((resolve) => {
      const w = new Pending(resolve);
      if (this.#tail) this.#tail.next = w;
      else this.#head = w;
      this.#tail = w;
    });
  }
}

class Pending {
  next: Pending | null = null;
  constructor(readonly resolve: (t: Ticket) => void) {}
}

/** The shape a caller of `admit` writes (the benchmark's `admit` → run → `release`). */
async function admitted(sem: { admit(): Promise<{ release(): unknown }> }): Promise<number> {
  const ticket = await sem.admit();
  try {
    return await task();
  } finally {
    ticket.release();
  }
}

const contenders: Record<string, (c: number) => () => Promise<number>> = {
  "p-limit": (c) => {
    const limit = pLimit(c);
    return () => limit(task);
  },
  "floodgate semaphore.run": (c) => {
    const sem = memory().semaphore("floor", { limit: c });
    return () => sem.run(task);
  },
  "minimal, keeps context": (c) => {
    const sem = new KeepsContext(c);
    return () => sem.run(task);
  },
  "minimal, loses context": (c) => {
    const sem = new LosesContext(c);
    return () => sem.run(task);
  },
  "floodgate admit → release": (c) => {
    const sem = memory().semaphore("floor", { limit: c });
    return () => admitted(sem);
  },
  "minimal admit → release": (c) => {
    const sem = new MinimalAdmit(c);
    return () => admitted(sem);
  },
};

async function once(name: string, c: number): Promise<number> {
  const call = contenders[name]!(c);
  const started = performance.now();
  const pending = new Array<Promise<number>>(N);
  for (let i = 0; i < N; i++) pending[i] = call();
  await Promise.all(pending);
  return N / ((performance.now() - started) / 1000);
}

const gc = (globalThis as { gc?: () => void }).gc;
if (!gc) throw new Error("run with node --expose-gc --import tsx bench/context-floor.ts");
const names = Object.keys(contenders);
const median = (a: number[]) => [...a].sort((x, y) => x - y)[(a.length - 1) >> 1]!;
for (const c of [1, 16, 256]) {
  const figures = new Map(names.map((n) => [n, [] as number[]]));
  for (const n of names) {
    gc();
    await once(n, c);
  }
  for (let r = 0; r < 5; r++) {
    for (let i = 0; i < names.length; i++) {
      const n = names[(i + r) % names.length]!;
      gc();
      figures.get(n)!.push(await once(n, c));
    }
  }
  const base = figures.get("p-limit")!;
  const row = names.map((n) => {
    const f = figures.get(n)!;
    return `${n} ${Math.round(median(f) / 1000)} k/s (${median(f.map((v, i) => v / base[i]!)).toFixed(2)}×)`;
  });
  console.log(`concurrency ${c}: ${row.join("; ")}`);
}

// Last, since AsyncLocalStorage slows every promise once used: does each keep the caller's store?
const { AsyncLocalStorage } = await import("node:async_hooks");
const als = new AsyncLocalStorage<number>();
const limited: Record<string, (fn: () => Promise<number>) => Promise<number>> = {
  "p-limit": pLimit(1),
  "floodgate semaphore.run": (fn) => sem1.run(fn),
  "minimal, keeps context": (fn) => keeps1.run(fn),
  "minimal, loses context": (fn) => loses1.run(fn),
  "floodgate admit → release": async (fn) => {
    const ticket = await sem1.admit();
    try {
      return await fn();
    } finally {
      ticket.release();
    }
  },
  "minimal admit → release": async (fn) => {
    const ticket = await min1.admit();
    try {
      return await fn();
    } finally {
      ticket.release();
    }
  },
};
const min1 = new MinimalAdmit(1);
const sem1 = memory().semaphore("context", { limit: 1 });
const keeps1 = new KeepsContext(1);
const loses1 = new LosesContext(1);
const kept = names.map((name) => {
  const seen: (number | undefined)[] = [];
  const calls = [1, 2, 3].map((id) =>
    als.run(id, () => limited[name]!(async () => seen.push(als.getStore()))),
  );
  return Promise.all(calls).then(
    () => `${name}: ${seen.join(",") === "1,2,3" ? "keeps" : `loses (${seen.join(",")})`}`,
  );
});
console.log(`each caller's AsyncLocalStorage store in fn: ${(await Promise.all(kept)).join("; ")}`);
