export { stageKey } from "./keys.js";
