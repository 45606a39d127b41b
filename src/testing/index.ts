/**
 * `FakeClock`, a clock that moves only when told, for testing gated code without real waits.
 *
 * @module floodgate/testing
 */
export { FakeClock } from "./fake-clock.js";
