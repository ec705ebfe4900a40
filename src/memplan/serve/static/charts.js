// The page's charts, hand-written SVG: the estimate's per-stage stacked bars and the doctor's
// picture of the GPU at the moment of an OOM. Sizes come from the server's documents, unchanged.

import { $, GiB, PALETTE, el, gib, human, svg } from "./dom.js";

function niceStep(max, ticks) {
  const raw = max / ticks;
  const mag = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 2.5, 5, 10].map((f) => f * mag).find((s) => s >= raw) || raw;
}

/** The memory categories of the stages' by_category, in the server's order. */
export function categories(stages) {
  const names = [];
  for (const s of stages) for (const k of Object.keys(s.by_category || {})) if (!names.includes(k)) names.push(k);
  return names;
}

/** The per-stage stacked bars of an estimate document, into #chart and #legend. */
export function drawStages(doc) {
  const stages = doc.stages || [];
  const names = categories(stages);
  const used = names.filter((n) => stages.some((s) => s.by_category[n] > 0));
  const colour = (n) => PALETTE[names.indexOf(n) % PALETTE.length];
  const usable = doc.gpu ? doc.gpu.usable_bytes : 0;
  const top = Math.max(usable, ...stages.map((s) => s.peak_reserved_bytes)) / GiB || 1;
  const step = niceStep(top, 5);
  const yMax = Math.ceil(top / step) * step;
  // As wide as its box (text stays at its CSS size); 640 while the panel is hidden.
  const W = Math.max(320, Math.min(960, $("#chart").clientWidth || 640)), H = 300, L = 52, R = 12, T = 14, B = 34;
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

// The GPU at the moment of the OOM, from the message's own figures: what PyTorch allocated, what it
// reserved but had not allocated, what others held, and what was free, beside what was requested.
export function oomBar(m) {
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

/** The doctor's live-bytes timeline (doc.timeline): the most live in each stretch of events, iteration
 * boundaries, the peak, the capacity and where the replay ran out. Null without a timeline. */
export function timelineChart(doc) {
  const t = doc.timeline;
  if (!t || !(t.points || []).length) return null;
  const points = t.points;  // [last event index, live bytes, iteration]
  const last = points[points.length - 1][0] || 1;
  const top = Math.max(...points.map((p) => p[1]), doc.capacity_bytes || 0) || 1;
  const W = 640, H = 200, L = 52, R = 10, T = 10, B = 28;
  const x = (i) => L + (W - L - R) * (i / last);
  const y = (v) => T + (H - T - B) * (1 - v / top);
  const step = niceStep(top / GiB, 4);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "timeline", id: "doctor-timeline",
    "aria-label": `Live memory over ${last + 1} events; peak ${gib(t.peak_live_bytes || 0)}` +
      (doc.capacity_bytes ? `; capacity ${gib(doc.capacity_bytes)}` : "") });
  for (let g = 0; g * step * GiB <= top; g++) {
    root.append(svg("line", { x1: L, x2: W - R, y1: y(g * step * GiB), y2: y(g * step * GiB), class: "grid" }),
      svg("text", { x: L - 6, y: y(g * step * GiB) + 4, class: "tick", "text-anchor": "end" }, `${+(g * step).toFixed(2)}`));
  }
  for (let k = 1; k < points.length; k++) {  // iteration boundaries
    if (points[k][2] !== points[k - 1][2]) {
      root.append(svg("line", { x1: x(points[k - 1][0]), x2: x(points[k - 1][0]), y1: T, y2: H - B, class: "iteration" }));
    }
  }
  const path = points.map((p, k) => `${k ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
  root.append(svg("path", { d: `${path} L${x(last).toFixed(1)},${y(0)} L${x(points[0][0]).toFixed(1)},${y(0)} Z`,
    class: "area", fill: PALETTE[0], "fill-opacity": "0.18" }));
  root.append(svg("path", { d: path, fill: "none", stroke: PALETTE[0], "stroke-width": 1.5 }));
  if (doc.capacity_bytes) {
    root.append(svg("line", { x1: L, x2: W - R, y1: y(doc.capacity_bytes), y2: y(doc.capacity_bytes), class: "limit" }),
      svg("text", { x: L + 4, y: y(doc.capacity_bytes) - 4, class: "tick limit-label" },
        `capacity ${gib(doc.capacity_bytes)}`));
  }
  if (t.peak_index !== null && t.peak_index !== undefined) {
    const right = x(t.peak_index) > (L + W - R) / 2;  // label on the side with room
    root.append(svg("circle", { cx: x(t.peak_index), cy: y(t.peak_live_bytes), r: 3.5, fill: PALETTE[5] }),
      svg("text", { x: x(t.peak_index) + (right ? -7 : 7), y: y(t.peak_live_bytes) + 16, class: "tick",
        "text-anchor": right ? "end" : "start" }, `peak ${gib(t.peak_live_bytes)}`));
  }
  if (t.oom_index !== null && t.oom_index !== undefined) {
    root.append(svg("line", { x1: x(t.oom_index), x2: x(t.oom_index), y1: T, y2: H - B, class: "oom-mark",
      stroke: PALETTE[5], "stroke-dasharray": "4 3" }),
    svg("text", { x: x(t.oom_index) - 4, y: H - B - 6, class: "tick", "text-anchor": "end" }, "out of memory"));
  }
  root.append(svg("text", { x: L, y: H - 8, class: "tick" }, "event 0"),
    svg("text", { x: W - R, y: H - 8, class: "tick", "text-anchor": "end" }, `event ${last}`),
    svg("text", { x: 12, y: T + (H - T - B) / 2, class: "tick", transform: `rotate(-90 12 ${T + (H - T - B) / 2})`,
      "text-anchor": "middle" }, "GiB"));
  return el("figure", { class: "chart timeline-chart" },
    el("figcaption", { text: "Live memory over the run (requested bytes; dotted lines: iteration boundaries)" }), root);
}
