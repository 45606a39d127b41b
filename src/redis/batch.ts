/** One call waiting to go out with others: its per-call arguments and its promise. */
interface Pending {
  a: string;
  b: string;
  c: string;
  resolve: (reply: unknown) => void;
  reject: (error: unknown) => void;
}

/**
 * The most calls of a turn one script call takes (ScriptBatch, TurnQueue): a larger turn goes as
 * several script calls, in order, written in the same tick. Redis decides them in that order, as
 * it would one, but it can decide the first while this process writes the next, and this
 * process can take the first's replies while Redis decides the next. At 64 callers, 32 admitted
 * about 1.3 times the calls per second of one script call per turn on a four-stage fused gate,
 * and 1.7 to 1.9 times on a lone semaphore (bench/RESULTS.md).
 */
export const TURN_CHUNK = 32;

/** Hand `send` the items in runs of up to TURN_CHUNK, in order (`items` itself when it is one run). */
function inChunks<T>(items: T[], send: (chunk: T[]) => void): void {
  if (items.length <= TURN_CHUNK) {
    send(items);
    return;
  }
  for (let i = 0; i < items.length; i += TURN_CHUNK) send(items.slice(i, i + TURN_CHUNK));
}

/**
 * Calls of one script by one stage, gathered for the turn of the event loop: each waits for the
 * end of the turn it was made in (`process.nextTick`, no timer) and goes with that turn's others
 * in script calls of up to TURN_CHUNK that decide them in turn, as if each had called alone, and
 * answer one reply per call. A lone caller so waits for nothing but the rest of its own turn,
 * and a crowd costs Redis one script run per TURN_CHUNK callers of a turn instead of one per
 * caller. (The first call of a turn once went at once when no call was out: a crowd whose
 * replies came back together then sent one caller alone and the rest after it, two script calls
 * a turn where one does. At 64 callers a lone semaphore admitted 1.0 to 1.4 times the calls a
 * second gathered so, and a fused four-stage gate 1.05 times: bench/RESULTS.md.)
 *
 * `send` gets the per-call arguments, `width` of them per call (`[a1, b1, a2, b2, …]` for two,
 * `[a1, b1, c1, a2, …]` for three), and sends one script call; with one call's arguments its
 * reply is that call's, with more it is the list of their replies.
 */
export class ScriptBatch {
  /** Send every call at once, in the caller's turn: a Gate is gathering its stages' calls. */
  static direct = false;
  #pending: Pending[] | undefined = undefined;

  constructor(
    readonly send: (args: string[]) => Promise<unknown>,
    readonly width: 2 | 3 = 2,
  ) {}

  /** Send one call's arguments (`c` only when `width` is 3), alone or with this turn's others. */
  run(a: string, b: string, c = ""): Promise<any> {
    if (ScriptBatch.direct) return this.send(this.width === 2 ? [a, b] : [a, b, c]);
    return new Promise((resolve, reject) => {
      if (this.#pending === undefined) {
        this.#pending = [];
        process.nextTick(this.#flush);
      }
      this.#pending.push({ a, b, c, resolve, reject });
    });
  }

  readonly #flush = (): void => {
    const all = this.#pending!;
    this.#pending = undefined;
    inChunks(all, this.#sendBatch);
  };

  /** Send one script call for `batch` (one call, or up to TURN_CHUNK of a turn). */
  readonly #sendBatch = (batch: Pending[]): void => {
    const width = this.width;
    if (batch.length === 1) {
      const p = batch[0]!;
      this.send(width === 2 ? [p.a, p.b] : [p.a, p.b, p.c]).then(p.resolve, p.reject);
      return;
    }
    const args = new Array<string>(batch.length * width);
    for (let i = 0; i < batch.length; i++) {
      const p = batch[i]!;
      args[width * i] = p.a;
      args[width * i + 1] = p.b;
      if (width === 3) args[width * i + 2] = p.c;
    }
    this.send(args).then(
      (replies) => {
        const list = replies as unknown[];
        for (let i = 0; i < batch.length; i++) batch[i]!.resolve(list[i]);
      },
      (error: unknown) => {
        for (const p of batch) p.reject(error);
      },
    );
  };
}

/**
 * Items of one kind, gathered until the end of the turn of the event loop they were made in and
 * sent together, TURN_CHUNK at a time: ScriptBatch's rule for items that are not script
 * arguments (a fused gate's tries and releases). `send` sends a list and returns its reply, or
 * undefined when it sent nothing; should it throw, each of the items it was given is rejected
 * with the error (their callers would otherwise never hear back).
 */
export class TurnQueue<I extends { reject(error: unknown): void }> {
  #pending: I[] | undefined = undefined;

  constructor(readonly send: (items: I[]) => Promise<unknown> | undefined) {}

  /** Send `item`, alone or with this turn's others. */
  add(item: I): void {
    if (this.#pending === undefined) {
      this.#pending = [];
      process.nextTick(this.#flush);
    }
    this.#pending.push(item);
  }

  readonly #go = (items: I[]): void => {
    let reply: Promise<unknown> | undefined;
    try {
      reply = this.send(items);
    } catch (error) {
      for (const item of items) item.reject(error);
      return;
    }
    // (Its outcome is the items' own, which `send` tells them.)
    reply?.catch(() => {});
  };

  readonly #flush = (): void => {
    const items = this.#pending!;
    this.#pending = undefined;
    inChunks(items, this.#go);
  };
}
