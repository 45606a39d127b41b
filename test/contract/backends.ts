import { type Backend, memory } from "floodgate";
import type { FakeClock } from "floodgate/testing";

/**
 * The backends every contract suite runs against. Each builds a fresh backend driven by the
 * given fake clock (and a fixed `random` for jitter), with names that do not collide.
 */
export interface ContractBackend {
  name: string;
  make(clock: FakeClock, random?: () => number): Backend;
}

export const backends: ContractBackend[] = [
  { name: "memory", make: (clock, random) => memory({ clock, ...(random ? { random } : {}) }) },
];

/** Settle a promise into a tag we can assert on without awaiting it forever. */
export function track<T>(promise: Promise<T>) {
  const state: { settled: boolean; value?: T; error?: unknown } = { settled: false };
  promise.then(
    (value) => {
      state.settled = true;
      state.value = value;
    },
    (error) => {
      state.settled = true;
      state.error = error;
    },
  );
  return state;
}
