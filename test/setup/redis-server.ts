import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { once } from "node:events";
import { createServer, Socket } from "node:net";

/** A free TCP port on 127.0.0.1. */
export async function freePort(): Promise<number> {
  const server = createServer();
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  const address = server.address();
  const port = typeof address === "object" && address ? address.port : 0;
  server.close();
  await once(server, "close");
  return port;
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
  "one you run (REDIS_URL=redis://127.0.0.1:6379).";

/** True when a `redis-server` binary is on the PATH. */
export function haveRedisServer(): boolean {
  try {
    execFileSync("redis-server", ["--version"], { stdio: "ignore" });
    return true;
  } catch {
    return false;
  }
}

/** A throwaway redis-server on 127.0.0.1 with no persistence. */
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
    this.child = spawn(
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
        ...this.extraArgs,
      ],
      { stdio: "ignore" },
    );
    await waitForRedis(this.port);
  }

  async stop(): Promise<void> {
    const child = this.child;
    if (!child || child.exitCode !== null) return;
    child.kill("SIGKILL");
    await once(child, "exit");
    this.child = undefined;
  }
}
