/**
 * The packed package as a dependent project gets it. `npm pack` (which builds) into a temporary
 * directory, checks what the tarball holds, installs it with ioredis, undici, @opentelemetry/api,
 * typescript and @types/node into a new project under the system's temporary directory, then:
 *
 * - type-checks the programs of test/package/consumer/ and the README's `ts run` blocks, strict,
 *   under `module: nodenext` and under `moduleResolution: bundler`;
 * - runs them: in memory, and on a redis-server started on a free loopback port;
 * - requires the package from CommonJS;
 * - closes Redis stages whose client never connected.
 *
 * One line per check; exits non-zero, naming the checks that failed, when any does.
 *
 *   npx tsx test/package/consumer.ts [--keep]    (--keep leaves the temporary project in place)
 */
import { execFile } from "node:child_process";
import {
  copyFileSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { snippets } from "../docs/snippets.js";
import { freePort, haveRedisServer, INSTALL_HINT, RedisProcess } from "../setup/redis-server.js";
import { brokenReadmeLinks, problems, ROOT } from "./contents.js";

const keep = process.argv.includes("--keep");
const npm = process.platform === "win32" ? "npm.cmd" : "npm";
const PROGRAMS = join(ROOT, "test/package/consumer");

interface Ran {
  code: number;
  stdout: string;
  stderr: string;
}

/** Runs a command to its end (or `timeoutMs`); never rejects. */
function sh(command: string, args: string[], cwd: string, env: NodeJS.ProcessEnv = {}, timeoutMs = 120_000) {
  return new Promise<Ran>((resolve) => {
    execFile(
      command,
      args,
      { cwd, env: { ...process.env, ...env }, timeout: timeoutMs, maxBuffer: 64 * 1024 * 1024 },
      (error, stdout, stderr) => {
        const code = error ? (typeof error.code === "number" ? error.code : 1) : 0;
        const timedOut = error && "killed" in error && error.killed ? `\n(killed after ${timeoutMs} ms)` : "";
        resolve({ code, stdout: String(stdout), stderr: String(stderr) + timedOut });
      },
    );
  });
}

/** The last lines of a command's output, for a failure message. */
function tail(ran: Ran, lines = 12): string {
  const text = `${ran.stdout}\n${ran.stderr}`.trim().split("\n");
  return text.slice(-lines).join("\n");
}

class CheckFailed extends Error {}

const results: { name: string; ok: boolean }[] = [];

/** Runs one check and prints its line: `ok`, or `FAIL` with what went wrong below it. */
async function check(name: string, body: () => Promise<string | undefined>): Promise<boolean> {
  const started = performance.now();
  let line: string;
  let ok = true;
  try {
    const detail = await body();
    line = `ok    ${name}${detail ? `: ${detail}` : ""}`;
  } catch (error) {
    ok = false;
    const message = error instanceof CheckFailed ? error.message : String((error as Error)?.stack ?? error);
    line = `FAIL  ${name}\n${message.replace(/^/gm, "      ")}`;
  }
  const ms = Math.round(performance.now() - started);
  const [first, ...rest] = line.split("\n");
  console.log([`${first} (${ms} ms)`, ...rest].join("\n"));
  results.push({ name, ok });
  return ok;
}

function fail(message: string): never {
  throw new CheckFailed(message);
}

/** The version of a package in the repository's node_modules, so the install can use the cache. */
function installed(name: string, fallback: string): string {
  try {
    return JSON.parse(readFileSync(join(ROOT, "node_modules", name, "package.json"), "utf8")).version;
  } catch {
    return fallback;
  }
}

const TSCONFIG = {
  compilerOptions: {
    target: "ES2022",
    strict: true,
    skipLibCheck: false,
    types: ["node"],
    rootDir: "src",
    outDir: "out",
  },
  include: ["src"],
};

async function main(): Promise<void> {
  const started = performance.now();
  const work = mkdtempSync(join(tmpdir(), "floodgate-consumer-"));
  const app = join(work, "app");
  const src = join(app, "src");
  let tarball = "";
  const redisServer = haveRedisServer() ? new RedisProcess(await freePort()) : undefined;
  try {
    console.log(`floodgate as a dependency, in ${work}`);

    const packed = await check("npm pack (builds)", async () => {
      const ran = await sh(npm, ["pack", "--pack-destination", work], ROOT, {}, 300_000);
      if (ran.code !== 0) fail(`npm pack failed:\n${tail(ran)}`);
      const name = readdirSync(work).find((file) => file.endsWith(".tgz"));
      if (!name) fail("npm pack made no tarball");
      tarball = join(work, name);
      return name;
    });
    if (!packed) return;

    let broken: string[] = [];
    await check(
      "the tarball holds dist (with sources in its maps), lua, docs and the top-level files only",
      async () => {
        const unpacked = join(work, "unpacked");
        mkdirSync(unpacked);
        const ran = await sh("tar", ["-xzf", tarball, "-C", unpacked], work);
        if (ran.code !== 0) fail(`tar failed:\n${tail(ran)}`);
        const listed = await sh("tar", ["-tzf", tarball], work);
        const files = listed.stdout
          .split("\n")
          .filter((line) => line && !line.endsWith("/"))
          .map((line) => line.replace(/^package\//, ""))
          .sort();
        const found = problems(files, (path) => readFileSync(join(unpacked, "package", path), "utf8"));
        if (files.includes("README.md")) {
          broken = brokenReadmeLinks(files, readFileSync(join(unpacked, "package/README.md"), "utf8"));
        }
        if (found.length > 0) fail(found.join("\n"));
        return `${files.length} files`;
      },
    );

    if (broken.length > 0) {
      console.log(`note  README.md links to files the package does not hold: ${broken.join(", ")}`);
    }

    mkdirSync(src, { recursive: true });
    writeFileSync(
      join(app, "package.json"),
      `${JSON.stringify({ name: "floodgate-consumer", private: true, type: "module" }, null, 2)}\n`,
    );

    const ready = await check(
      "npm install the tarball, ioredis, undici, @opentelemetry/api, typescript, @types/node",
      async () => {
        const ran = await sh(
          npm,
          [
            "install",
            "--no-audit",
            "--no-fund",
            "--prefer-offline",
            "--loglevel=error",
            tarball,
            `ioredis@${installed("ioredis", "5")}`,
            `undici@${installed("undici", "7")}`,
            `@opentelemetry/api@${installed("@opentelemetry/api", "1")}`,
            `typescript@${installed("typescript", "5")}`,
            `@types/node@${installed("@types/node", "20")}`,
          ],
          app,
          {},
          300_000,
        );
        if (ran.code !== 0) fail(`npm install failed:\n${tail(ran)}`);
        return undefined;
      },
    );
    if (!ready) return;

    // The programs: this directory's, and the README's blocks marked to run.
    const programs: { file: string; label: string; run: "memory" | "redis" }[] = [];
    for (const file of readdirSync(PROGRAMS)) {
      copyFileSync(join(PROGRAMS, file), join(file.endsWith(".cjs") ? app : src, file));
    }
    const readme = snippets(join(ROOT, "README.md"));
    for (const block of readme) {
      if (block.run === "none") continue;
      const file = `readme-${block.line}.ts`;
      writeFileSync(join(src, file), `${block.code}\n`);
      programs.push({
        file,
        label: `README.md:${block.line} (\`ts run${block.run === "redis" ? " redis" : ""}\`)`,
        run: block.run,
      });
    }

    const tsc = join(app, "node_modules/typescript/bin/tsc");
    writeFileSync(
      join(app, "tsconfig.json"),
      JSON.stringify(
        { ...TSCONFIG, compilerOptions: { ...TSCONFIG.compilerOptions, module: "nodenext" } },
        null,
        2,
      ),
    );
    writeFileSync(
      join(app, "tsconfig.bundler.json"),
      JSON.stringify(
        {
          ...TSCONFIG,
          compilerOptions: {
            ...TSCONFIG.compilerOptions,
            module: "esnext",
            moduleResolution: "bundler",
            noEmit: true,
          },
        },
        null,
        2,
      ),
    );
    const checked = readdirSync(src).length;
    // (The two compilers side by side: each runs on one core. The first emits out/, also when it
    // finds errors, which the runs below use.)
    const configs = [
      ["a. types, strict, module nodenext", "tsconfig.json"],
      ["a. types, strict, module esnext, moduleResolution bundler", "tsconfig.bundler.json"],
    ] as const;
    await Promise.all(
      configs.map(([label, config]) =>
        check(label, async () => {
          const ran = await sh(process.execPath, [tsc, "-p", config], app);
          if (ran.code !== 0) fail(tail(ran, 30));
          return `${checked} programs`;
        }),
      ),
    );

    let redisUrl: string | undefined;
    const redisStarted = await check("redis-server on a free loopback port", async () => {
      if (!redisServer) fail(INSTALL_HINT);
      await redisServer.start();
      redisUrl = redisServer.url;
      return redisUrl;
    });

    const node = async (file: string, env: NodeJS.ProcessEnv = {}) => {
      const ran = await sh(process.execPath, [file], app, env, 30_000);
      if (ran.code !== 0) fail(`node ${file} exited with ${ran.code}:\n${tail(ran)}`);
      return ran.stdout.trim().split("\n").at(-1);
    };
    const redisEnv = () => {
      if (!redisStarted || !redisUrl) fail("no redis-server");
      return { REDIS_URL: redisUrl };
    };

    await check("b. memory Gate", () => node("out/memory.js"));
    await check("b. Redis Gate, first call before the client is ready", async () =>
      node("out/redis.js", redisEnv()),
    );
    await check("b. every subpath imported as ESM", () => node("out/subpaths.js"));
    if (programs.length === 0) {
      console.log(
        "note  README.md has no ```ts run block yet: the programs above stand in for its quick starts",
      );
    }
    for (const program of programs) {
      const out = `out/${program.file.replace(/\.ts$/, ".js")}`;
      await check(`b. ${program.label}`, async () => {
        const env = program.run === "redis" ? redisEnv() : {};
        const ran = await sh(process.execPath, [out], app, env, 30_000);
        if (ran.code !== 0) fail(`node ${out} exited with ${ran.code}:\n${tail(ran)}`);
        const lines = ran.stdout.trim() === "" ? 0 : ran.stdout.trim().split("\n").length;
        return `ran, ${lines} line${lines === 1 ? "" : "s"} of output`;
      });
    }
    await check("c. admit({ timeoutMS: 10 }) rejects with InvalidOptionsError naming timeoutMS", () =>
      node("out/strict-options.js"),
    );
    await check('d. require("floodgate"), "floodgate/redis", "floodgate/testing" from a .cjs file', () =>
      node("require.cjs"),
    );
    await check(
      "e. closing Redis stages and backend whose client never connected throws nothing",
      async () => {
        const closed = await freePort();
        const ran = await sh(
          process.execPath,
          ["out/close-unconnected.js"],
          app,
          { CLOSED_PORT: String(closed) },
          30_000,
        );
        if (ran.code !== 0) fail(`exited with ${ran.code}:\n${tail(ran)}`);
        if (/ioredis|unhandled/i.test(ran.stderr))
          fail(`ioredis spoke to the user:\n${tail({ ...ran, stdout: "" })}`);
        return ran.stdout.trim().split("\n").at(-1);
      },
    );
  } finally {
    await redisServer?.stop();
    if (keep) console.log(`kept ${work}`);
    else rmSync(work, { recursive: true, force: true });
    const failed = results.filter((result) => !result.ok);
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    console.log(`consumer checks took ${seconds} s`);
    console.log(`consumer: ${results.length - failed.length} passed, ${failed.length} failed`);
    if (failed.length > 0) {
      console.log(`failed: ${failed.map((result) => result.name).join("; ")}`);
      process.exitCode = 1;
    }
  }
}

await main().catch((error) => {
  console.error(error);
  process.exitCode = 1;
});
