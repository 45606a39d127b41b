import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { Redis } from "ioredis";

const PEERS = [
  "p-limit",
  "p-queue",
  "cockatiel",
  "bottleneck",
  "rate-limiter-flexible",
  "limiter",
  "redis-semaphore",
  "ioredis",
  "undici",
];

const require = createRequire(import.meta.url);

function installed(name: string): string {
  try {
    const dir = require.resolve(`${name}/package.json`);
    return (JSON.parse(readFileSync(dir, "utf8")) as { version: string }).version;
  } catch {
    // Packages whose exports hide package.json: find it under node_modules.
    try {
      const path = new URL(`../node_modules/${name}/package.json`, import.meta.url);
      return (JSON.parse(readFileSync(path, "utf8")) as { version: string }).version;
    } catch {
      return "?";
    }
  }
}

/** A line naming floodgate's, the peers' and (when given) the Redis server's versions. */
export async function versions(redisUrl: string | undefined): Promise<string> {
  const own = (
    JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8")) as {
      version: string;
    }
  ).version;
  const parts = [`floodgate ${own}`, ...PEERS.map((p) => `${p} ${installed(p)}`)];
  if (redisUrl) {
    const client = new Redis(redisUrl, { lazyConnect: true, maxRetriesPerRequest: 1 });
    await client.connect();
    const info = await client.info("server");
    client.disconnect();
    parts.push(`redis-server ${/redis_version:(\S+)/.exec(info)?.[1] ?? "?"} (${redisUrl})`);
  }
  return `Versions: ${parts.join(", ")}.`;
}
