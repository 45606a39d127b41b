/**
 * A floor for a fused Redis gate: what no fused gate can beat on this machine. One hand-written
 * script does only the commands an uncontended admission of the four stages needs (the semaphore's
 * and the AIMD limiter's leases and counts, the bucket's tokens, the host's slot), decided for a
 * turn of callers in one call, with one flat reply; another releases a turn the same way. The
 * client keeps one promise per call. No lines, no reaping, no fencing checks, no quarantine, no
 * lanes, no grants, no renewal: a real gate does all of that too, so it can only cost more.
 * With one stage it is the floor of a semaphore the same way. Used by the redis-gate benchmark.
 */
import { randomBytes } from "node:crypto";
import type { Redis } from "ioredis";

/**
 * KEYS: the semaphore's holders and meta; with four stages also the AIMD limiter's holders and
 * meta, the bucket and the host. ARGV: "a" (admit) or "r" (release), leaseMs, the semaphore's
 * limit, the AIMD limiter's initial limit and max, the bucket's capacity and refill per ms, the
 * host's interval (ms), then the turn's members. Admit returns each admitted member's two fences
 * (flat), then the server's time; those not admitted ask again.
 */
const SCRIPT = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local four = #KEYS == 6
local s = redis.call('HMGET', KEYS[2], 'used', 'seq')
local sUsed, sSeq = tonumber(s[1]) or 0, tonumber(s[2]) or 0
local aUsed, aSeq, aLimit, aMax = 0, 0, 0, tonumber(ARGV[5])
if four then
  local a = redis.call('HMGET', KEYS[4], 'used', 'seq', 'limit')
  aUsed, aSeq, aLimit = tonumber(a[1]) or 0, tonumber(a[2]) or 0, tonumber(a[3]) or tonumber(ARGV[4])
end
if ARGV[1] == 'r' then
  for i = 9, #ARGV do
    if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then sUsed = sUsed - 1 end
    if four and redis.call('ZREM', KEYS[3], ARGV[i]) == 1 then
      aUsed = aUsed - 1
      aLimit = math.min(aMax, aLimit + 1 / aLimit)
    end
  end
  redis.call('HSET', KEYS[2], 'used', sUsed)
  if four then redis.call('HSET', KEYS[4], 'used', aUsed, 'limit', aLimit) end
  return 1
end
local lease, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, cap, refill, gap, nextAt = 0, 0, 0, 0, 0
if four then
  local b = redis.call('HMGET', KEYS[5], 'tokens', 'ts')
  cap, refill, gap = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
  tokens = math.min(cap, (tonumber(b[1]) or cap) + (now - (tonumber(b[2]) or now)) * refill)
  nextAt = tonumber(redis.call('HGET', KEYS[6], 'nextAt')) or 0
end
local out = {}
for i = 9, #ARGV do
  if sUsed + 1 > limit then break end
  if four and (aUsed + 1 > aLimit or tokens < 1 or nextAt > now) then break end
  redis.call('ZADD', KEYS[1], now + lease, ARGV[i])
  sUsed, sSeq = sUsed + 1, sSeq + 1
  out[#out + 1] = sSeq
  if four then
    redis.call('ZADD', KEYS[3], now + lease, ARGV[i])
    aUsed, aSeq, tokens = aUsed + 1, aSeq + 1, tokens - 1
    if gap > 0 then nextAt = now + gap end
    out[#out + 1] = aSeq
  end
end
if #out > 0 then
  redis.call('HSET', KEYS[2], 'used', sUsed, 'seq', sSeq)
  if four then
    redis.call('HSET', KEYS[4], 'used', aUsed, 'seq', aSeq, 'limit', aLimit)
    redis.call('HSET', KEYS[5], 'tokens', tokens, 'ts', now)
    redis.call('PEXPIRE', KEYS[5], 60000)
    redis.call('HSET', KEYS[6], 'nextAt', now + gap)
    redis.call('PEXPIRE', KEYS[6], 60000)
  end
end
out[#out + 1] = now
return out
`;

interface Pending {
  member: string;
  resolve: () => void;
  reject: (error: unknown) => void;
}

/**
 * Calls of one kind (admit or release), sent as the library sends its own: every call waits for
 * the end of the turn of the event loop it was made in (`process.nextTick`) and goes with that
 * turn's others, up to `MAX_TURN` to a script call, whether or not an earlier script call is out.
 * Those the script leaves out (a turn's admissions stop at the first that does not fit) go with
 * the next turn.
 */
class Turns {
  #pending: Pending[] = [];
  #queued = false;
  constructor(private readonly send: (members: string[]) => Promise<number>) {}

  add(member: string): Promise<void> {
    return new Promise((resolve, reject) => this.#queue({ member, resolve, reject }));
  }

  readonly #go = (): void => {
    this.#queued = false;
    const all = this.#pending;
    this.#pending = [];
    for (let from = 0; from < all.length; from += MAX_TURN) this.#send(all.slice(from, from + MAX_TURN));
  };

  #send(turn: Pending[]): void {
    this.send(turn.map((p) => p.member)).then(
      (done) => {
        for (let i = 0; i < turn.length; i++) {
          if (i < done) turn[i]!.resolve();
          else this.#queue(turn[i]!);
        }
      },
      (error: unknown) => {
        for (const p of turn) p.reject(error);
      },
    );
  }

  /** Send `p` with this turn's others (the next turn's, for one a script call left out). */
  #queue(p: Pending): void {
    this.#pending.push(p);
    if (!this.#queued) {
      this.#queued = true;
      process.nextTick(this.#go);
    }
  }
}

/** The most calls one script call takes, as the library's batches. */
const MAX_TURN = 32;

/** The floor's admit-and-release of one call, for `stages` 1 (a semaphore) or 4, none binding. */
export function floorGate(client: Redis, prefix: string, stages: 1 | 4): () => Promise<void> {
  const loaded = client.script("LOAD", SCRIPT) as Promise<string>;
  const keys = [`${prefix}sem:holders`, `${prefix}sem:meta`];
  if (stages === 4)
    keys.push(`${prefix}aimd:holders`, `${prefix}aimd:meta`, `${prefix}rate`, `${prefix}host`);
  const config = ["60000", "1000000", "1000000", "1000000", String(2 ** 31 - 1), "1000000", "0"];
  const call = (op: string) => async (members: string[]) =>
    client.evalsha(await loaded, keys.length, ...keys, op, ...config, ...members) as Promise<unknown>;
  const admit = call("a");
  const release = call("r");
  const admits = new Turns(async (members) => {
    const reply = (await admit(members)) as number[];
    return (reply.length - 1) / (stages === 4 ? 2 : 1);
  });
  const releases = new Turns(async (members) => {
    await release(members);
    return members.length;
  });
  const token = randomBytes(6).toString("hex");
  let n = 0;
  return async () => {
    const member = `${token}-${++n}`;
    await admits.add(member);
    await releases.add(member);
  };
}
