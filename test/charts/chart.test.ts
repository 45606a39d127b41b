import { execFile } from "node:child_process";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { Gate, memory } from "floodgate";
import { describe, expect, it } from "vitest";
import {
  type ChartPoint,
  ChartRecorder,
  chartSpec,
  type ProviderCounters,
  renderChart,
  startChart,
} from "../../examples/chart.js";
import { checkSvg } from "../../examples/check-chart.js";

/** A provider whose counters the test sets by hand. */
function fakeProvider(): ProviderCounters & { inFlight: number; rejected429: number; peak: number } {
  const p = {
    inFlight: 0,
    rejected429: 0,
    peak: 0,
    stats: () => ({ inFlight: p.inFlight, rejected429: p.rejected429, peak: p.peak }),
  };
  return p;
}

/** Synthetic samples: two stages and a provider over two seconds. */
function synthetic(): ChartPoint[] {
  const points: ChartPoint[] = [];
  for (let i = 0; i <= 20; i++) {
    const t = i / 10;
    points.push(
      { t, panel: "in flight", series: "pool", measure: "in flight", value: Math.min(8, i) },
      { t, panel: "in flight", series: "pool", measure: "limit", value: 8 },
      { t, panel: "in flight", series: "provider", measure: "in flight", value: Math.min(8, i) },
      { t, panel: "waiting", series: "pool", measure: "waiting", value: Math.max(0, 12 - i) },
      { t, panel: "waiting", series: "rate", measure: "waiting", value: i % 3 },
      { t, panel: "refused", series: "provider", measure: "429s", value: i === 5 ? 2 : 0 },
    );
  }
  return points;
}

