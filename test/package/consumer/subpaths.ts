// Every subpath, imported as ESM, with the types a dependent package sees.

import { type Backend, Gate, memory, type Outcome, type Stage } from "floodgate";
import { type FetchGate, parseRetryAfter, wrapFetch } from "floodgate/fetch";
import { instrument, METRICS } from "floodgate/otel";
import { type RedisBackendOptions, stageKey } from "floodgate/redis";
import { FakeClock } from "floodgate/testing";
import { floodgateInterceptor, type InterceptorOptions } from "floodgate/undici";

const clock = new FakeClock();
const backend: Backend = memory({ clock });
const stages: Stage[] = [backend.semaphore("subpaths", { limit: 1 })];
const gate: FetchGate = new Gate(stages);
const fetch = wrapFetch(gate, async (_url: string) => ({ status: 200, headers: new Headers() }));
const response = await fetch("http://127.0.0.1/");
const outcome: Outcome = response.status === 200 ? "success" : "dropped";
const options: RedisBackendOptions = { prefix: "p:" };
const interceptor: typeof floodgateInterceptor = floodgateInterceptor;
const interceptorOptions: Partial<InterceptorOptions> = {};
if (typeof interceptor !== "function" || typeof interceptorOptions !== "object") throw new Error("undici");
const retryAfter = parseRetryAfter({ "retry-after": "5" });
if (retryAfter !== 5_000) throw new Error(`parseRetryAfter gave ${retryAfter} for "5"`);
// With no SDK registered, the global meter is a no-op: nothing is recorded.
const instrumented = instrument(stages);
if (METRICS.admissions !== "floodgate.admissions") throw new Error("otel");
instrumented.close();
await backend.close();
console.log(`${outcome}, ${stageKey(options.prefix!, "s", "k")}`);
