import type { Clock } from "../clock.js";
import type { FusionHost } from "../fuse.js";
import type { Logger } from "../types.js";
import type { RedisLink } from "./link.js";

/** What a Redis stage needs from its backend. */
export interface RedisContext {
  link: RedisLink;
  prefix: string;
  clock: Clock;
  logger: Logger | undefined;
  random: () => number;
  /** Longest a waiter goes without asking Redis again (covers a lost pub/sub message), ms. */
  pollMs: number;
  /** How long a sign of life of this process lasts in Redis, ms (see `livenessMs`). */
  livenessMs: number;
  /** Longest a permit granted to a waiter on a release stays unclaimed, ms (see `claimMs`). */
  claimMs: number;
  /** Decides a Gate of this backend's stages in one call; absent on a Cluster. */
  fusion: FusionHost | undefined;
}
