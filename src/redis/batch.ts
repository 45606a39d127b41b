/** One call waiting to go out with others: its two per-call arguments and its promise. */
interface Pending {
  a: string;
  b: string;
  resolve: (reply: unknown) => void;
  reject: (error: unknown) => void;
}

/**
 * Calls of one script by one stage, gathered while another is out. The first call goes at
 * once; calls made while one is out wait for the end of the turn of the event loop and go
 * together in one script call that decides them in turn, as if each had called alone, and
 * answers one reply per call. A lone caller so waits for nothing, and a crowd costs Redis one
 * script run per turn instead of one per caller.
 *
 * `send` gets the per-call argument pairs `[a1, b1, a2, b2, …]` and sends one script call; with
 * one pair its reply is that call's, with more it is the list of their replies.
 */
export class ScriptBatch {
  #out = 0;
  #pending: Pending[] | undefined = undefined;
  readonly #done = () => {
    this.#out--;
  };

  constructor(readonly send: (pairs: string[]) => Promise<unknown>) {}

  run(a: string, b: string): Promise<any> {
    if (this.#out === 0) return this.#go([a, b]);
    return new Promise((resolve, reject) => {
      if (this.#pending === undefined) {
        this.#pending = [];
        process.nextTick(this.#flush);
      }
      this.#pending.push({ a, b, resolve, reject });
    });
  }

  #go(pairs: string[]): Promise<unknown> {
    this.#out++;
    const reply = this.send(pairs);
    reply.then(this.#done, this.#done);
    return reply;
  }

  readonly #flush = (): void => {
    const batch = this.#pending!;
    this.#pending = undefined;
    if (batch.length === 1) {
      const p = batch[0]!;
      this.#go([p.a, p.b]).then(p.resolve, p.reject);
      return;
    }
    const pairs = new Array<string>(batch.length * 2);
    for (let i = 0; i < batch.length; i++) {
      pairs[2 * i] = batch[i]!.a;
      pairs[2 * i + 1] = batch[i]!.b;
    }
    this.#go(pairs).then(
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
