import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { commandName, redis, SCRIPTS, type ScriptName, scriptSha, scriptSource } from "floodgate/redis";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { redisUrl } from "../contract/backends.js";
import { closeClient, connectedClient, ROOT, randomPrefix } from "./helpers.js";

const LUA_DIR = join(ROOT, "lua");
const luaFiles = readdirSync(LUA_DIR)
  .filter((file) => file.endsWith(".lua") && file !== "prelude.lua")
  .map((file) => file.slice(0, -".lua".length))
  .sort();
const names = Object.keys(SCRIPTS).sort() as ScriptName[];

/** The comment block a script starts with (its leading `--` lines, blank comment lines included). */
function header(name: string): string {
  const lines = readFileSync(join(LUA_DIR, `${name}.lua`), "utf8").split("\n");
  const block: string[] = [];
  for (const line of lines) {
    if (!line.startsWith("--")) break;
    block.push(line);
  }
  return block.join("\n");
}

/** Distinct `KEYS[i]` / `ARGV[i]` indexes mentioned in `text`. */
function indexes(text: string, table: "KEYS" | "ARGV"): number[] {
  const found = new Set<number>();
  for (const m of text.matchAll(new RegExp(`${table}\\[(\\d+)\\]`, "g"))) found.add(Number(m[1]));
  return [...found].sort((a, b) => a - b);
}

describe("Lua scripts on disk", () => {
  it("registers every file in lua/ except the prelude, and nothing else", () => {
    expect(luaFiles.length).toBeGreaterThan(0);
    expect(names).toEqual(luaFiles);
  });

  it.each(luaFiles)("%s starts with a comment block listing its KEYS and ARGV", (name) => {
    const block = header(name);
    expect(block, `lua/${name}.lua must start with a comment block`).not.toBe("");
    expect(block).toContain("KEYS[1]");
    expect(block).toContain("ARGV[1]");
  });

  it.each(luaFiles)("%s documents every KEYS and ARGV it reads, and numberOfKeys matches", (name) => {
    const body = readFileSync(join(LUA_DIR, `${name}.lua`), "utf8").slice(header(name).length);
    const documentedKeys = indexes(header(name), "KEYS");
    const documentedArgs = indexes(header(name), "ARGV");
    for (const i of indexes(body, "KEYS")) expect(documentedKeys, `KEYS[${i}] of ${name}`).toContain(i);
    for (const i of indexes(body, "ARGV")) expect(documentedArgs, `ARGV[${i}] of ${name}`).toContain(i);
    // ioredis splits KEYS from ARGV by numberOfKeys: it must be the number of keys documented.
    expect(documentedKeys).toEqual(Array.from({ length: SCRIPTS[name as ScriptName] }, (_, i) => i + 1));
  });
});

describe("Lua scripts on Redis", () => {
  let client: Redis;
  let admin: Redis;

  beforeAll(async () => {
    const url = redisUrl();
    client = await connectedClient(url);
    admin = await connectedClient(url);
  });

  afterAll(async () => {
    await Promise.all([closeClient(client), closeClient(admin)]);
  });

  it("defines every script as a command on the client once a backend is built", async () => {
    const backend = redis(client, { prefix: randomPrefix("scripts") });
    try {
      for (const name of names) {
        expect(typeof (client as unknown as Record<string, unknown>)[commandName(name)], name).toBe(
          "function",
        );
      }
    } finally {
      await backend.close();
    }
  });

  it.each(names)("scriptSha(%s) is the SHA that SCRIPT LOAD returns", async (name) => {
    const sha = await admin.script("LOAD", scriptSource(name));
    expect(sha).toBe(scriptSha(name));
    expect(scriptSha(name)).toMatch(/^[0-9a-f]{40}$/);
  });

  it("keeps admitting after SCRIPT FLUSH (the client resends the script on NOSCRIPT)", async () => {
    const backend = redis(client, { prefix: randomPrefix("flush") });
    try {
      const sem = backend.semaphore("sem", { limit: 1, leaseMs: 10_000 });
      const bucket = backend.tokenBucket("bucket", { capacity: 10, refillPerSecond: 1 });
      const spacing = backend.intervalGate("hosts", { minIntervalMs: 1 });

      const first = await sem.admit();
      await bucket.admit();
      await spacing.admit({ host: "a" });

      await admin.script("FLUSH");
      const [acquireLoaded] = (await admin.script("EXISTS", scriptSha("semaphore-acquire"))) as number[];
      expect(acquireLoaded).toBe(0);

      // The release and the following acquire both run on a server that has forgotten them.
      await first.release("success");
      const second = await sem.tryAdmit();
      expect(second).toBeDefined();
      expect(await sem.tryAdmit()).toBeUndefined(); // the limit still holds
      await second!.release("success");
      await expect(bucket.tryAdmit()).resolves.toBeDefined();
      await expect(spacing.tryAdmit({ host: "b" })).resolves.toBeDefined();

      const loaded = (await admin.script(
        "EXISTS",
        scriptSha("semaphore-acquire"),
        scriptSha("semaphore-release"),
        scriptSha("token-bucket-take"),
        scriptSha("interval-gate-take"),
      )) as number[];
      expect(loaded).toEqual([1, 1, 1, 1]);
    } finally {
      await backend.close();
    }
  });
});
