// A memory Gate, as a dependent package uses it.
import { Gate, memory } from "floodgate";

const backend = memory();
const gate = new Gate([
  backend.tokenBucket("rate", { capacity: 5, refillPerSecond: 500 }),
  backend.semaphore("inflight", { limit: 2 }),
]);

let inFlight = 0;
let most = 0;
const results = await Promise.all(
  Array.from({ length: 12 }, (_, i) =>
    gate.run(async () => {
      inFlight++;
      most = Math.max(most, inFlight);
      await new Promise((resolve) => setTimeout(resolve, 5));
      inFlight--;
      return i;
    }),
  ),
);
if (results.join(",") !== Array.from({ length: 12 }, (_, i) => i).join(",")) {
  throw new Error(`unexpected results: ${results.join(",")}`);
}
if (most > 2) throw new Error(`${most} calls ran at once under a limit of 2`);
const { admitted } = gate.snapshot();
await backend.close();
console.log(`12 calls, at most ${most} at once, ${admitted} admitted`);