describe("charts", () => {
  it("renders synthetic samples to a well-formed SVG that names every series and the title", async () => {
    const svg = await renderChart({
      title: "synthetic run",
      subtitle: "a test",
      points: synthetic(),
      cap: 8,
    });
    const { problems, texts } = checkSvg(svg, ["pool", "provider", "rate"]);
    expect(problems).toEqual([]);
    expect(svg.startsWith("<svg")).toBe(true);
    expect(texts).toContain("synthetic run");
    expect(texts).toContain("cap 8");
    expect(Number(/<svg[^>]* width="(\d+(?:\.\d+)?)"/.exec(svg)?.[1])).toBeLessThanOrEqual(820);
  });

  it("stacks the panels that have points on one time axis, with the cap as a rule", () => {
    const spec = chartSpec({ title: "t", points: synthetic(), cap: 8, intervalMs: 100 }) as {
      vconcat: { layer: { mark: { type: string }; encoding: { y: { title?: string } } }[] }[];
    };
    expect(spec.vconcat).toHaveLength(3);
    expect(spec.vconcat.map((p) => p.layer[0]!.encoding.y.title)).toEqual([
      "in flight (dashed: limit)",
      "waiting",
      "429s, sheds per 100 ms",
    ]);
    expect(spec.vconcat[0]!.layer.map((l) => l.mark.type)).toEqual(["line", "rule", "text"]);
    const noRefusals = synthetic().filter((p) => p.panel !== "refused");
    expect((chartSpec({ title: "t", points: noRefusals }) as { vconcat: unknown[] }).vconcat).toHaveLength(2);
  });

  it("leaves a line that stays at zero out of the waiting panel, and keeps its legend entry", async () => {
    const points = synthetic().map((p) => (p.series === "rate" ? { ...p, value: 0 } : p));
    const data = (chartSpec({ title: "t", points }) as { data: { values: ChartPoint[] } }).data.values;
    expect(data.some((p) => p.series === "rate")).toBe(false);
    expect(checkSvg(await renderChart({ title: "t", points }), ["rate"]).problems).toEqual([]);
  });

  it("records a run of memory stages: each stage, class and gate, the provider, sheds and 429s", async () => {
    const backend = memory();
    const queue = backend.queue("q", { maxSize: 1, whenFull: "shed" });
    const pool = backend.semaphore("pool", { limit: 2, classes: { a: { share: 1 }, b: { share: 1 } } });
    const gate = new Gate([queue, pool], { name: "g" });
    const provider = fakeProvider();
    const chart = new ChartRecorder({ title: "memory run", cap: 2 }).watch(gate).watchProvider(provider);

    chart.sample();
    const first = await gate.admit({ class: "a" });
    const second = await gate.admit({ class: "b" });
    const third = gate.admit({ class: "a" }); // waits, in the queue's one slot
    await expect(gate.admit({ class: "a" })).rejects.toThrow(/full/); // shed
    provider.inFlight = 2;
    provider.peak = 2;
    provider.rejected429 = 3;
    chart.sample();
    first.release("success");
    (await third).release("success");
    second.release("success");
    provider.inFlight = 0;
    chart.sample();
    await gate.close();

    const at = (series: string, measure: ChartPoint["measure"]) =>
      chart.points.filter((p) => p.series === series && p.measure === measure).map((p) => p.value);
    expect(at("pool · a", "in flight")).toEqual([0, 1, 0]);
    expect(at("pool · b", "in flight")).toEqual([0, 1, 0]);
    expect(at("pool", "limit")).toEqual([2, 2, 2]);
    expect(at("q", "in flight")).toEqual([0, 1, 0]);
    expect(at("q", "sheds")).toEqual([0, 1, 0]);
    expect(at("gate g", "waiting")).toEqual([0, 1, 0]);
    expect(at("provider", "in flight")).toEqual([0, 2, 0]);
    expect(at("provider", "429s")).toEqual([0, 3, 0]);
    expect(chart.summary()).toEqual([
      "provider: peak 2/2 in flight, 429s 3",
      "sheds 1 · sampled every 50 ms",
    ]);

    const dir = await mkdtemp(join(tmpdir(), "floodgate-chart-"));
    try {
      const file = await chart.write(join(dir, "run.svg"));
      const series = ["pool · a", "pool · b", "pool", "q", "gate g", "provider"];
      const { problems } = checkSvg(await readFile(file, "utf8"), series);
      expect(problems).toEqual([]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("sums stages of one name across objects, each object once, and reads a counter reset as a new count", () => {
    const one = memory().semaphore("shared", { limit: 4 });
    const two = memory().semaphore("shared", { limit: 4 });
    const provider = fakeProvider();
    const chart = new ChartRecorder({ title: "t" }).watch(one, two, one).watchProvider(provider);
    one.tryAdmit();
    two.tryAdmit();
    provider.rejected429 = 5;
    chart.sample();
    provider.rejected429 = 2; // reset, then two more
    chart.sample();
    expect(
      chart.points.filter((p) => p.series === "shared" && p.measure === "in flight").map((p) => p.value),
    ).toEqual([2, 2]);
    expect(chart.points.filter((p) => p.measure === "429s").map((p) => p.value)).toEqual([5, 2]);
  });

  it("records nothing without a file; started, it samples at once and once more when it stops", () => {
    expect(startChart(undefined, { title: "t" })).toBeUndefined();
    const provider = fakeProvider();
    const chart = new ChartRecorder({ title: "t", intervalMs: 10_000 }).watchProvider(provider);
    chart.start();
    expect(chart.points.map((p) => p.measure)).toEqual(["in flight", "429s"]);
    provider.rejected429 = 1;
    chart.stop();
    chart.stop(); // a second stop does nothing
    expect(chart.points.map((p) => p.value)).toEqual([0, 0, 0, 1]);
    chart.start(); // starting over drops the points taken so far
    expect(chart.points.map((p) => p.t)).toEqual([expect.any(Number), expect.any(Number)]);
    chart.stop();
    expect(() => new ChartRecorder({ title: "t", intervalMs: 5 })).toThrow(/intervalMs/);
  });
});

describe("--chart", () => {
  it("makes the demo write a chart of its run that names its stages, its gate and the provider", {
    timeout: 60_000,
  }, async () => {
    const dir = await mkdtemp(join(tmpdir(), "floodgate-chart-"));
    try {
      const file = join(dir, "demo.svg");
      const root = fileURLToPath(new URL("../..", import.meta.url));
      const { stderr } = await promisify(execFile)(
        process.execPath,
        ["--import", "tsx", "examples/demo.ts", "--requests", "40", "--callers", "16", "--chart", file],
        { cwd: root },
      );
      expect(stderr).toContain(`chart: ${file}`);
      const series = ["demo-queue", "demo-inflight", "demo-adaptive", "gate demo", "provider"];
      expect(checkSvg(await readFile(file, "utf8"), series).problems).toEqual([]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe("checkSvg", () => {
  const ok =
    '<svg xmlns="http://www.w3.org/2000/svg"><g><text x="1">a &amp; b</text><text>pool</text></g></svg>';

  it("passes a well-formed SVG and gives its texts, entities decoded", () => {
    expect(checkSvg(ok, ["pool", "a & b"])).toEqual({ problems: [], texts: ["a & b", "pool"] });
    expect(checkSvg(`<?xml version="1.0"?>\n<!-- c --><svg><![CDATA[x]]><rect/></svg>\n`).problems).toEqual(
      [],
    );
  });

  it.each([
    ["an unclosed element", "<svg><g></svg>", /closes <g>/],
    ["an element left open", "<svg><g>", /<g> is not closed/],
    ["a second root", "<svg></svg><svg></svg>", /second root/],
    ["another root", "<html></html>", /not <svg>/],
    ["a bare ampersand", "<svg><text>a & b</text></svg>", /bare "&"/],
    ["a repeated attribute", '<svg a="1" a="2"></svg>', /repeats the attribute a/],
    ["an unquoted attribute", "<svg a=1></svg>", /malformed/],
    ["text outside the root", "x<svg></svg>", /outside the root/],
    ["a missing series", ok, /no series named "rate"/],
    ["nothing", "", /no root element/],
  ])("refuses %s", (_, svg, problem) => {
    expect(checkSvg(svg, ["rate"]).problems.join("\n")).toMatch(problem);
  });
});
