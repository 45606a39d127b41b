/**
 * Admission primitives (semaphore, token bucket, bounded queue, interval gate, AIMD limiter),
 * the memory backend that builds them, and `Gate`, which chains them.
 *
 * @module floodgate
 */
export {
  type BackendErrorMessage,
  type CallMessage,
  CHANNELS,
  type DrainMessage,
  type GrantMessage,
  type LeaseLostMessage,
  type PauseMessage,
  type ReleaseMessage,
  type ShedMessage,
  type StageMessage,
} from "./channels.js";
export { type Clock, type ClockTimer, systemClock } from "./clock.js";
export {
  autoscalerCeiling,
  type Constraint,
  type DiagnoseOptions,
  type Diagnosis,
  diagnose,
  type StageDiagnosis,
} from "./diagnose.js";
export { type Drainable, type DrainOnSignalsOptions, drainOnSignals } from "./drain.js";
export {
  AdmitTimeoutError,
  BackendUnavailableError,
  ClosedError,
  DrainingError,
  type ErrorCode,
  FloodgateError,
  InvalidOptionsError,
  isFloodgateError,
  LeaseLostError,
  ReclaimedError,
  ShedError,
} from "./errors.js";
export {
  defaultClassify,
  Gate,
  type GateOptions,
  type Job,
  type RunOptions,
  type Settled,
  stageOrderWarning,
} from "./gate.js";
export {
  MemoryAimd,
  type MemoryBackend,
  MemoryIntervalGate,
  MemoryQueue,
  MemorySemaphore,
  MemoryTokenBucket,
  memory,
} from "./memory/index.js";
export type {
  AimdOptions,
  ClassOptions,
  IntervalGateOptions,
  MemoryBackendOptions,
  PenaltyOptions,
  QueueOptions,
  SemaphoreOptions,
  StageOptions,
  TokenBucketOptions,
  TrafficClassOptions,
} from "./options.js";
export type {
  AdmitOptions,
  Backend,
  ClassSnapshot,
  DrainOptions,
  DrainResult,
  FleetSnapshot,
  FlowSnapshot,
  GateSnapshot,
  IntervalGateStage,
  Logger,
  Outcome,
  Snapshot,
  Stage,
  StageKind,
  Ticket,
  TryAdmitOptions,
} from "./types.js";
