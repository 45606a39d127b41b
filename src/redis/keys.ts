/**
 * Redis keys are built here and nowhere else: `${prefix}{${stage}}:${part}`. The `{stage}` hash
 * tag puts every key of one stage in one Redis Cluster slot, which multi-key scripts require.
 */
export function stageKey(prefix: string, stage: string, part: string): string {
  return `${prefix}{${stage}}:${part}`;
}
