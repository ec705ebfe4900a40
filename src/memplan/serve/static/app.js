// memplan serve: the web page. Plain JavaScript, no build step, nothing loaded from another origin.
// The job form is generated from GET /v1/openapi.json (components.schemas.Job): field names, types and
// choices come from the server, so the page cannot drift from what it accepts. Every number shown is
// the server's answer (the CLI's --json document); the page only formats it (GiB = 2^30 bytes).
"use strict";

(() => {
  const GiB = 2 ** 30;
  // Okabe-Ito: distinguishable with colour-blindness (the HTML report uses the same palette).
  const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999",
    "#332288", "#882255", "#44AA99"];
  // Layout of the form only: which section a field sits in. Fields the schema does not have are
  // skipped; fields it has that are not listed here appear under "More".
  const GROUPS = [
    ["Parallelism", true, ["tp", "pp", "vpp", "cp", "dp", "ep", "etp", "sequence_parallel", "first_stage_layers",
      "last_stage_layers"]],
    ["Batch", true, ["mbs", "gbs", "seq", "packing"]],
    ["Sharding", true, ["zero", "fsdp", "fsdp_shard_size", "distributed_optimizer"]],
    ["Recompute", true, ["recompute", "recompute_method", "recompute_layers", "recompute_modules", "memory_budget",
      "checkpoint_reentrant", "partition_activations", "cpu_checkpointing", "contiguous_checkpoints"]],
    ["Precision", false, ["precision", "fp8", "fp8_params", "grad_dtype", "optimizer_state_dtype", "master_dtype"]],
    ["Fine-tuning", false, ["peft", "quantize_base", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets",
      "lora_rank_pattern", "rslora", "trainable", "modules_to_save", "double_quant", "quant_compute_dtype",
      "frozen_dtype"]],
    ["Offload", false, ["offload_optimizer", "optimizer_offload_fraction", "offload_params", "offload_activations"]],
    ["Framework, optimizer, kernels", false, ["framework", "optimizer", "momentum", "optimizer_impl",
      "optimizer_in_backward", "muon_tp_mode", "muon_nesterov", "attention", "dropout", "loss",
      "make_vocab_size_divisible_by", "fragmentation"]],
    ["Mixture of experts", false, ["moe_imbalance", "capacity_factor", "pad_to_capacity", "moe_dispatcher",
      "shared_expert_parallel", "moe_grouped_gemm", "mtp_layers"]],
  ];
  const LABELS = {
    tp: "Tensor parallel", pp: "Pipeline parallel", vpp: "Virtual pipeline", cp: "Context parallel",
    dp: "Data parallel", ep: "Expert parallel", etp: "Expert tensor parallel", mbs: "Micro-batch",
    gbs: "Global batch", seq: "Sequence length", zero: "ZeRO stage", fsdp: "FSDP", peft: "PEFT method",
    quantize_base: "Quantize base (QLoRA)", fp8: "FP8", loss: "Loss / logits",
  };
  // Fields with a fixed place in the form (model and GPU boxes).
  const FIXED = new Set(["model", "model_config", "gpu", "gpus"]);
  const SCALAR = new Set(["integer", "number", "string", "boolean"]);
  // Query-string keys of the page itself (not job fields).
  const PAGE_KEYS = { panel: "panel", source: "src", top: "fit_top", message: "d_message", capacity: "d_capacity",
    alloc: "d_alloc_conf", usejob: "d_job" };
  const CATEGORY_LABELS = {
    parameter: "parameters", gradient: "gradients", optimizer_state: "optimizer states (moments)",
    master_weight: "master weights", activation: "activations", logits: "loss / logits", temporary: "temporaries",
    input: "inputs", buffer: "buffers", communication: "communication buffers", workspace: "workspace (cuBLAS / TE)",
  };

  const $ = (sel, root = document) => root.querySelector(sel);
  const el = (tag, attrs = {}, ...kids) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const kid of kids) if (kid !== null && kid !== undefined) node.append(kid);
    return node;
  };
  const gib = (bytes) => (bytes / GiB).toFixed(2) + " GiB";
  const count = (n) => n >= 1e9 ? (n / 1e9).toFixed(2) + " B" : n >= 1e6 ? (n / 1e6).toFixed(1) + " M" : String(n);
  const human = (name) => CATEGORY_LABELS[name] || name.replaceAll("_", " ");
  const fieldName = (name) => String(name || "").replace(/^-+/, "").replaceAll("-", "_").split(/[\s:.[]/)[0];

  // ---- state: everything the view shows, mirrored in the URL query string ----
  const state = { source: "preset", model: "", config: "", fields: {}, panel: "estimate", top: 10,
    message: "", capacity: "", alloc: "", usejob: false };
  let schema = {}; // Job properties from the OpenAPI document
  let models = [];
  let gpus = [];
  let doctorFile = null;

  function readURL() {
    const q = new URLSearchParams(location.search);
    state.panel = ["estimate", "fit", "doctor"].includes(q.get("panel")) ? q.get("panel") : "estimate";
    state.source = ["preset", "hub", "config"].includes(q.get(PAGE_KEYS.source)) ? q.get(PAGE_KEYS.source) : "";
    state.model = q.get("model") || "";
    state.config = q.get("model_config") || "";
    if (!state.source) state.source = state.config ? "config" : state.model && !isPreset(state.model) ? "hub" : "preset";
    state.top = parseInt(q.get(PAGE_KEYS.top), 10) || 10;
    state.message = q.get(PAGE_KEYS.message) || "";
    state.capacity = q.get(PAGE_KEYS.capacity) || "";
    state.alloc = q.get(PAGE_KEYS.alloc) || "";
    state.usejob = q.get(PAGE_KEYS.usejob) === "1";
    state.fields = {};
    for (const [key, raw] of q) {
      const name = fieldName(key);
      const prop = schema[name];
      if (!prop || name === "model" || name === "model_config") continue;
      state.fields[name] = typed(prop, raw);
    }
    if (state.source === "preset" && !isPreset(state.model)) state.model = preferred(models, "llama-3.1-8b");
    if (!("gpu" in state.fields)) state.fields.gpu = preferred(gpus, "h100-80gb");
    if (!("gpus" in state.fields) && !q.toString()) state.fields.gpus = 8;
  }

  function writeURL() {
    const q = new URLSearchParams();
    if (state.source !== "preset") q.set(PAGE_KEYS.source, state.source);
    if (state.source === "config") q.set("model_config", compactJSON(state.config));
    else if (state.model) q.set("model", state.model);
    for (const [k, v] of Object.entries(state.fields)) q.set(k, String(v));
    if (state.panel !== "estimate") q.set("panel", state.panel);
    if (state.panel === "fit" && state.top !== 10) q.set(PAGE_KEYS.top, String(state.top));
    if (state.panel === "doctor") {
      if (state.message) q.set(PAGE_KEYS.message, state.message);
      if (state.capacity) q.set(PAGE_KEYS.capacity, state.capacity);
      if (state.alloc) q.set(PAGE_KEYS.alloc, state.alloc);
      if (state.usejob) q.set(PAGE_KEYS.usejob, "1");
    }
    const search = q.toString();
    const url = location.pathname + (search ? "?" + search : "");
    if (url !== location.pathname + location.search) history.replaceState(null, "", url);
  }

  const compactJSON = (text) => { try { return JSON.stringify(JSON.parse(text)); } catch { return text; } };
  const isPreset = (name) => models.some((m) => m.name === name);
  const preferred = (list, name) => (list.find((x) => x.name === name) || list[0] || { name: "" }).name;

  function typed(prop, raw) {
    if (prop.type === "integer" || prop.type === "number") {
      const n = Number(raw);
      return raw === "" || Number.isNaN(n) ? raw : n;
    }
    if (prop.type === "boolean") return raw === "true" ? true : raw === "false" ? false : raw;
    return raw;
  }

  // ---- the request bodies ----
  function jobBody() {
    const body = {};
    if (state.source === "config") {
      try {
        body.model_config = JSON.parse(state.config);
      } catch (err) {
        return { localError: `model_config: is not valid JSON yet (${err.message})`, field: "model_config" };
      }
    } else if (state.model) {
      body.model = state.model;
    }
    Object.assign(body, state.fields);
    return body;
  }

  async function call(path, init) {
    let response;
    try {
      response = await fetch(path, init);
    } catch (err) {
      if (err.name === "AbortError") throw err;
      return { error: { message: `the server could not be reached (${err.message})` } };
    }
    let data;
    try {
      data = await response.json();
    } catch {
      return { error: { status: response.status, message: `the server answered ${response.status} without JSON` } };
    }
    if (!response.ok) return { error: data.error || { status: response.status, message: JSON.stringify(data) } };
    return { data };
  }
  const postJSON = (path, body, signal) => call(path, {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body), signal });

  // ---- the form, generated from the schema ----
  function helpText(prop) {
    return (prop.description || "").replace(/\s*One of: [^.]*\.\s*/, " ").trim();
  }
  function defaultText(prop) {
    const m = /\(default: ([^)]*)\)/.exec(prop.description || "");
    return m ? m[1] : "";
  }

  function control(name, prop) {
    const id = "f-" + name;
    const help = helpText(prop);
    const wrap = el("div", { class: "field", "data-name": name });
    const label = LABELS[name]
      ? el("label", { for: id }, LABELS[name], " ", el("code", { class: "key", text: name }))
      : el("label", { for: id }, name.replaceAll("_", " "));
    let input;
    if (prop.enum) {
      const dflt = defaultText(prop);
      input = el("select", { id }, el("option", { value: "", text: dflt ? `default (${dflt})` : "default" }),
        ...prop.enum.map((v) => el("option", { value: v, text: v })));
    } else if (prop.type === "boolean") {
      input = el("select", { id }, el("option", { value: "", text: "default" }),
        el("option", { value: "true", text: "on" }), el("option", { value: "false", text: "off" }));
    } else if (prop.type === "integer" || prop.type === "number") {
      input = el("input", { id, type: "number", step: prop.type === "integer" ? "1" : "any",
        inputmode: prop.type === "integer" ? "numeric" : "decimal", placeholder: defaultText(prop) || "default" });
    } else {
      input = el("input", { id, type: "text", spellcheck: "false", placeholder: defaultText(prop) || "default" });
    }
    input.dataset.field = name;
    input.dataset.kind = prop.enum ? "string" : prop.type;
    const hid = id + "-help";
    input.setAttribute("aria-describedby", hid);
    wrap.append(label, input, el("p", { class: "help", id: hid, text: help }));
    return wrap;
  }

  function buildForm() {
    const holder = $("#groups");
    holder.replaceChildren();
    const placed = new Set(FIXED);
    const sections = GROUPS.map(([title, open, names]) => [title, open, names.filter((n) => n in schema)]);
    for (const [, , names] of sections) names.forEach((n) => placed.add(n));
    const rest = Object.keys(schema).filter((n) => !placed.has(n) && SCALAR.has(schema[n].type));
    if (rest.length) sections.push(["More", false, rest]);
    for (const [title, open, names] of sections) {
      if (!names.length) continue;
      const details = el("details", { class: "box group", open });
      details.append(el("summary", { text: title }), el("div", { class: "grid" },
        ...names.map((n) => control(n, schema[n]))));
      holder.append(details);
    }
    $("#f-gpus").placeholder = defaultText(schema.gpus || {}) || "1";
    $("#f-gpus").setAttribute("aria-describedby", "f-gpus-help");
    $("#gpu-box").append(el("p", { class: "help", id: "f-gpus-help", text: helpText(schema.gpus || {}) }));
  }

  function fillCatalogues() {
    const preset = $("#f-preset");
    preset.replaceChildren(...models.map((m) => el("option", { value: m.name,
      text: `${m.name} — ${count(m.total_params)}${m.is_moe ? " MoE" : ""}` })));
    const gpu = $("#f-gpu");
    gpu.replaceChildren(...gpus.map((g) => el("option", { value: g.name,
      text: `${g.name} — ${g.description} (${gib(g.total_bytes)})` })));
  }

  function showState() {
    for (const radio of document.querySelectorAll("input[name=model_source]")) radio.checked = radio.value === state.source;
    for (const box of document.querySelectorAll(".src")) box.hidden = box.dataset.source !== state.source;
    if (state.source === "preset") $("#f-preset").value = state.model;
    if (state.source === "hub") $("#f-hub").value = state.model;
    if (state.source === "config") $("#f-config").value = state.config;
    showPresetInfo();
    for (const input of document.querySelectorAll("#job [data-field]")) {
      const name = input.dataset.field;
      if (name === "model" || name === "model_config") continue;
      const v = state.fields[name];
      input.value = v === undefined ? "" : String(v);
      if (v !== undefined && input.closest("details")) input.closest("details").open = true;
    }
    $("#fit-top").value = String(state.top);
    $("#d-message").value = state.message;
    $("#d-capacity").value = state.capacity;
    $("#d-alloc").value = state.alloc;
    $("#d-usejob").checked = state.usejob;
    selectPanel(state.panel, false);
  }

  function showPresetInfo() {
    const m = models.find((x) => x.name === state.model);
    $("#preset-info").textContent = m && state.source === "preset"
      ? `${m.description.split(" — ")[0]} · ${m.num_layers} layers · hidden ${m.hidden_size}` : "";
  }

  function onFieldInput(event) {
    const input = event.target;
    const name = input.dataset.field;
    if (!name || name === "model" || name === "model_config") return;
    // Numbers are sent as they are typed; choices and free text when they change (Enter, leaving the field).
    const onInput = input.tagName === "INPUT" && input.type === "number";
    if ((event.type === "input") !== onInput) return;
    const raw = input.value.trim();
    if (raw === "") delete state.fields[name];
    else state.fields[name] = typed({ type: input.dataset.kind }, raw);
    changed();
  }

  function changed() {
    writeURL();
    markFitStale();
    scheduleEstimate();
  }

  // ---- estimate ----
  let estimateTimer = null;
  let estimateAbort = null;
  let estimateSeq = 0;

  function scheduleEstimate() {
    clearTimeout(estimateTimer);
    $("#estimate-out").dataset.state = "pending";
    estimateTimer = setTimeout(runEstimate, 150);
  }

  async function runEstimate() {
    const body = jobBody();
    const seq = ++estimateSeq;
    const out = $("#estimate-out");
    if (body.localError) {
      showError("estimate", { message: body.localError, field: body.field });
      out.dataset.state = "error";
      return;
    }
    if (estimateAbort) estimateAbort.abort();
    estimateAbort = new AbortController();
    out.dataset.state = "pending";
    let answer;
    try {
      answer = await postJSON("/v1/estimate", body, estimateAbort.signal);
    } catch (err) {
      if (err.name === "AbortError") return;
      throw err;
    }
    if (seq !== estimateSeq) return;
    out.dataset.request = JSON.stringify(body);
    if (answer.error) {
      showError("estimate", answer.error);
      out.dataset.state = "error";
      out.classList.add("stale");
      return;
    }
    showError("estimate", null);
    out.classList.remove("stale");
    renderEstimate(answer.data);
    out.dataset.state = "done";
  }

  function showError(where, error) {
    const box = $(`#${where}-error`);
    for (const bad of document.querySelectorAll(`[data-error-of=${where}]`)) bad.remove();
    for (const bad of document.querySelectorAll(`[aria-invalid][data-invalid-of=${where}]`)) {
      bad.removeAttribute("aria-invalid");
      delete bad.dataset.invalidOf;
    }
    if (!error) {
      box.hidden = true;
      box.replaceChildren();
      return;
    }
    const field = fieldName(error.field);
    box.replaceChildren(el("strong", { text: error.status ? `The server refused this (${error.status}): ` : "" }),
      el("span", { class: "message", text: error.message || "unknown error" }));
    if (error.field) box.append(el("span", { class: "tag", text: `field: ${error.field}` }));
    box.dataset.field = field;
    box.hidden = false;
    const input = inputFor(field);
    if (input) {
      input.setAttribute("aria-invalid", "true");
      input.dataset.invalidOf = where;
      const details = input.closest("details");
      if (details) details.open = true;
      input.closest(".field, .src, div")?.append(el("p", { class: "field-error", "data-error-of": where,
        text: error.rule ? `${error.rule}` : error.message }));
    }
  }

  function inputFor(field) {
    if (field === "model" || field === "MODEL") return state.source === "hub" ? $("#f-hub") : $("#f-preset");
    if (field === "model_config") return $("#f-config");
    return document.getElementById("f-" + field);
  }

  function renderEstimate(doc) {
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
    const table = el("table", { class: "plain" }, el("tr", {}, ...["input", "setting", "value", "effect"]
      .map((h) => el("th", { scope: "col", text: h }))));
    for (const s of rows) {
      table.append(el("tr", {}, ...[s.source, s.name, JSON.stringify(s.value), s.effect]
        .map((t) => el("td", { text: t === undefined ? "" : String(t) }))));
    }
    holder.append(el("h4", { text: "What the inputs said" }), table);
  }

  // ---- charts (hand-written SVG) ----
  const SVG = "http://www.w3.org/2000/svg";
  const svg = (tag, attrs = {}, text) => {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  };
  function niceStep(max, ticks) {
    const raw = max / ticks;
    const mag = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 2.5, 5, 10].map((f) => f * mag).find((s) => s >= raw) || raw;
  }

  function categories(stages) {
    const names = [];
    for (const s of stages) for (const k of Object.keys(s.by_category || {})) if (!names.includes(k)) names.push(k);
    return names;
  }

  function drawStages(doc) {
    const stages = doc.stages || [];
    const names = categories(stages);
    const used = names.filter((n) => stages.some((s) => s.by_category[n] > 0));
    const colour = (n) => PALETTE[names.indexOf(n) % PALETTE.length];
    const usable = doc.gpu ? doc.gpu.usable_bytes : 0;
    const top = Math.max(usable, ...stages.map((s) => s.peak_reserved_bytes)) / GiB || 1;
    const step = niceStep(top, 5);
    const yMax = Math.ceil(top / step) * step;
    const W = 640, H = 300, L = 52, R = 12, T = 14, B = 34;
    const y = (g) => T + (H - T - B) * (1 - g / yMax);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "stack",
      "aria-label": `Stacked memory per pipeline stage; peak ${gib(doc.peak_allocated_bytes)} allocated on stage ` +
        `${doc.peak_stage}` });
    for (let g = 0; g <= yMax + 1e-9; g += step) {
      root.append(svg("line", { x1: L, x2: W - R, y1: y(g), y2: y(g), class: "grid" }),
        svg("text", { x: L - 6, y: y(g) + 4, class: "tick", "text-anchor": "end" }, fmtTick(g)));
    }
    const slot = (W - L - R) / Math.max(stages.length, 1);
    const bar = Math.max(2, Math.min(90, slot * 0.7));
    const labelEvery = Math.ceil(stages.length / 16);
    stages.forEach((s, i) => {
      const x = L + slot * i + (slot - bar) / 2;
      let acc = 0;
      const group = svg("g", { class: "bar" + (s.stage === doc.peak_stage ? " peak" : "") });
      for (const n of used) {
        const v = s.by_category[n] || 0;
        if (!v) continue;
        const rect = svg("rect", { x, width: bar, y: y((acc + v) / GiB), height: Math.max(0, y(acc / GiB) - y((acc + v) / GiB)),
          fill: colour(n) });
        rect.append(svg("title", {}, `stage ${s.stage} · ${human(n)}: ${gib(v)}`));
        group.append(rect);
        acc += v;
      }
      const reserved = svg("rect", { x, width: bar, y: y(s.peak_reserved_bytes / GiB),
        height: Math.max(0, y(s.peak_allocated_bytes / GiB) - y(s.peak_reserved_bytes / GiB)), class: "reserved" });
      reserved.append(svg("title", {}, `stage ${s.stage} · reserved beyond allocated (fragmentation): ` +
        gib(s.peak_reserved_bytes - s.peak_allocated_bytes)));
      group.append(reserved);
      if (i % labelEvery === 0) {
        group.append(svg("text", { x: x + bar / 2, y: H - B + 16, class: "tick", "text-anchor": "middle" },
          stages.length > 8 ? String(s.stage) : `stage ${s.stage}${s.stage === doc.peak_stage ? " *" : ""}`));
      }
      root.append(group);
    });
    if (usable) {
      root.append(svg("line", { x1: L, x2: W - R, y1: y(usable / GiB), y2: y(usable / GiB), class: "limit" }),
        svg("text", { x: W - R, y: y(usable / GiB) - 4, class: "tick limit-label", "text-anchor": "end" },
          `usable ${gib(usable)}`));
    }
    root.append(svg("text", { x: 12, y: T + (H - T - B) / 2, class: "tick", transform: `rotate(-90 12 ${T + (H - T - B) / 2})`,
      "text-anchor": "middle" }, "GiB"));
    $("#chart").replaceChildren(root);
    $("#legend").replaceChildren(...used.map((n) => el("li", {}, el("i", { style: `background:${colour(n)}` }), human(n))),
      el("li", {}, el("i", { class: "reserved-swatch" }), "reserved, not allocated"),
      ...(usable ? [el("li", {}, el("i", { class: "limit-swatch" }), "usable GPU memory")] : []));
  }
  const fmtTick = (g) => (Number.isInteger(g) ? String(g) : g.toFixed(1));

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

  // ---- fit ----
  let fitDone = false;
  function markFitStale() {
    if (fitDone) $("#fit-status").textContent = "The knobs changed since this search: run it again.";
  }

  async function runFit() {
    const body = jobBody();
    if (body.localError) {
      showError("fit", { message: body.localError, field: body.field });
      return;
    }
    body.top = state.top;
    const button = $("#fit-run");
    button.disabled = true;
    $("#fit-status").textContent = "Searching…";
    $("#panel-fit").dataset.state = "pending";
    const left = [];
    let answer;
    // The search refuses the knobs it chooses itself (and says which): leave each out and ask again.
    for (let tries = 0; tries < 64; tries++) {
      answer = await postJSON("/v1/fit", body);
      const e = answer.error;
      const name = e && fieldName(e.field);
      if (e && e.status === 400 && /chosen by the layout search/.test(e.rule || "") && name in body) {
        delete body[name];
        left.push(name);
        continue;
      }
      break;
    }
    button.disabled = false;
    fitDone = true;
    $("#panel-fit").dataset.state = answer.error ? "error" : "done";
    $("#fit-status").textContent = left.length ? `Left out (the search chooses them): ${left.join(", ")}.` : "";
    if (answer.error) {
      showError("fit", answer.error);
      $("#fit-table").replaceChildren();
      $("#fit-summary").textContent = "";
      return;
    }
    showError("fit", null);
    renderFit(answer.data);
  }

  function renderFit(doc) {
    $("#fit-summary").textContent = `${doc.fitting} layout${doc.fitting === 1 ? "" : "s"} fit ${doc.gpus} × ` +
      `${doc.gpu} (limit ${gib(doc.limit_bytes)} = usable less a ${Math.round(doc.margin * 100)}% margin), ` +
      `seq ${doc.seq_length}, global batch ${doc.global_batch_size}, ${doc.framework}; ` +
      `${doc.layouts_searched} layouts searched, ${doc.estimates} estimates in ${doc.seconds.toFixed(2)} s.`;
    const cols = ["#", "layout", "allocated", "reserved", "headroom", "step time", "tokens/s", "MFU", ""];
    const table = $("#fit-table");
    const rows = (doc.candidates || []).map((c, i) => {
      const use = el("button", { type: "button", class: "ghost small", text: "Use",
        "aria-label": `Use layout ${c.label} in the estimate` });
      use.addEventListener("click", () => useLayout(c));
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

  function useLayout(c) {
    const keep = {};
    for (const k of ["gpu", "gpus", "seq", "gbs"]) if (k in state.fields) keep[k] = state.fields[k];
    for (const [k, v] of Object.entries(state.fields)) {
      if (!(k in schema) || ["tp", "pp", "vpp", "cp", "ep", "etp", "dp", "mbs", "zero", "fsdp",
        "distributed_optimizer", "recompute", "sequence_parallel"].includes(k)) continue;
      keep[k] = v;
    }
    const job = c.job || {};
    const sh = job.sharding || {};
    const set = { tp: c.tp, pp: c.pp, vpp: c.vpp, cp: c.cp, ep: c.ep, mbs: c.micro_batch_size,
      gbs: c.global_batch_size, recompute: (job.recompute || {}).mode || c.recompute };
    if ((job.parallel || {}).sequence_parallel) set.sequence_parallel = true;
    if (sh.zero) set.zero = sh.zero;
    if (sh.fsdp && sh.fsdp !== "none") set.fsdp = sh.fsdp;
    if (sh.distributed_optimizer) set.distributed_optimizer = true;
    for (const [k, v] of Object.entries(set)) {
      if (v === undefined || v === null || !(k in schema)) continue;
      if (schema[k].enum && !schema[k].enum.includes(v)) continue;
      keep[k] = v;
    }
    state.fields = keep;
    selectPanel("estimate", true);
    showState();
    changed();
  }

  // ---- doctor ----
  async function runDoctor() {
    const fields = {};
    if (state.message.trim()) fields.message = state.message;
    if (state.capacity.trim()) fields.capacity = state.capacity.trim();
    if (state.alloc.trim()) fields.alloc_conf = state.alloc.trim();
    if (state.usejob) {
      const job = jobBody();
      if (job.localError) {
        showError("doctor", { message: job.localError, field: job.field });
        return;
      }
      fields.job = job;
    }
    let init;
    if (doctorFile) {
      const form = new FormData();
      for (const [k, v] of Object.entries(fields)) form.append(k, k === "job" ? JSON.stringify(v) : v);
      form.append("file", doctorFile, doctorFile.name);
      init = { method: "POST", body: form };
    } else {
      init = { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(fields) };
    }
    $("#d-run").disabled = true;
    $("#d-status").textContent = "Diagnosing…";
    $("#panel-doctor").dataset.state = "pending";
    const answer = await call("/v1/doctor", init);
    $("#d-run").disabled = false;
    $("#d-status").textContent = "";
    $("#panel-doctor").dataset.state = answer.error ? "error" : "done";
    if (answer.error) {
      showError("doctor", answer.error);
      $("#doctor-out").replaceChildren();
      return;
    }
    showError("doctor", null);
    renderDoctor(answer.data);
  }

  function evidenceValue(e) {
    if (e.unit === "bytes" && typeof e.value === "number") return gib(e.value);
    if (e.unit === "fraction" && typeof e.value === "number") return (100 * e.value).toFixed(1) + "%";
    if (e.value === null) return "—";
    return String(e.value) + (["", "bytes", "text"].includes(e.unit) ? "" : " " + e.unit);
  }

  function renderDoctor(doc) {
    const out = $("#doctor-out");
    const head = el("div", { id: "doctor-verdict", class: `verdict v-${doc.verdict} ${doc.verdict === "fits" ? "ok" : "bad"}`,
      "data-verdict": doc.verdict }, el("span", { text: doc.verdict_text || doc.verdict }));
    const parts = [head];
    if (doc.message) parts.push(oomBar(doc.message));
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
        el("p", { class: "help", text: x.verification })))));
    }
    if ((doc.notes || []).length) parts.push(el("ul", { class: "notes" }, ...doc.notes.map((n) => el("li", { text: n }))));
    out.replaceChildren(...parts);
  }

  // The GPU at the moment of the OOM, from the message's own figures: what PyTorch allocated, what it
  // reserved but had not allocated, what others held, and what was free — beside what was requested.
  function oomBar(m) {
    const total = m.total_capacity && m.total_capacity.bytes;
    const wrap = el("figure", { class: "chart oom" });
    if (!total) return wrap;
    const allocated = (m.allocated && m.allocated.bytes) || 0;
    const idle = (m.reserved_unallocated && m.reserved_unallocated.bytes) || 0;
    const free = (m.free && m.free.bytes) || 0;
    const other = Math.max(0, total - free - allocated - idle);
    const requested = (m.requested && m.requested.bytes) || 0;
    const parts = [["allocated by PyTorch", allocated, PALETTE[0]], ["reserved, unallocated", idle, PALETTE[1]],
      ["outside this PyTorch", other, PALETTE[7]], ["free", free, "transparent"]];
    const W = 640, H = 74, L = 8, R = 8;
    const scale = (W - L - R) / Math.max(total, allocated + idle + other + free);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "stack",
      "aria-label": `GPU memory at the OOM: ${parts.map(([n, v]) => `${n} ${gib(v)}`).join(", ")}; requested ${gib(requested)}` });
    let x = L;
    for (const [name, v, fill] of parts) {
      if (!v) continue;
      const r = svg("rect", { x, y: 10, width: v * scale, height: 28, fill, class: fill === "transparent" ? "free" : "" });
      r.append(svg("title", {}, `${name}: ${gib(v)}`));
      root.append(r);
      x += v * scale;
    }
    if (requested) {
      // Drawn to scale, ending at the right edge: set against the free memory above it.
      const w = Math.max(2, Math.min(requested * scale, W - L - R));
      const req = svg("rect", { x: W - R - w, y: 44, width: w, height: 10, class: "requested" });
      req.append(svg("title", {}, `requested: ${gib(requested)}`));
      root.append(req, svg("text", { x: W - R, y: 68, class: "tick", "text-anchor": "end" },
        `requested ${gib(requested)}${requested > free ? " > free " + gib(free) : ""}`));
    }
    wrap.append(el("figcaption", { text: `The GPU when it ran out (${gib(total)} total), from the message` }), root,
      el("ul", { class: "legend" }, ...parts.map(([n, v, fill]) => el("li", {},
        el("i", { style: `background:${fill}`, class: fill === "transparent" ? "free-swatch" : null }), `${n}: ${gib(v)}`)),
        el("li", {}, el("i", { class: "requested-swatch" }), "requested")));
    return wrap;
  }

  function setDoctorFile(file) {
    doctorFile = file || null;
    $("#d-clear").hidden = !doctorFile;
    $("#drop").classList.toggle("has-file", !!doctorFile);
    $("#drop .hint").textContent = doctorFile ? `${doctorFile.name} (${gib(doctorFile.size)})` : "or drop it here";
    if (!doctorFile) $("#d-file").value = "";
  }

  // ---- panels (tabs) ----
  function selectPanel(panel, focus) {
    state.panel = panel;
    for (const tab of document.querySelectorAll("[role=tab]")) {
      const on = tab.dataset.panel === panel;
      tab.setAttribute("aria-selected", String(on));
      tab.tabIndex = on ? 0 : -1;
      if (on && focus) tab.focus();
      $("#" + tab.getAttribute("aria-controls")).hidden = !on;
    }
    document.body.dataset.panel = panel;
  }

  function wire() {
    const form = $("#job");
    form.addEventListener("input", onFieldInput);
    form.addEventListener("change", onFieldInput);
    form.addEventListener("submit", (e) => e.preventDefault());
    for (const radio of document.querySelectorAll("input[name=model_source]")) {
      radio.addEventListener("change", () => {
        state.source = radio.value;
        state.model = state.source === "preset" ? $("#f-preset").value : state.source === "hub" ? $("#f-hub").value.trim() : "";
        state.config = $("#f-config").value;
        showState();
        changed();
      });
    }
    $("#f-preset").addEventListener("change", (e) => { state.model = e.target.value; showPresetInfo(); changed(); });
    $("#f-hub").addEventListener("change", (e) => { state.model = e.target.value.trim(); changed(); });
    $("#f-config").addEventListener("input", (e) => {
      state.config = e.target.value;
      const ok = (() => { try { JSON.parse(state.config); return true; } catch { return false; } })();
      $("#config-info").textContent = ok ? "" : "Not valid JSON yet.";
      changed();
    });
    $("#reset").addEventListener("click", () => {
      state.fields = { gpu: state.fields.gpu, gpus: state.fields.gpus };
      showState();
      changed();
    });
    const tabs = [...document.querySelectorAll("[role=tab]")];
    tabs.forEach((tab, i) => {
      tab.addEventListener("click", () => { selectPanel(tab.dataset.panel, false); writeURL(); });
      tab.addEventListener("keydown", (e) => {
        const move = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
        const to = e.key === "Home" ? 0 : e.key === "End" ? tabs.length - 1 : move ? (i + move + tabs.length) % tabs.length : null;
        if (to === null) return;
        e.preventDefault();
        selectPanel(tabs[to].dataset.panel, true);
        writeURL();
      });
    });
    $("#fit-run").addEventListener("click", runFit);
    $("#fit-top").addEventListener("change", (e) => { state.top = Math.max(1, parseInt(e.target.value, 10) || 10); writeURL(); });
    $("#d-run").addEventListener("click", runDoctor);
    $("#d-message").addEventListener("input", (e) => { state.message = e.target.value; writeURL(); });
    $("#d-capacity").addEventListener("input", (e) => { state.capacity = e.target.value; writeURL(); });
    $("#d-alloc").addEventListener("input", (e) => { state.alloc = e.target.value; writeURL(); });
    $("#d-usejob").addEventListener("change", (e) => { state.usejob = e.target.checked; writeURL(); });
    $("#d-file").addEventListener("change", (e) => setDoctorFile(e.target.files[0]));
    $("#d-clear").addEventListener("click", () => setDoctorFile(null));
    const drop = $("#panel-doctor");
    drop.addEventListener("dragover", (e) => { e.preventDefault(); $("#drop").classList.add("over"); });
    drop.addEventListener("dragleave", () => $("#drop").classList.remove("over"));
    drop.addEventListener("drop", (e) => {
      e.preventDefault();
      $("#drop").classList.remove("over");
      if (e.dataTransfer.files.length) setDoctorFile(e.dataTransfer.files[0]);
    });
    window.addEventListener("popstate", () => { readURL(); showState(); scheduleEstimate(); });
  }

  async function start() {
    const [spec, m, g] = await Promise.all([call("/v1/openapi.json"), call("/v1/models"), call("/v1/gpus")]);
    const failed = [spec, m, g].find((x) => x.error);
    if (failed) {
      showError("estimate", failed.error);
      return;
    }
    schema = spec.data.components.schemas.Job.properties;
    models = m.data;
    gpus = g.data;
    buildForm();
    fillCatalogues();
    readURL();
    showState();
    writeURL();
    wire();
    document.body.dataset.ready = "true";
    runEstimate();
    if (state.panel === "fit") runFit();
    if (state.panel === "doctor" && state.message.trim()) runDoctor();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
