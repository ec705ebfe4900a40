// The fit panel: ``POST /v1/fit`` (which layouts fit, fastest first) as a table, and a candidate
// turned back into job fields so the estimate shows it.

import { $, el, fieldName, gib, postJSON } from "./dom.js";

/** Ask the layout search about ``body``. The fields it chooses itself (``searched``, from the OpenAPI
 * document) are left out first; should it still refuse one, that one is left out and the question
 * asked again. {answer, left: the fields left out}. */
export async function searchFit(body, searched = []) {
  const asked = { ...body };
  const left = searched.filter((name) => name in asked);
  for (const name of left) delete asked[name];
  for (let tries = 0; tries < 64; tries++) {
    const answer = await postJSON("/v1/fit", asked);
    const e = answer.error;
    const name = e && fieldName(e.field);
    if (!(e && e.status === 400 && /chosen by the layout search/.test(e.rule || "") && name in asked)) {
      return { answer, left };
    }
    delete asked[name];
    left.push(name);
  }
  return { answer: { error: { message: "the layout search kept refusing fields" } }, left };
}

/** Show a fit document (memplan fit --json); ``onUse(candidate)`` when a row's Use button is pressed. */
export function renderFit(doc, onUse) {
  $("#fit-summary").textContent = `${doc.fitting} layout${doc.fitting === 1 ? "" : "s"} fit ${doc.gpus} × ` +
    `${doc.gpu} (limit ${gib(doc.limit_bytes)} = usable less a ${Math.round(doc.margin * 100)}% margin), ` +
    `seq ${doc.seq_length}, global batch ${doc.global_batch_size}, ${doc.framework}; ` +
    `${doc.layouts_searched} layouts searched, ${doc.estimates} estimates in ${doc.seconds.toFixed(2)} s.`;
  const cols = ["#", "layout", "allocated", "reserved", "headroom", "step time", "tokens/s", "MFU", ""];
  const table = $("#fit-table");
  const rows = (doc.candidates || []).map((c, i) => {
    const use = el("button", { type: "button", class: "ghost small", text: "Use",
      "aria-label": `Use layout ${c.label} in the estimate` });
    use.addEventListener("click", () => onUse(c));
    return el("tr", {}, el("td", { text: String(i + 1) }), el("td", { class: "l" }, el("code", { text: c.label })),
      el("td", { text: gib(c.allocated_bytes) }), el("td", { text: gib(c.reserved_bytes) }),
      el("td", { text: gib(c.headroom_bytes) }), el("td", { text: c.step_time_s.toFixed(2) + " s" }),
      el("td", { text: Math.round(c.tokens_per_s).toLocaleString("en-US") }),
      el("td", { text: (100 * c.mfu).toFixed(1) + "%" }), el("td", {}, use));
  });
  table.replaceChildren(el("thead", {}, el("tr", {}, ...cols.map((h, i) => el("th", { scope: "col",
    class: i === 1 ? "l" : null, text: h })))), el("tbody", {}, ...rows));
  const rejected = $("#fit-rejected");
  rejected.replaceChildren();
  if ((doc.rejected || []).length) {
    rejected.append(el("h4", { text: "Rejected layout families" }),
      el("ul", {}, ...doc.rejected.map((r) => el("li", { text: typeof r === "string" ? r : JSON.stringify(r) }))));
  }
}

/** The job fields after choosing candidate ``c``: its layout, sharding, micro-batch and recompute
 * replace those of ``fields``, and the fields the search left out (``left``) go; the rest is kept. */
export function layoutFields(c, fields, schema, left) {
  const job = c.job || {};
  const sh = job.sharding || {};
  const chosen = { tp: c.tp, pp: c.pp, vpp: c.vpp, cp: c.cp, ep: c.ep, mbs: c.micro_batch_size,
    gbs: c.global_batch_size, recompute: (job.recompute || {}).mode || c.recompute,
    sequence_parallel: (job.parallel || {}).sequence_parallel || undefined, zero: sh.zero || undefined,
    fsdp: sh.fsdp && sh.fsdp !== "none" ? sh.fsdp : undefined, distributed_optimizer: sh.distributed_optimizer || undefined };
  const drop = new Set([...Object.keys(chosen), "dp", "etp", ...left]);
  const out = Object.fromEntries(Object.entries(fields).filter(([k]) => !drop.has(k)));
  for (const [k, v] of Object.entries(chosen)) {
    if (v === undefined || v === null || !(k in schema)) continue;
    if (schema[k].enum && !schema[k].enum.includes(v)) continue;
    out[k] = v;
  }
  return out;
}
