import { type ChildProcess, execFile, execFileSync, spawn } from "node:child_process";
import { once } from "node:events";
import { mkdir, mkdtemp, rm } from "node:fs/promises";
import { createServer, type Server, Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";

const run = promisify(execFile);

/** A free TCP port on 127.0.0.1. */
export async function freePort(): Promise<number> {
  const [port] = await freePorts(1);
  return port!;
}

/** Listen on `port` (0: any free one) on 127.0.0.1 into `held`; the port, or undefined when taken. */
async function hold(port: number, held: Server[]): Promise<number | undefined> {
  const server = createServer();
  server.listen(port, "127.0.0.1");
  const ok = await Promise.race([
    once(server, "listening").then(() => true),
    once(server, "error").then(() => false),
  ]);
  if (!ok) return undefined;
  held.push(server);
  const address = server.address();
  return typeof address === "object" && address ? address.port : undefined;
}

/** Close every server in `held`. */
async function release(held: readonly Server[]): Promise<void> {
  await Promise.all(
    held.map(async (server) => {
      server.close();
      await once(server, "close");
    }),
  );
}

/** `count` distinct free TCP ports on 127.0.0.1 (all held open at once, then released). */
export async function freePorts(count: number): Promise<number[]> {
  const held: Server[] = [];
  try {
    const ports: number[] = [];
    for (let i = 0; i < count; i++) {
      const port = await hold(0, held);
      if (port === undefined) throw new Error("no free loopback port");
      ports.push(port);
    }
    return ports;
  } finally {
    await release(held);
  }
}

/**
 * `count` free TCP ports on 127.0.0.1 whose port + 10000 is free too (each held open while the
 * next is found, then all released): the cluster bus ports of servers before Redis 7.0, which
 * cannot be given one (`--cluster-port`).
 */
async function freePortsWithBus(count: number): Promise<number[]> {
  const held: Server[] = [];
  const found: number[] = [];
  try {
    for (let tries = 0; found.length < count; tries++) {
      if (tries > 200) throw new Error(`no ${count} free loopback ports with port + 10000 free`);
      const port = 20_000 + Math.floor(Math.random() * 35_000);
      if ((await hold(port, held)) === undefined) continue;
      if ((await hold(port + 10_000, held)) !== undefined) found.push(port);
    }
    return found;
  } finally {
    await release(held);
  }
}

/** Resolves once something answers PING on the port, or throws after `timeoutMs`. */
export async function waitForRedis(port: number, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const ok = await new Promise<boolean>((resolve) => {
      const socket = new Socket();
      socket.setTimeout(500);
      socket.once("error", () => resolve(false));
      socket.once("timeout", () => {
        socket.destroy();
        resolve(false);
      });
      socket.connect(port, "127.0.0.1", () => socket.write("PING\r\n"));
      socket.once("data", (data) => {
        socket.destroy();
        resolve(String(data).startsWith("+PONG"));
      });
    });
    if (ok) return;
    if (Date.now() > deadline) throw new Error(`redis-server on 127.0.0.1:${port} did not answer PING`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

export const INSTALL_HINT =
  "The Redis suites need a real redis-server. Install one (Debian/Ubuntu: `apt-get install -y redis-server`, " +
  "macOS: `brew install redis`) so the tests can start it on a free loopback port, or point REDIS_URL at " +
  "one you run (REDIS_URL=redis://127.0.0.1:6379). Without FLOODGATE_NO_INSTALL, the suite installs one " +
  "itself where that needs no person (as root or with passwordless sudo through apt-get, or with brew).";

export const CLUSTER_INSTALL_HINT =
  "The Redis Cluster suites need `redis-server` and `redis-cli` (Debian/Ubuntu: `apt-get install -y " +
  "redis-server`, macOS: `brew install redis`) so the tests can start a three-node cluster on free loopback " +
  "ports, or point REDIS_CLUSTER_NODES at one you run " +
  "(REDIS_CLUSTER_NODES=127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002).";

function have(binary: string): boolean {
  try {
    execFileSync(binary, ["--version"], { stdio: "ignore" });
    return true;
  } catch {
    return false;
  }
}

/** The major version of the `redis-server` on the PATH (7 for 7.0.15), read once. */
let major: number | undefined;
function redisServerMajor(): number {
  if (major === undefined) {
    const said = execFileSync("redis-server", ["--version"], { encoding: "utf8" });
    major = Number(/\bv=(\d+)\./.exec(said)?.[1]);
    if (!Number.isInteger(major)) throw new Error(`redis-server --version said no version: ${said}`);
  }
  return major;
}

/**
 * `args` as a `redis-server` before 7.0 takes them: without `--enable-debug-command` (it has
 * `DEBUG` always), which it would refuse to start with.
 */
function argsFor(args: readonly string[]): string[] {
  if (redisServerMajor() >= 7) return [...args];
  const out: string[] = [];
  for (let i = 0; i < args.length; i++) {
    if (args[i] === "--enable-debug-command") i++;
    else out.push(args[i]!);
  }
  return out;
}

/** True when a `redis-server` binary is on the PATH. */
export function haveRedisServer(): boolean {
  return have("redis-server");
}

/** How this machine could install redis-server without a person, or undefined when it cannot. */
export function installCommand(): string[][] | undefined {
  if (process.platform === "darwin" && have("brew")) return [["brew", "install", "redis"]];
  if (process.platform !== "linux" || !have("apt-get")) return undefined;
  const root = process.getuid?.() === 0;
  let sudo = false;
  if (!root && have("sudo")) {
    try {
      execFileSync("sudo", ["-n", "true"], { stdio: "ignore" });
      sudo = true;
    } catch {
      // sudo would ask for a password: a person is needed.
    }
  }
  if (!root && !sudo) return undefined;
  const as = (argv: string[]) => (root ? argv : ["sudo", "-n", ...argv]);
  return [as(["apt-get", "update"]), as(["apt-get", "install", "-y", "redis-server"])];
}

/**
 * Install redis-server where that needs no person (as root or with passwordless sudo through
 * apt-get, or with brew on macOS), unless `FLOODGATE_NO_INSTALL` is set. Says so in one line.
 * Resolves true when redis-server is then on the PATH.
 */
export async function installRedis(log: (line: string) => void = console.log): Promise<boolean> {
  if (process.env.FLOODGATE_NO_INSTALL) return false;
  const steps = installCommand();
  if (!steps) return false;
  log(
    `redis-server was not found: installing it with \`${steps.map((s) => s.join(" ")).join(" && ")}\` (set FLOODGATE_NO_INSTALL=1 to forbid this)`,
  );
  try {
    for (const [cmd, ...args] of steps) {
      await run(cmd!, args, {
        env: { ...process.env, DEBIAN_FRONTEND: "noninteractive" },
        maxBuffer: 64 * 1024 * 1024,
      });
    }
  } catch (error) {
    log(`installing redis-server failed: ${error instanceof Error ? error.message.split("\n")[0] : error}`);
    return false;
  }
  return haveRedisServer();
}

/** True when a `redis-cli` binary is on the PATH. */
export function haveRedisCli(): boolean {
  return have("redis-cli");
}

/** A throwaway redis-server on 127.0.0.1 with no persistence. */
/** Servers still running: killed when this process exits (one exit listener for them all). */
const running = new Set<ChildProcess>();
let exitHooked = false;

function killOnExit(child: ChildProcess): void {
  running.add(child);
  if (exitHooked) return;
  exitHooked = true;
  process.once("exit", () => {
    for (const c of running) c.kill("SIGKILL");
  });
}

export class RedisProcess {
  child: ChildProcess | undefined;
  constructor(
    readonly port: number,
    readonly extraArgs: string[] = [],
  ) {}

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  async start(): Promise<void> {
    const child = spawn(
      "redis-server",
      [
        "--port",
        String(this.port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "yes",
        ...argsFor(this.extraArgs),
      ],
      { stdio: "ignore" },
    );
    this.child = child;
    killOnExit(child);
    const exited = once(child, "exit").then(([code]) => {
      throw new Error(`redis-server on 127.0.0.1:${this.port} exited with code ${code} while starting`);
    });
    exited.catch(() => {});
    await Promise.race([waitForRedis(this.port), exited]);
  }

  async stop(): Promise<void> {
    const child = this.child;
    if (child) running.delete(child);
    this.child = undefined;
    if (!child || child.exitCode !== null || child.signalCode !== null) return;
    child.kill("SIGKILL");
    await once(child, "exit");
  }
}

/**
 * Runs `redis-cli` against 127.0.0.1 and returns its output. A failure says why: killed at
 * `timeoutMs`, or its exit code, with the end of what it printed.
 */
async function cli(args: string[], timeoutMs = 10_000): Promise<string> {
  try {
    const { stdout } = await run("redis-cli", args, { timeout: timeoutMs });
    return stdout;
  } catch (error) {
    const e = error as { killed?: boolean; code?: unknown; stdout?: string; stderr?: string };
    const why = e.killed ? `killed after ${timeoutMs} ms` : `exit code ${String(e.code)}`;
    const said = `${e.stdout ?? ""}${e.stderr ?? ""}`.trim().split("\n").slice(-5).join(" | ");
    throw new Error(`redis-cli ${args.join(" ")}: ${why}${said ? `; it said: ${said}` : ""}`, {
      cause: error,
    });
  }
}

/**
 * A throwaway Redis Cluster of three masters (no replicas) on free loopback ports, each node with
 * its own data directory and cluster bus port under one temporary directory.
 */
export class RedisCluster {
  readonly nodes: RedisProcess[] = [];
  #dir: string | undefined;

  /** `127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`. */
  get nodeList(): string {
    return this.nodes.map((node) => `127.0.0.1:${node.port}`).join(",");
  }

  /** Start `size` masters, each with `extraArgs` for its `redis-server` too. */
  async start(size = 3, extraArgs: readonly string[] = []): Promise<void> {
    try {
      const dir = await mkdtemp(join(tmpdir(), "floodgate-cluster-"));
      this.#dir = dir;
      // A data port and a cluster bus port per node: the default bus port (port + 10000) may not
      // exist for an ephemeral port, or may be taken. (Before Redis 7.0 it is always port + 10000:
      // ports are chosen so that it is free.)
      const busPort = redisServerMajor() >= 7;
      const ports = busPort ? await freePorts(size * 2) : await freePortsWithBus(size);
      for (let i = 0; i < size; i++) {
        const port = ports[i]!;
        const nodeDir = join(dir, String(port));
        await mkdir(nodeDir);
        this.nodes.push(
          new RedisProcess(port, [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            join(dir, `nodes-${port}.conf`),
            "--cluster-node-timeout",
            "5000",
            ...(busPort ? ["--cluster-port", String(ports[size + i]!)] : []),
            "--dir",
            nodeDir,
            ...extraArgs,
          ]),
        );
      }
      await Promise.all(this.nodes.map((node) => node.start()));
      // (It waits for the nodes to agree, polling once a second: room for a loaded machine.)
      await cli(
        [
          "--cluster",
          "create",
          ...this.nodes.map((node) => `127.0.0.1:${node.port}`),
          "--cluster-replicas",
          "0",
          "--cluster-yes",
        ],
        30_000,
      );
      await this.waitForOk();
    } catch (error) {
      await this.stop();
      throw error;
    }
  }

  /** Waits until `CLUSTER INFO` says `cluster_state:ok` on every node. */
  async waitForOk(timeoutMs = 10_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const states = await Promise.all(
        this.nodes.map((node) =>
          cli(["-h", "127.0.0.1", "-p", String(node.port), "cluster", "info"]).catch(() => ""),
        ),
      );
      if (states.every((info) => /^cluster_state:ok\r?$/m.test(info))) return;
      if (Date.now() > deadline) {
        throw new Error(`the Redis Cluster on ${this.nodeList} did not reach cluster_state:ok`);
      }
      await new Promise((r) => setTimeout(r, 50));
    }
  }

  async stop(): Promise<void> {
    await Promise.all(this.nodes.map((node) => node.stop()));
    if (this.#dir) await rm(this.#dir, { recursive: true, force: true });
    this.#dir = undefined;
  }
}
