/**
 * The names of the process warnings Node emits while `fn` runs, or by the turn of the event loop
 * after it (a warning is emitted on a later tick than the code that causes it).
 */
export async function warningsDuring(fn: () => Promise<void>): Promise<string[]> {
  const warnings: string[] = [];
  const onWarning = (w: Error) => warnings.push(w.name);
  process.on("warning", onWarning);
  try {
    await fn();
    await new Promise((resolve) => setImmediate(resolve));
  } finally {
    process.off("warning", onWarning);
  }
  return warnings;
}
