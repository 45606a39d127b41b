// A misspelt per-call option is refused by name, not ignored.
import { InvalidOptionsError, memory } from "floodgate";

const stage = memory().semaphore("strict", { limit: 1 });
let refusal: unknown;
try {
  // @ts-expect-error: the option is timeoutMs
  const ticket = await stage.admit({ timeoutMS: 10 });
  await ticket.release();
} catch (error) {
  refusal = error;
}
if (refusal === undefined) throw new Error("admit({ timeoutMS: 10 }) admitted the call");
if (!(refusal instanceof InvalidOptionsError)) {
  throw new Error(`admit({ timeoutMS: 10 }) rejected with something else: ${String(refusal)}`);
}
if (!refusal.message.includes("timeoutMS")) {
  throw new Error(`the refusal does not name timeoutMS: ${refusal.message}`);
}
await stage.close();
console.log(`InvalidOptionsError: ${refusal.message}`);
