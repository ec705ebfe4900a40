// The estimate panel: the verdict, the peak figures, the per-stage chart and table of one
// ``POST /v1/estimate`` answer. Numbers are the document's; the page only formats them.

import { drawStages, categories } from "./charts.js";
import { $, GiB, count, el, gib, human } from "./dom.js";

/** Show an estimate document (memplan estimate --json); ``gpus`` is the catalogue (GET /v1/gpus). */
export function renderEstimate(doc, gpus) {
  const gpuInfo = doc.gpu;
  const verdict = $("#verdict");
  const gpuEntry = gpus.find((g) => gpuInfo && g.name === gpuInfo.name);
  const gpuLabel = gpuInfo ? `${gpuInfo.name}${gpuEntry ? " (" + gpuEntry.description + ")" : ""}` : "";
  setBytes("#peak-allocated", doc.peak_allocated_bytes);
  setBytes("#peak-reserved", doc.peak_reserved_bytes);
  setBytes("#gpu-usable", gpuInfo ? gpuInfo.usable_bytes : null);
  setBytes("#headroom", gpuInfo ? gpuInfo.headroom_bytes : null);
  $("#params").replaceChildren(count(doc.total_parameters),
    el("small", { text: `${count(doc.trainable_params)} trainable` }));
  if (gpuInfo) {
    verdict.dataset.fits = String(gpuInfo.fits);
    verdict.className = "verdict " + (gpuInfo.fits ? "ok" : "bad");
    verdict.replaceChildren(el("span", { class: "mark", "aria-hidden": "true", text: gpuInfo.fits ? "✓" : "✗" }),
      el("span", { text: gpuInfo.fits
        ? `Fits on ${gpuLabel}: ${gib(gpuInfo.headroom_bytes)} to spare`
        : `Does not fit on ${gpuLabel}: ${gib(-gpuInfo.headroom_bytes)} over the usable ${gib(gpuInfo.usable_bytes)}` }));
  } else {
    verdict.dataset.fits = "";
    verdict.className = "verdict";
    verdict.textContent = "No GPU chosen: no verdict.";
  }
  const j = doc.job || {};
  const p = j.parallel || {};
  const b = j.batch || {};
  const parts = [`${doc.model} · ${doc.framework}`,
    `${p.world_size} GPUs = dp ${p.dp} × tp ${p.tp} × pp ${p.pp} × cp ${p.cp}${p.ep > 1 ? " × ep " + p.ep : ""}`,
    `mbs ${b.micro_batch_size} × seq ${b.seq_length}`, (j.precision || {}).name,
    `recompute ${(j.recompute || {}).mode}`];
  if (doc.peak_cpu_bytes) parts.push(`CPU ${gib(doc.peak_cpu_bytes)}`);
  $("#summary").textContent = parts.filter(Boolean).join(" · ");
  drawStages(doc);
  breakdownTable(doc);
  $("#assumptions").replaceChildren(...(doc.assumptions || []).map((a) => el("li", { text: a })));
  settingsList($("#settings"), doc);
  // Never silent: what the input files set that memplan does not price is said beside the numbers.
  const unmodelled = doc.unmodelled_settings || [];
  $("#unmodelled").hidden = !unmodelled.length;
  $("#unmodelled").replaceChildren(el("strong", { text: "Not modelled: " }),
    el("ul", {}, ...unmodelled.map((line) => el("li", { text: line }))));
}

function setBytes(sel, bytes) {
  const node = $(sel);
  if (bytes === null || bytes === undefined) {
    node.textContent = "—";
    delete node.dataset.bytes;
    return;
  }
  node.textContent = gib(bytes);
  node.dataset.bytes = String(bytes);
}

function settingsList(holder, doc) {
  holder.replaceChildren();
  const rows = doc.input_settings || [];
  if (!rows.length) return;
  // Each setting an input file gave, and what memplan made of it (modelled, no memory effect, not modelled).
  const table = el("table", { class: "plain", id: "input-settings" }, el("tr", {},
    ...["input", "setting", "value", "effect", "note"].map((h) => el("th", { scope: "col", text: h }))));
  for (const s of rows) {
    table.append(el("tr", { class: s.effect === "not modelled" ? "unmodelled" : null },
      ...[s.source, s.key, JSON.stringify(s.value), s.effect, s.note]
        .map((t) => el("td", { text: t === undefined || t === null ? "" : String(t) }))));
  }
  holder.append(el("h4", { text: "What the input files said" }), table);
}


function breakdownTable(doc) {
  const stages = doc.stages || [];
  const names = categories(stages);
  const table = $("#breakdown");
  const head = el("tr", {}, el("th", { scope: "col", text: "GiB" }),
    ...stages.map((s) => el("th", { scope: "col", text: `stage ${s.stage}${s.stage === doc.peak_stage ? " *" : ""}` })));
  const row = (label, cells, cls) => el("tr", { class: cls }, el("th", { scope: "row", text: label }),
    ...cells.map((c) => el("td", { text: c })));
  const layers = (s) => (s.layer_indices && s.layer_indices.length
    ? `${s.layer_indices[0]}-${s.layer_indices[s.layer_indices.length - 1]}` : String(s.layers));
  table.replaceChildren(el("thead", {}, head), el("tbody", {},
    row("decoder layers", stages.map(layers)),
    row("micro-batches in flight", stages.map((s) => String(s.inflight_microbatches))),
    row("peak during", stages.map((s) => s.peak_phase)),
    ...names.map((n) => row(human(n), stages.map((s) => (s.by_category[n] ? (s.by_category[n] / GiB).toFixed(2) : "—")))),
    row("peak allocated", stages.map((s) => (s.peak_allocated_bytes / GiB).toFixed(2)), "total"),
    row("predicted reserved", stages.map((s) => (s.peak_reserved_bytes / GiB).toFixed(2)), "total")));
}
