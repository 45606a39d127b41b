/**
 * A TCP proxy on a free loopback port that holds every chunk for a delay in each direction, as a
 * Redis in another zone would: run as a child process of the `redis-away` benchmark, so its
 * timers do not share the measured process's event loop. Argv: the Redis URL, the delay (ms).
 * Tells its parent `{ port }` once it listens.
 */
import { connect, createServer, type Socket } from "node:net";

const target = new URL(process.argv[2]!);
const delayMs = Number(process.argv[3]);
if (target.hostname !== "127.0.0.1" && target.hostname !== "localhost") {
  throw new Error(`delay-proxy: loopback only, not ${target.hostname}`);
}

/** Each chunk from `from` written to `to` after the delay, in order (timers of one delay fire in turn). */
function pipeDelayed(from: Socket, to: Socket): void {
  from.on("data", (chunk) => setTimeout(() => to.write(chunk), delayMs));
  from.on("end", () => setTimeout(() => to.end(), delayMs));
  from.on("error", () => to.destroy());
}

const server = createServer((client) => {
  client.setNoDelay(true);
  const upstream = connect(Number(target.port || 6379), target.hostname);
  upstream.setNoDelay(true);
  pipeDelayed(client, upstream);
  pipeDelayed(upstream, client);
});
server.listen(0, "127.0.0.1", () => {
  const address = server.address();
  if (address === null || typeof address === "string") throw new Error("delay-proxy: no port");
  process.send?.({ port: address.port });
});
process.on("disconnect", () => process.exit(0));
