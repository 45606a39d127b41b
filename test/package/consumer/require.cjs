// The package from CommonJS: require() of its ES modules (Node 20.19+, 22.12+).
const { memory } = require("floodgate");
const { stageKey } = require("floodgate/redis");
const { FakeClock } = require("floodgate/testing");

(async () => {
  const clock = new FakeClock(1_000);
  const stage = memory({ clock }).semaphore("cjs", { limit: 1 });
  const ticket = await stage.tryAdmit();
  if (!ticket) throw new Error("tryAdmit refused the first call");
  if ((await stage.tryAdmit()) !== undefined) throw new Error("tryAdmit admitted past the limit");
  await ticket.release("success");
  await stage.close();
  const key = stageKey("p:", "s", "k");
  if (key !== "p:{s}:k") throw new Error(`stageKey gave ${key}`);
  console.log(`memory, stageKey and FakeClock (now ${clock.now()}) through require()`);
})().catch((error) => {
  console.error(error);
  process.exit(1);
});
