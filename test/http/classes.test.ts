// A call's traffic class, given per call to wrapFetch (`init.floodgate.class`) and to the undici
// interceptor (`opts.floodgate.class`), reaches the gate's stages with classes.
import { Gate, memory } from "floodgate";
import { wrapFetch } from "floodgate/fetch";
import { FakeClock } from "floodgate/testing";
import { floodgateInterceptor } from "floodgate/undici";
import { Agent, request } from "undici";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { TestServer } from "./server.js";

let server: TestServer;
let agent: Agent;

beforeEach(async () => {
  server = await new TestServer().start();
  agent = new Agent();
});

afterEach(async () => {
  await agent.destroy();
  await server.close();
});

/** A gate of one semaphore with two classes and no default class. */
function classGate() {
  const sem = memory({ clock: new FakeClock() }).semaphore("sem", {
    limit: 4,
    classes: { interactive: { share: 3 }, bulk: { share: 1 } },
  });
  return { sem, gate: new Gate([sem]) };
}

type Send = (gate: Gate, url: string, cls: string | undefined) => Promise<unknown>;

const senders: Array<[string, Send]> = [
  [
    "wrapFetch",
    async (gate, url, cls) => {
      const res = await wrapFetch(gate)(url, cls === undefined ? {} : { floodgate: { class: cls } });
      await res.text();
    },
  ],
  [
    "floodgateInterceptor",
    async (gate, url, cls) => {
      const dispatcher = agent.compose(floodgateInterceptor(gate));
      const floodgate = cls === undefined ? {} : { floodgate: { class: cls } };
      const res = await request(url, { dispatcher, ...floodgate } as Parameters<typeof request>[1]);
      await res.body.dump();
    },
  ],
];

describe.each(senders)("a call's class through %s", (_name, send) => {
  it("goes to the class it names", async () => {
    const { sem, gate } = classGate();
    await send(gate, server.url, "bulk");
    await send(gate, server.url, "interactive");
    await send(gate, server.url, "interactive");
    expect(sem.snapshot().classes).toMatchObject({ interactive: { admitted: 2 }, bulk: { admitted: 1 } });
    expect(server.received).toHaveLength(3);
  });

  it("is refused, naming the field, when it names no class of the gate, or none is given", async () => {
    const { gate } = classGate();
    await expect(send(gate, server.url, "batch")).rejects.toMatchObject({ field: "class" });
    await expect(send(gate, server.url, undefined)).rejects.toMatchObject({ field: "class" });
    expect(server.received).toHaveLength(0);
  });
});
