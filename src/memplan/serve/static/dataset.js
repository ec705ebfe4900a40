// The dataset panel: the form of ``POST /v1/dataset`` (the dataset and tokenizer files as uploads, the job
// as JSON text) and its answer's ``dataset`` section: the worst step, the step-peak percentiles, the steps
// over the GPU, the per-step peak against the usable memory and the length histogram.

import { $, el, gib, svg } from "./dom.js";

/** The form part each tokenizer file goes in, by its name. */
const TOKENIZER_PART = { "tokenizer.json": "tokenizer", "tokenizer_config.json": "tokenizer_config",
  "chat_template.jinja": "chat_template" };

/** The fetch options of ``POST /v1/dataset``, or {localError, field} for what the page can say itself. */
export function datasetRequest(job, file, tokenizerFiles, options) {
  if (!file) return { localError: "file: choose the dataset file", field: "file" };
  const form = new FormData();
  form.append("job", JSON.stringify(job));
  form.append("file", file, file.name);
  for (const t of tokenizerFiles) {
    const part = TOKENIZER_PART[t.name];
    if (!part) return { localError: `tokenizer: ${t.name} is not one of ${Object.keys(TOKENIZER_PART).join(", ")}`, field: "tokenizer" };
    form.append(part, t, t.name);
  }
  for (const [k, v] of Object.entries(options)) if (v !== "" && v !== null && v !== undefined) form.append(k, String(v));
  return { init: { method: "POST", body: form } };
}

/** Show a ``/v1/dataset`` answer (memplan estimate --dataset --json) in #dataset-out. */
export function renderDataset(doc) {
  const d = doc.dataset;
  const w = d.worst_step;
  const usable = d.gpu_usable_bytes;
  const over = d.steps_over_gpu;
  const fits = over === null ? null : over === 0;
  const verdict = el("div", { id: "dataset-verdict", class: "verdict " + (fits === null ? "" : fits ? "ok" : "bad"),
    "data-steps-over": over === null ? "" : String(over) }, el("span", { text: over === null
      ? `Worst step #${w.index}: ${gib(w.peak_allocated_bytes)} (no GPU chosen)`
      : fits ? `Every one of ${d.steps} steps fits the usable ${gib(usable)}`
        : `${over} of ${d.steps} steps exceed the usable ${gib(usable)}` }));
  const p = d.step_peak_percentiles_bytes;
  const figure = (label, bytes, id) => el("div", {}, el("dt", { text: label }),
    el("dd", { id, "data-bytes": String(bytes), text: gib(bytes) }));
  const figures = el("dl", { class: "figures" }, figure("Worst step peak", w.peak_allocated_bytes, "ds-worst"),
    figure("Step peak p50", p.p50, "ds-p50"), figure("p90", p.p90, "ds-p90"), figure("p99", p.p99, "ds-p99"),
    usable === null ? null : figure("GPU usable", usable, "ds-usable"));
  const lengths = Object.entries(d.length_percentiles).map(([k, v]) => `${k} ${v}`).join(", ");
  const summary = el("p", { class: "summary", id: "ds-summary", text: `${d.examples} examples, ${d.steps} steps ` +
    `(--batching ${d.batching}, ${d.distinct_shapes} distinct shapes). Example tokens: ${lengths}. ${d.pricing}.` });
  const worst = el("table", { class: "plain", id: "ds-worst-step" },
    el("tr", {}, ...["worst step", "rows", "tokens per row", "peak allocated", "phase"].map((h) => el("th", { scope: "col", text: h }))),
    el("tr", {}, ...[String(w.index), String(w.batch_size), String(w.seq_length), gib(w.peak_allocated_bytes), w.peak_phase]
      .map((t) => el("td", { text: t }))));
  const unmodelled = doc.unmodelled_settings || [];
  $("#dataset-out").replaceChildren(verdict, figures, summary,
    el("figure", { class: "chart" }, el("figcaption", { text: "Peak allocated per step, in training order, against the GPU's usable memory" }), stepChart(d)),
    worst,
    el("figure", { class: "chart" }, el("figcaption", { text: "Example lengths (tokens)" }), histogram(d.length_histogram)),
    unmodelled.length ? el("div", { class: "warn" }, el("strong", { text: "Not modelled: " }),
      el("ul", {}, ...unmodelled.map((line) => el("li", { text: line })))) : null);
}

function stepChart(d) {
  const values = d.step_peaks.max_bytes;
  const size = d.step_peaks.steps_per_point;
  const W = Math.max(320, Math.min(900, $("#dataset-out").clientWidth || 640)), H = 220, L = 56, R = 10, T = 10, B = 28;
  const top = Math.max(d.gpu_usable_bytes || 0, ...values) * 1.05 || 1;
  const x = (i) => L + (i / Math.max(values.length - 1, 1)) * (W - L - R);
  const y = (b) => T + (H - T - B) * (1 - b / top);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", id: "ds-steps", "data-points": values.length,
    "aria-label": `Per-step peak over ${d.steps} steps; worst step ${d.worst_step.index} at ${gib(d.worst_step.peak_allocated_bytes)}` });
  root.append(svg("text", { x: L - 6, y: T + 8, class: "tick", "text-anchor": "end" }, gib(top)),
    svg("text", { x: L - 6, y: H - B, class: "tick", "text-anchor": "end" }, "0"),
    svg("text", { x: L, y: H - 8, class: "tick" }, `step 0–${d.steps - 1}${size > 1 ? ` (each point the highest of ${size} steps)` : ""}`),
    svg("polyline", { points: values.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" "), fill: "none",
      stroke: "#0072B2", "stroke-width": 1.5 }));
  if (d.gpu_usable_bytes !== null) {
    const line = svg("line", { id: "ds-usable-line", x1: L, x2: W - R, y1: y(d.gpu_usable_bytes), y2: y(d.gpu_usable_bytes),
      stroke: "#D55E00", "stroke-dasharray": "6 3", "data-bytes": d.gpu_usable_bytes });
    line.append(svg("title", {}, `GPU usable ${gib(d.gpu_usable_bytes)}`));
    root.append(line);
  }
  const dot = svg("circle", { cx: x(Math.floor(d.worst_step.index / size)), cy: y(d.worst_step.peak_allocated_bytes), r: 4, fill: "#000" });
  dot.append(svg("title", {}, `worst step ${d.worst_step.index}`));
  root.append(dot);
  return root;
}

function histogram(bins) {
  const W = 640, H = 160, B = 22;
  const most = Math.max(1, ...bins.map((b) => b.count));
  const slot = W / bins.length;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", id: "ds-histogram", "aria-label": "Example count per token-length bin" });
  bins.forEach((b, i) => {
    const h = ((H - B) * b.count) / most;
    const bar = svg("rect", { x: i * slot + 1, y: H - B - h, width: Math.max(1, slot - 2), height: h, fill: "#009E73",
      "data-count": b.count });
    bar.append(svg("title", {}, `${b.from}–${b.to} tokens: ${b.count} examples`));
    root.append(bar);
  });
  root.append(svg("text", { x: 0, y: H - 6, class: "tick" }, String(bins[0].from)),
    svg("text", { x: W, y: H - 6, class: "tick", "text-anchor": "end" }, `${bins[bins.length - 1].to} tokens`));
  return root;
}
