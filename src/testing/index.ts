export { FakeClock } from "./fake-clock.js";
