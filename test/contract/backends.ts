import { randomUUID } from "node:crypto";
import { type Backend, memory } from "floodgate";
import { redis } from "floodgate/redis";
import type { FakeClock } from "floodgate/testing";
import { Redis } from "ioredis";
import { afterAll, beforeAll, inject } from "vitest";

/**
 * The backends every contract suite runs against. Each builds a fresh backend driven by the
 * given fake clock (and a fixed `random` for jitter), with names that do not collide.
 */
export interface ContractBackend {
  name: string;
  make(clock: FakeClock, random?: () => number): Backend;
  setup?(): Promise<void>;
  teardown?(): Promise<void>;
}

/** The URL of the test Redis, or an error saying how to get one. Never a skip. */
export function redisUrl(): string {
  const url = inject("redisUrl");
  if (!url) throw new Error(inject("redisError") || "no Redis for the Redis suites");
  return url;
}

/** A client that fails fast, as the Redis suites want: no retries, no offline queue. */
export function testClient(url = redisUrl()): Redis {
  return new Redis(url, { maxRetriesPerRequest: 0, enableOfflineQueue: false, lazyConnect: true });
}

function redisBackend(): ContractBackend {
  let client: Redis | undefined;
  let subscriber: Redis | undefined;
  return {
    name: "redis",
    async setup() {
      client = testClient();
      subscriber = testClient();
      await Promise.all([client.connect(), subscriber.connect()]);
    },
    async teardown() {
      await Promise.all([client?.quit(), subscriber?.quit()]);
    },
    make(clock, random) {
      if (!client || !subscriber) throw new Error("the Redis contract backend was not set up");
      return redis(client, {
        prefix: `contract:${randomUUID()}:`,
        clock,
        time: "clock",
        subscriber,
        ...(random ? { random } : {}),
      });
    },
  };
}

export const backends: ContractBackend[] = [
  { name: "memory", make: (clock, random) => memory({ clock, ...(random ? { random } : {}) }) },
  redisBackend(),
];

/** Set a backend up before its suite and tear it down after. */
export function useBackend(backend: ContractBackend): void {
  beforeAll(async () => backend.setup?.());
  afterAll(async () => backend.teardown?.());
}

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
