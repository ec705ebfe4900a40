// The doctor panel: the request (JSON, or a multipart form when a snapshot or trace is chosen) and
// the report: the verdict, the GPU at the OOM, the live memory over the run, each finding with its
// evidence, the fixes ranked.

import { oomBar, timelineChart } from "./charts.js";
import { $, el, gib } from "./dom.js";

/** The fetch options of ``POST /v1/doctor``: the fields as JSON, or as a form beside the ``file`` part. */
export function doctorRequest(fields, file) {
  if (!file) {
    return { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(fields) };
  }
  const form = new FormData();
  for (const [k, v] of Object.entries(fields)) form.append(k, k === "job" ? JSON.stringify(v) : v);
  form.append("file", file, file.name);
  return { method: "POST", body: form };
}

function evidenceValue(e) {
  if (e.unit === "bytes" && typeof e.value === "number") return gib(e.value);
  if (e.unit === "fraction" && typeof e.value === "number") return (100 * e.value).toFixed(1) + "%";
  if (e.value === null) return "—";
  return String(e.value) + (["", "bytes", "text"].includes(e.unit) ? "" : " " + e.unit);
}

/** Show a doctor document (memplan doctor --json) in #doctor-out. */
export function renderDoctor(doc) {
  const out = $("#doctor-out");
  const head = el("div", { id: "doctor-verdict", class: `verdict v-${doc.verdict} ${doc.verdict === "fits" ? "ok" : "bad"}`,
    "data-verdict": doc.verdict }, el("span", { text: doc.verdict_text || doc.verdict }));
  const parts = [head];
  if (doc.message) parts.push(oomBar(doc.message));
  const timeline = timelineChart(doc);
  if (timeline) parts.push(timeline);
  const facts = [`inputs: ${(doc.inputs || []).join(", ") || "none"}`];
  if (doc.capacity_bytes) facts.push(`capacity ${gib(doc.capacity_bytes)} (${doc.capacity_source})`);
  parts.push(el("p", { class: "summary", text: facts.join(" · ") }));
  for (const f of doc.findings || []) {
    const box = el("section", { class: "finding" }, el("h4", {}, el("span", { class: "tag", text: f.verdict }),
      " ", f.summary, f.decisive ? null : el("em", { text: " (contributes; not decisive alone)" })));
    if ((f.evidence || []).length) {
      box.append(el("table", { class: "plain evidence" }, el("tr", {}, ...["evidence", "value", "from", "note"]
        .map((h) => el("th", { scope: "col", text: h }))), ...f.evidence.map((e) => el("tr", {},
        el("td", {}, el("code", { text: e.name })), el("td", { class: "n", text: evidenceValue(e) }),
        el("td", { text: e.source }), el("td", { text: e.note || "" })))));
    }
    if ((f.sites || []).length) {
      box.append(el("ul", { class: "sites" }, ...f.sites.map((s) => el("li", {}, el("code", { text: s.site }),
        `: ${gib(s.bytes)}`))));
    }
    parts.push(box);
  }
  if ((doc.fixes || []).length) {
    parts.push(el("h4", { text: "Fixes, cheapest verified first" }));
    parts.push(el("ol", { class: "fixes", id: "doctor-fixes" }, ...doc.fixes.map((x) => el("li", {},
      el("div", {}, el("strong", { text: x.action }), " ", el("code", { class: "setting", text: x.setting })),
      el("div", { class: "meta" },
        el("span", { class: x.verified ? "tag ok" : "tag bad", text: x.verified ? `verified by ${x.verified_by}` : "not verified" }),
        x.saves_bytes === null ? null : ` saves ${gib(x.saves_bytes)}`,
        x.step_time_cost ? ` · step time ${x.step_time_cost > 0 ? "+" : ""}${(100 * x.step_time_cost).toFixed(1)}%` : null,
        x.changes_training ? " · changes what trains" : null),
      nativeSettings(x.native),
      el("p", { class: "help", text: x.verification })))));
  }
  if ((doc.notes || []).length) parts.push(el("ul", { class: "notes" }, ...doc.notes.map((n) => el("li", { text: n }))));
  out.replaceChildren(...parts);
}

// A job fix in the job's framework's own settings (Megatron-LM arguments, a DeepSpeed config, TrainingArguments,
// a torchtitan TOML), then what those settings do not carry; nothing for other fixes.
function nativeSettings(native) {
  if (!native) return null;
  return el("div", { class: "native" },
    native.text ? el("div", {}, `${native.dialect}: `, el("code", { class: "setting", text: native.text })) : null,
    ...native.notes.map((n) => el("p", { class: "help", text: n })));
}

// The GPU at the moment of the OOM, from the message's own figures: what PyTorch allocated, what it
// reserved but had not allocated, what others held, and what was free — beside what was requested.