// The job form, generated from GET /v1/openapi.json (components.schemas.Job): every scalar field of
// the schema gets a control of its type (choices from its enum, its default and help from its
// description), so the form cannot drift from what the server accepts. GROUPS only lays them out.

import { $, el } from "./dom.js";

// Which section a field sits in. Fields the schema does not have are skipped; fields it has that
// are not listed here appear under "More".
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
// One line under a section's title.
const GROUP_NOTES = { "Fine-tuning": "QLoRA = PEFT method lora with the base quantized to nf4.",
  "Framework config files": "Paste a file's content (JSON where the field takes an object); sent when you leave the box." };
const LABELS = {
  tp: "Tensor parallel", pp: "Pipeline parallel", vpp: "Virtual pipeline", cp: "Context parallel",
  dp: "Data parallel", ep: "Expert parallel", etp: "Expert tensor parallel", mbs: "Micro-batch",
  gbs: "Global batch", seq: "Sequence length", zero: "ZeRO stage", fsdp: "FSDP", peft: "PEFT method",
  quantize_base: "Quantize base (QLoRA)", fp8: "FP8", loss: "Loss / logits", recompute: "Recompute policy",
  precision: "Precision", framework: "Framework", optimizer: "Optimizer", attention: "Attention kernel",
  distributed_optimizer: "Distributed optimizer", sequence_parallel: "Sequence parallel",
};
// Fields with a fixed place in the form (model and GPU boxes).
const FIXED = new Set(["model", "model_config", "gpu", "gpus"]);
const SCALAR = new Set(["integer", "number", "string", "boolean"]);
// Fields that hold a whole file's content (the job-file dialects): a text area each. Any other field
// whose schema type is not one scalar is given one too.
const FILE_FIELDS = ["megatron_args", "deepspeed_config", "hf_args", "peft_config", "torchtitan_config"];
const isFile = (name, prop) => FILE_FIELDS.includes(name) || !SCALAR.has(prop.type);

/** The field's help without its choices (the select lists them) and its default (the placeholder shows it:
 * "(default: 1)" beside a typed 8 reads as a contradiction). */
export function helpText(prop) {
  return (prop.description || "").replace(/\s*One of: [^.]*\.\s*/, " ").replace(/\s*\(default: [^)]*\)/, "").trim();
}
export function defaultText(prop) {
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
  } else if (isFile(name, prop)) {
    input = el("textarea", { id, rows: "4", spellcheck: "false", placeholder: "the file's content" });
  } else {
    input = el("input", { id, type: "text", spellcheck: "false", placeholder: defaultText(prop) || "default" });
  }
  input.dataset.field = name;
  if (input.placeholder) input.title = input.placeholder;  // a narrow field cuts its placeholder: hover shows it whole
  const hid = id + "-help";
  input.setAttribute("aria-describedby", hid);
  wrap.append(label, input, el("p", { class: "help", id: hid, text: help }));
  return wrap;
}

/** Build the knob sections into #groups from the Job schema's properties. */
export function buildForm(schema) {
  const holder = $("#groups");
  holder.replaceChildren();
  const placed = new Set(FIXED);
  const sections = GROUPS.map(([title, open, names]) => [title, open, names.filter((n) => n in schema)]);
  for (const [, , names] of sections) names.forEach((n) => placed.add(n));
  const files = Object.keys(schema).filter((n) => !placed.has(n) && isFile(n, schema[n]));
  files.forEach((n) => placed.add(n));
  const rest = Object.keys(schema).filter((n) => !placed.has(n));
  if (rest.length) sections.push(["More", false, rest]);
  if (files.length) sections.push(["Framework config files", false, files]);
  for (const [title, open, names] of sections) {
    if (!names.length) continue;
    const details = el("details", { class: "box group", open });
    details.append(el("summary", { text: title }));
    if (GROUP_NOTES[title]) details.append(el("p", { class: "hint", text: GROUP_NOTES[title] }));
    details.append(el("div", { class: "grid" },
      ...names.map((n) => control(n, schema[n]))));
    holder.append(details);
  }
  $("#f-gpus").placeholder = defaultText(schema.gpus || {}) || "1";
  $("#f-gpus").title = "default: " + $("#f-gpus").placeholder;
  $("#f-gpus").setAttribute("aria-describedby", "f-gpus-help");
  $("#gpu-box").append(el("p", { class: "help", id: "f-gpus-help", text: helpText(schema.gpus || {}) }));
}

/** A query-string or input value as the schema's type ("8" → 8, "true" → true, JSON text → an object
 * where the field takes one); a bad value stays text (the server names the field and the rule). */
export function typed(prop, raw) {
  const types = [prop.type].flat();
  if (types.includes("object") || types.includes("array")) {
    try {
      const value = JSON.parse(raw);
      if (typeof value === "object" && value !== null) return value;
    } catch {
      // not JSON: sent as text (a command line where the field takes one)
    }
    return raw;
  }
  if (prop.type === "integer" || prop.type === "number") {
    const n = Number(raw);
    return raw === "" || Number.isNaN(n) ? raw : n;
  }
  if (prop.type === "boolean") return raw === "true" ? true : raw === "false" ? false : raw;
  return raw;
}
