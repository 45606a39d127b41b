/**
 * Waits that end when a caller's signal aborts, heard through one listener per signal: a
 * worker's many callers often pass one signal (its shutdown), and a listener each would pile up
 * on it (Node warns past ten, `MaxListenersExceededWarning`, and each removal scans the rest).
 */

/** A wait told of its signal's abort: an object with `handleEvent` (no closure), or a function. */
export type AbortWait = { handleEvent(): void } | (() => void);

/** The waits on one signal, and the one listener that tells them. */
class Group {
  readonly waits = new Set<AbortWait>();
  /** Its listener is telling the waits: it stays, for a wait that begins meanwhile. */
  firing = false;

  constructor(
    readonly owner: SignalWaits,
    readonly signal: AbortSignal,
  ) {}

  /**
   * The signal aborted: each wait still listening is told, in the order they began (one that an
   * earlier one's end took away is not; one that begins meanwhile is).
   */
  handleEvent(): void {
    this.firing = true;
    for (const w of this.waits) {
      this.waits.delete(w);
      if (typeof w === "function") w();
      else w.handleEvent();
    }
    this.owner.fired(this);
  }
}

/**
 * The waits of one owner (a stage, a fused gate) on callers' signals: one abort listener per
 * signal, however many of its waits listen. A wait is told once, and not after it is removed.
 */
export class SignalWaits {
  readonly #groups = new Map<AbortSignal, Group>();

  /**
   * Tell `wait` when `signal` aborts. Throws what the signal's `addEventListener` throws (then
   * nothing listens). A signal that has aborted already is not listened to again: check it first.
   */
  add(signal: AbortSignal, wait: AbortWait): void {
    let group = this.#groups.get(signal);
    if (group === undefined) {
      group = new Group(this, signal);
      signal.addEventListener("abort", group, { once: true });
      this.#groups.set(signal, group);
    }
    group.waits.add(wait);
  }

  /** Stop telling `wait` of `signal`; the listener goes with the signal's last wait. */
  remove(signal: AbortSignal, wait: AbortWait): void {
    const group = this.#groups.get(signal);
    if (group === undefined || !group.waits.delete(wait) || group.waits.size > 0 || group.firing) return;
    this.#groups.delete(signal);
    try {
      signal.removeEventListener("abort", group);
    } catch {
      // A signal whose removeEventListener throws keeps a listener that finds no wait.
    }
  }

  /** `group`'s listener ran (once): a later wait on its signal needs one of its own. */
  fired(group: Group): void {
    if (this.#groups.get(group.signal) === group) this.#groups.delete(group.signal);
  }
}
