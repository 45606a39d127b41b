/**
 * Checks a chart written with `--chart`: the file is a well-formed XML document whose root is
 * `<svg>`, and each expected series is named by a `<text>` element (its legend entry). CI runs
 * it on the demo's chart:
 *
 *   npx tsx examples/check-chart.ts /tmp/demo.svg --series demo-inflight --series provider
 *
 * Exits 0 and prints one line when the chart passes; prints every problem and exits 1 when it
 * does not (2 for a command line it cannot use). `checkSvg` is the check, for tests.
 */
import { readFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { command, parseOrExit } from "./cli.js";

/** What `checkSvg` found. */
export interface SvgCheck {
  /** Everything wrong with it; empty when the chart passes. */
  problems: string[];
  /** The text of every `<text>` element, entities decoded, in document order. */
  texts: string[];
}

const NAME = /^[A-Za-z_:][\w.:-]*/;
const ATTRIBUTE = /^\s+([A-Za-z_:][\w.:-]*)\s*=\s*("[^"<]*"|'[^'<]*')/;
const ENTITY = /&(?:amp|lt|gt|quot|apos|#[0-9]+|#x[0-9a-fA-F]+);/y;

function decode(text: string): string {
  return text.replace(/&(amp|lt|gt|quot|apos|#[0-9]+|#x[0-9a-fA-F]+);/g, (_, e: string) => {
    if (e.startsWith("#x")) return String.fromCodePoint(Number.parseInt(e.slice(2), 16));
    if (e.startsWith("#")) return String.fromCodePoint(Number(e.slice(1)));
    return { amp: "&", lt: "<", gt: ">", quot: '"', apos: "'" }[e]!;
  });
}

/** Character data: no `<`, and every `&` starts an entity. Returns a problem or undefined. */
function badText(text: string, at: number): string | undefined {
  for (let i = text.indexOf("&"); i >= 0; i = text.indexOf("&", i + 1)) {
    ENTITY.lastIndex = i;
    if (!ENTITY.test(text)) return `a bare "&" at offset ${at + i}`;
  }
  return undefined;
}

/**
 * Check that `svg` is well-formed XML (one root element, tags nested and closed, attributes
 * quoted and not repeated, entities known, nothing but comments and processing instructions
 * outside the root), that the root is `<svg>`, and that each of `series` is the text of a
 * `<text>` element. Not a full XML parser: no DTD internal subsets, no external entities.
 */
export function checkSvg(svg: string, series: readonly string[] = []): SvgCheck {
  const problems: string[] = [];
  const texts: string[] = [];
  const stack: string[] = [];
  let root: string | undefined;
  let rootClosed = false;
  let textDepth = -1;
  let current = "";
  let i = 0;
  const fail = (message: string) => {
    problems.push(message);
    i = svg.length;
  };
  while (i < svg.length) {
    const lt = svg.indexOf("<", i);
    const chunk = svg.slice(i, lt < 0 ? svg.length : lt);
    if (chunk.length > 0) {
      if (stack.length === 0 && chunk.trim() !== "") {
        fail(`text outside the root element at offset ${i}`);
        break;
      }
      const bad = badText(chunk, i);
      if (bad) {
        fail(bad);
        break;
      }
      if (textDepth >= 0) current += chunk;
    }
    if (lt < 0) break;
    i = lt;
    const rest = svg.slice(i);
    if (rest.startsWith("<!--")) {
      const end = svg.indexOf("-->", i + 4);
      if (end < 0) fail(`a comment is not closed (offset ${i})`);
      else i = end + 3;
    } else if (rest.startsWith("<![CDATA[")) {
      const end = svg.indexOf("]]>", i + 9);
      if (stack.length === 0) fail(`CDATA outside the root element (offset ${i})`);
      else if (end < 0) fail(`a CDATA section is not closed (offset ${i})`);
      else {
        if (textDepth >= 0) current += svg.slice(i + 9, end);
        i = end + 3;
      }
    } else if (rest.startsWith("<?")) {
      const end = svg.indexOf("?>", i + 2);
      if (end < 0) fail(`a processing instruction is not closed (offset ${i})`);
      else i = end + 2;
    } else if (rest.startsWith("<!DOCTYPE")) {
      const end = svg.indexOf(">", i);
      if (root !== undefined || end < 0 || svg.slice(i, end).includes("[")) {
        fail(`a DOCTYPE this check does not take (offset ${i})`);
      } else i = end + 1;
    } else if (rest.startsWith("</")) {
      const name = NAME.exec(rest.slice(2))?.[0];
      const close =
        name === undefined
          ? -1
          : 2 + name.length + (/^\s*/.exec(rest.slice(2 + name.length))?.[0].length ?? 0);
      if (name === undefined || rest[close] !== ">") fail(`a malformed end tag at offset ${i}`);
      else if (stack.at(-1) !== name) {
        fail(`</${name}> at offset ${i} closes ${stack.length === 0 ? "nothing" : `<${stack.at(-1)}>`}`);
      } else {
        stack.pop();
        if (textDepth === stack.length) {
          texts.push(decode(current).trim());
          textDepth = -1;
          current = "";
        }
        if (stack.length === 0) rootClosed = true;
        i += close + 1;
      }
    } else {
      const name = NAME.exec(rest.slice(1))?.[0];
      if (name === undefined) {
        fail(`a "<" that starts no tag at offset ${i}`);
        break;
      }
      if (stack.length === 0 && (root !== undefined || rootClosed)) {
        fail(`a second root element <${name}> at offset ${i}`);
        break;
      }
      let j = 1 + name.length;
      const seen = new Set<string>();
      for (let a = ATTRIBUTE.exec(rest.slice(j)); a; a = ATTRIBUTE.exec(rest.slice(j))) {
        if (seen.has(a[1]!)) problems.push(`<${name}> at offset ${i} repeats the attribute ${a[1]}`);
        seen.add(a[1]!);
        const bad = badText(a[2]!, i + j);
        if (bad) problems.push(bad);
        j += a[0].length;
      }
      j += /^\s*/.exec(rest.slice(j))![0].length;
      const selfClosing = rest.startsWith("/>", j);
      if (!selfClosing && rest[j] !== ">") {
        fail(`<${name}> at offset ${i} is malformed`);
        break;
      }
      root ??= name;
      if (selfClosing) {
        if (stack.length === 0) rootClosed = true;
        if (name === "text") texts.push("");
      } else {
        if (name === "text" && textDepth < 0) textDepth = stack.length;
        stack.push(name);
      }
      i += j + (selfClosing ? 2 : 1);
    }
  }
  if (problems.length === 0) {
    if (root === undefined) problems.push("no root element");
    else if (stack.length > 0) problems.push(`<${stack.at(-1)}> is not closed at the end`);
    if (root !== undefined && root !== "svg") problems.push(`the root element is <${root}>, not <svg>`);
  }
  if (problems.length === 0) {
    const present = new Set(texts);
    for (const s of series) if (!present.has(s)) problems.push(`no series named ${JSON.stringify(s)}`);
  }
  return { problems, texts };
}

const COMMAND = command({
  name: "check-chart",
  synopsis: "npx tsx examples/check-chart.ts FILE.svg [--series NAME]…",
  about:
    "Checks a chart written with --chart: well-formed XML with an <svg> root, and a legend entry for\n" +
    "each series named. Exits 1 with every problem when it fails.",
  args: { name: "FILE.svg", help: "the chart to check" },
  flags: {
    series: { type: "string", multiple: true, value: "NAME", help: "a series the chart must name" },
  },
});

async function main(): Promise<number> {
  const { values, args } = parseOrExit(COMMAND);
  if (args.length !== 1) {
    process.stderr.write(`check-chart: give one FILE.svg (got ${args.length}; try --help)\n`);
    return 2;
  }
  const file = args[0]!;
  let svg: string;
  try {
    svg = await readFile(file, "utf8");
  } catch (error) {
    process.stderr.write(`check-chart: ${file}: FAILED: cannot read it: ${(error as Error).message}\n`);
    return 1;
  }
  const { problems, texts } = checkSvg(svg, values.series);
  if (problems.length > 0) {
    process.stderr.write(`check-chart: ${file}: FAILED\n${problems.map((p) => `  ${p}\n`).join("")}`);
    return 1;
  }
  process.stdout.write(
    `check-chart: ${file}: well-formed SVG, ${svg.length} bytes, ${texts.length} text elements; ` +
      `series ${values.series.join(", ") || "(none asked)"} found · OK\n`,
  );
  return 0;
}

if (process.argv[1] !== undefined && fileURLToPath(import.meta.url) === process.argv[1]) {
  main().then(
    (code) => {
      process.exitCode = code;
    },
    (error: unknown) => {
      process.stderr.write(`check-chart failed: ${(error as Error).stack ?? error}\n`);
      process.exitCode = 1;
    },
  );
}
