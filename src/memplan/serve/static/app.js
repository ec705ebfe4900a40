// memplan serve: the web page. Plain JavaScript modules, no build step, nothing from another origin.
// This module holds the page's state (mirrored in the URL query string, so a link reproduces the
// view), wires the form and the panels, and sends the requests; form.js builds the knobs from
// GET /v1/openapi.json, estimate.js / fit.js / doctor.js show the server's answers, charts.js draws.

import { drawStages } from "./charts.js";
import { $, call, count, el, fieldName, gib, postJSON } from "./dom.js";
import { datasetRequest, renderDataset } from "./dataset.js";
import { doctorRequest, renderDoctor } from "./doctor.js";
import { renderEstimate } from "./estimate.js";
import { layoutFields, renderFit, searchFit } from "./fit.js";
import { buildForm, typed } from "./form.js";

// Query-string keys of the page itself (not job fields).
const PAGE_KEYS = { panel: "panel", source: "src", top: "fit_top", message: "d_message", capacity: "d_capacity",
  alloc: "d_alloc_conf", usejob: "d_job" };

// ---- state: everything the view shows, mirrored in the URL query string ----
const state = { source: "preset", model: "", config: "", fields: {}, panel: "estimate", top: 10,
  message: "", capacity: "", alloc: "", usejob: false };
let schema = {}; // Job properties from the OpenAPI document
let searched = []; // the job fields the layout search chooses (x-searched-fields of /v1/fit)
let models = [];
let gpus = [];
let doctorFile = null;

function readURL() {
  const q = new URLSearchParams(location.search);
  state.panel = ["estimate", "fit", "doctor", "dataset"].includes(q.get("panel")) ? q.get("panel") : "estimate";
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
  for (const [k, v] of Object.entries(state.fields)) q.set(k, text(v));
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

/** A field's value as text: objects (a pasted config) as JSON. */
const text = (v, indent) => (typeof v === "object" && v !== null ? JSON.stringify(v, null, indent) : String(v));
const compactJSON = (text) => { try { return JSON.stringify(JSON.parse(text)); } catch { return text; } };
const isPreset = (name) => models.some((m) => m.name === name);
const preferred = (list, name) => (list.find((x) => x.name === name) || list[0] || { name: "" }).name;

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
  } else if (state.source === "hub") {
    return { localError: "model: type a Hugging Face Hub id (ORG/NAME) and press Enter", field: "model" };
  }
  Object.assign(body, state.fields);
  return body;
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
    input.value = v === undefined ? "" : text(v, 1);
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
  else state.fields[name] = typed(schema[name] || {}, raw);
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
let lastEstimate = null; // redrawn at the chart's new width when the window or the panel changes
const redraw = () => lastEstimate && drawStages(lastEstimate);

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
  lastEstimate = answer.data;
  renderEstimate(answer.data, gpus);
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

// ---- fit ----
let fitDone = false;
function markFitStale() {
  if (fitDone) $("#fit-status").textContent = "The knobs changed since this search: run it again.";
}

let fitLeft = []; // the fields the last search left out (it chooses them)

async function runFit() {
  const body = jobBody();
  if (body.localError) {
    showError("fit", { message: body.localError, field: body.field });
    return;
  }
  body.top = state.top;
  $("#fit-run").disabled = true;
  $("#fit-status").textContent = "Searching…";
  $("#panel-fit").dataset.state = "pending";
  const { answer, left } = await searchFit(body, searched);
  fitLeft = left;
  $("#fit-run").disabled = false;
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
  renderFit(answer.data, useLayout);
}

function useLayout(candidate) {
  state.fields = layoutFields(candidate, state.fields, schema, fitLeft);
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
  const init = doctorRequest(fields, doctorFile);
  await submitPanel("doctor", "d", "/v1/doctor", init,
    { pending: "Diagnosing…", done: (data) => `Verdict: ${data.verdict}.` }, renderDoctor);
}

// One form panel's request: its button and status while pending, then the answer rendered or its error shown.
async function submitPanel(panel, prefix, url, init, texts, render) {
  $(`#${prefix}-run`).disabled = true;
  $(`#${prefix}-status`).textContent = texts.pending;
  $(`#panel-${panel}`).dataset.state = "pending";
  const answer = await call(url, init);
  $(`#${prefix}-run`).disabled = false;
  $(`#${prefix}-status`).textContent = answer.error ? "Refused." : texts.done(answer.data);
  $(`#panel-${panel}`).dataset.state = answer.error ? "error" : "done";
  if (answer.error) {
    showError(panel, answer.error);
    $(`#${panel}-out`).replaceChildren();
    return;
  }
  showError(panel, null);
  render(answer.data);
}

function setDoctorFile(file) {
  doctorFile = file || null;
  $("#d-clear").hidden = !doctorFile;
  $("#drop").classList.toggle("has-file", !!doctorFile);
  $("#drop .hint").textContent = doctorFile ? `${doctorFile.name} (${gib(doctorFile.size)})` : "or drop it here";
  if (!doctorFile) $("#d-file").value = "";
}

// ---- dataset ----
async function runDataset() {
  const job = jobBody();
  if (job.localError) {
    showError("dataset", { message: job.localError, field: job.field });
    return;
  }
  const options = { [$("#ds-kind").value]: $("#ds-column").value.trim(), batching: $("#ds-batching").value,
    max_length: $("#ds-max").value, seed: $("#ds-seed").value, group_by_length: $("#ds-group").checked ? "true" : "" };
  const request = datasetRequest(job, $("#ds-file").files[0], [...$("#ds-tokenizer").files], options);
  if (request.localError) {
    showError("dataset", { message: request.localError, field: request.field });
    return;
  }
  await submitPanel("dataset", "ds", "/v1/dataset", request.init,
    { pending: "Tokenizing and pricing every step…", done: (data) => `${data.dataset.steps} steps priced.` },
    renderDataset);
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
  if (panel === "estimate") redraw();
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
  $("#ds-run").addEventListener("click", runDataset);
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
  let resizing = null;
  window.addEventListener("resize", () => { clearTimeout(resizing); resizing = setTimeout(redraw, 100); });
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
  const fitBody = spec.data.paths["/v1/fit"].post.requestBody.content["application/json"].schema;
  searched = fitBody["x-searched-fields"] || [];
  models = m.data;
  gpus = g.data;
  const datasetForm = spec.data.paths["/v1/dataset"].post.requestBody.content["multipart/form-data"].schema;
  $("#ds-batching").replaceChildren(...datasetForm.properties.batching.enum.map((r) => el("option", { value: r, text: r })));
  buildForm(schema);
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

start();  // a module runs once the document is parsed
