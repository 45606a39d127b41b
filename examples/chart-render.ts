/**
 * The drawing half of the charts (see chart.ts): three panels sharing the time axis, as a
 * vega-lite spec compiled to vega and rendered to SVG without a browser. vega is loaded only
 * when a chart is drawn.
 */
import type { TopLevelSpec } from "vega-lite";
import type { ChartData, ChartPanel } from "./chart.js";

const WIDTH = 640;
const HEIGHT = 130;

/**
 * `text` in lines of at most `max` characters, broken at spaces. Without a browser, vega sizes
 * the chart from an estimate of each title line's width (0.8 × font size per character), so a
 * long line would widen the whole SVG.
 */
function wrap(text: string, max: number): string[] {
  const lines: string[] = [];
  let line = "";
  for (const word of text.split(" ")) {
    if (line !== "" && line.length + 1 + word.length > max) {
      lines.push(line);
      line = word;
    } else line = line === "" ? word : `${line} ${word}`;
  }
  if (line !== "") lines.push(line);
  return lines;
}

/** The panels' titles on the y axis. */
function panelTitle(panel: ChartPanel, intervalMs: number, limits: boolean): string {
  if (panel === "in flight") return limits ? "in flight (dashed: limit)" : "in flight";
  if (panel === "waiting") return "waiting";
  return `429s, sheds per ${intervalMs} ms`;
}

/**
 * The vega-lite spec of a chart: the panels that have points, stacked, sharing the time axis and
 * one color per series. Exported for tests; `renderChart` draws it.
 */
export function chartSpec(data: ChartData): Record<string, unknown> {
  const intervalMs = data.intervalMs ?? 50;
  const tMax = data.points.reduce((m, p) => Math.max(m, p.t), 0.001);
  const limits = data.points.some((p) => p.measure === "limit");
  const series = [...new Set(data.points.map((p) => p.series))];
  const panels = (["in flight", "waiting", "refused"] as const).filter((panel) =>
    data.points.some((p) => p.panel === panel),
  );
  const color = {
    field: "series",
    type: "nominal",
    scale: { domain: series, scheme: series.length > 10 ? "category20" : "tableau10" },
    legend: {
      title: data.legend ?? "stage, class or provider",
      orient: "bottom",
      columns: 3,
      labelLimit: 300,
      titleLimit: 400,
    },
  };
  const x = (last: boolean) => ({
    field: "t",
    type: "quantitative",
    scale: { domain: [0, tMax], nice: false },
    axis: { title: last ? "seconds since the start" : null },
  });
  // A line that stays at 0 in the waiting or the refused panel is left out of it (its color
  // stays in the legend), unless every line of the panel does.
  const flat = new Set<string>();
  for (const panel of ["waiting", "refused"] as const) {
    const inPanel = data.points.filter((p) => p.panel === panel);
    const moving = new Set(inPanel.filter((p) => p.value !== 0).map((p) => p.series));
    if (moving.size === 0) continue;
    for (const p of inPanel) if (!moving.has(p.series)) flat.add(`${panel}\u0000${p.series}`);
  }
  const points =
    flat.size === 0 ? data.points : data.points.filter((p) => !flat.has(`${p.panel}\u0000${p.series}`));
  const vconcat = panels.map((panel, i) => {
    const last = i === panels.length - 1;
    // From 0 to a little above the highest value and the cap (an all-zero panel still has a scale).
    let top = data.points.reduce((m, p) => (p.panel === panel ? Math.max(m, p.value) : m), 1);
    if (panel === "in flight" && data.cap !== undefined) top = Math.max(top, data.cap);
    const layer: Record<string, unknown>[] = [
      {
        transform: [{ filter: { field: "panel", equal: panel } }],
        mark: { type: "line", interpolate: "step-after", strokeWidth: 1.5, clip: true },
        encoding: {
          x: x(last),
          y: {
            field: "value",
            type: "quantitative",
            title: panelTitle(panel, intervalMs, limits),
            scale: { domain: [0, top + Math.max(1, top * 0.08)] },
            axis: { tickMinStep: 1, format: "d" },
          },
          color,
          detail: { field: "measure", type: "nominal" },
          ...(panel === "in flight"
            ? {
                strokeDash: {
                  field: "measure",
                  type: "nominal",
                  scale: {
                    domain: ["in flight", "limit"],
                    range: [
                      [1, 0],
                      [5, 3],
                    ],
                  },
                  legend: null,
                },
              }
            : {}),
        },
      },
    ];
    if (panel === "in flight" && data.cap !== undefined) {
      layer.push(
        {
          data: { values: [{ cap: data.cap }] },
          mark: { type: "rule", color: "#666", strokeDash: [2, 2], strokeWidth: 1.5 },
          encoding: { y: { field: "cap", type: "quantitative" } },
        },
        {
          data: { values: [{ cap: data.cap, label: `cap ${data.cap}` }] },
          mark: { type: "text", align: "right", dx: -4, dy: -6, color: "#444", x: WIDTH },
          encoding: { y: { field: "cap", type: "quantitative" }, text: { field: "label" } },
        },
      );
    }
    return { width: WIDTH, height: panel === "refused" ? HEIGHT - 30 : HEIGHT, layer };
  });
  return {
    $schema: "https://vega.github.io/schema/vega-lite/v6.json",
    title: {
      text: wrap(data.title, 75),
      subtitle: [data.subtitle ?? []].flat().flatMap((line) => wrap(line, 90)),
      anchor: "start",
      subtitlePadding: 4,
      offset: 12,
    },
    background: "white",
    padding: 8,
    data: { values: points },
    vconcat,
    spacing: 12,
    align: "none",
    config: { font: "sans-serif", axis: { grid: true, gridOpacity: 0.4 } },
  };
}

/** Draw a chart as an SVG document (vega-lite compiled to vega, rendered without a browser). */
export async function renderChart(data: ChartData): Promise<string> {
  const [vega, vl] = await Promise.all([import("vega"), import("vega-lite")]);
  const compiled = vl.compile(chartSpec(data) as unknown as TopLevelSpec).spec;
  const view = new vega.View(vega.parse(compiled), { renderer: "none" });
  try {
    return await view.toSVG();
  } finally {
    view.finalize();
  }
}
