// The page's small helpers: building DOM and SVG nodes, formatting bytes, calling the API.
// Bytes stay integers until they are shown; GiB = 2^30 bytes.

export const GiB = 2 ** 30;
// Okabe-Ito: distinguishable with colour-blindness (the HTML report uses the same palette).
export const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999",
  "#332288", "#882255", "#44AA99"];
const CATEGORY_LABELS = {
  parameter: "parameters", gradient: "gradients", optimizer_state: "optimizer states (moments)",
  master_weight: "master weights", activation: "activations", logits: "loss / logits", temporary: "temporaries",
  input: "inputs", buffer: "buffers", communication: "communication buffers", workspace: "workspace (cuBLAS / TE)",
};

export const $ = (sel, root = document) => root.querySelector(sel);

/** An HTML element: attrs (text = its text, class, others as attributes; null/false left out), then children. */
export function el(tag, attrs = {}, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) node.append(kid);
  return node;
}

/** An SVG element with attributes and optional text. */
export function svg(tag, attrs = {}, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

export const gib = (bytes) => (bytes / GiB).toFixed(2) + " GiB";
export const count = (n) => (n >= 1e9 ? (n / 1e9).toFixed(2) + " B" : n >= 1e6 ? (n / 1e6).toFixed(1) + " M" : String(n));
/** A memory category's name for people (the estimate's by_category keys). */
export const human = (name) => CATEGORY_LABELS[name] || name.replaceAll("_", " ");
/** The job field an error names: "--tp" → "tp", "gpus[0].jobs" → "gpus", "job: tp" → "job". */
export const fieldName = (name) => String(name || "").replace(/^-+/, "").replaceAll("-", "_").split(/[\s:.[]/)[0];

/** Fetch ``path``; the answer as {data} or {error: the server's error object}. Aborts propagate. */
export async function call(path, init) {
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

export const postJSON = (path, body, signal) => call(path, {
  method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body), signal });
