"""One self-contained HTML report: works offline, no CDN — inline CSS, inline SVG, a few lines of JS.

Sections (each optional except the header):

* the per-stage stacked breakdown of an :class:`~memplan.estimate.result.Estimate`;
* the fit table of a :class:`~memplan.fit.results.FitResult` (sortable by clicking a header);
* a memory timeline by category, from plain data: ``[(op_index, {category: bytes}), ...]``;
* the allocator's segment view, from plain data: ``[{"address": int, "size": int,
  "blocks": [{"offset": int, "size": int, "allocated": bool, "category": str?}, ...]}, ...]``
  (``offset`` relative to the segment start).

The trace/alloc engines produce those plain lists; this module knows nothing else about them.
Sizes are shown in GiB = 2^30 bytes (MiB = 2^20 in the segment view).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memplan.estimate.result import Estimate
    from memplan.fit.results import FitResult

__all__ = ["TimelinePoint", "html_page", "render_html", "write_html"]

TimelinePoint = tuple[int, Mapping[str, int]]
_GIB = 2**30
_MIB = 2**20
#: Colour-blind-friendly palette (Okabe-Ito, then Tableau) cycled over categories.
_PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999",
            "#4E79A7", "#59A14F", "#B07AA1", "#9C755F")

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#555;font-size:13px} table{border-collapse:collapse;font-size:13px}
th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:right} th{background:#f4f4f4;cursor:pointer}
td:first-child,th:first-child,td.l,th.l{text-align:left} .ok{color:#087f23} .bad{color:#b00020}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
svg text{font-size:11px;fill:#333}
"""

_JS = """
document.querySelectorAll('table.sortable th').forEach(function(th, col){
  th.addEventListener('click', function(){
    var body = th.closest('table').tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var asc = th.getAttribute('data-asc') !== '1';
    th.setAttribute('data-asc', asc ? '1' : '0');
    rows.sort(function(a, b){
      var x = a.cells[col].getAttribute('data-v') || a.cells[col].textContent;
      var y = b.cells[col].getAttribute('data-v') || b.cells[col].textContent;
      var nx = parseFloat(x), ny = parseFloat(y);
      var r = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
      return asc ? r : -r;
    });
    rows.forEach(function(r){ body.appendChild(r); });
  });
});
"""


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _color(index: int) -> str:
    return _PALETTE[index % len(_PALETTE)]


def _legend(names: Sequence[str]) -> str:
    items = "".join(f'<span><i style="background:{_color(i)}"></i>{_esc(n)}</span>' for i, n in enumerate(names))
    return f'<div class="legend">{items}</div>'


def _stage_section(est: Estimate) -> str:
    from memplan.report.text import BREAKDOWN_ROWS

    labels = [label for label, _ in BREAKDOWN_ROWS]
    stages = est.stages
    top = max(max(s.peak_reserved_bytes for s in stages), 1)
    limit = est.gpu.usable_bytes if est.gpu is not None else None
    scale_max = max(top, limit or 0)
    width, bar, gap, height = 900, 28, 10, 240
    bar = max(4, min(bar, (width - 80) // max(1, len(stages)) - gap))
    parts = [(f'<svg role="img" aria-label="per-stage memory" width="{width}" height="{height + 40}" '
              f'viewBox="0 0 {width} {height + 40}">')]
    for s_index, stage in enumerate(stages):
        x = 60 + s_index * (bar + gap)
        y: float = height
        for c_index, (label, get) in enumerate(BREAKDOWN_ROWS):
            value = get(stage)
            if value <= 0:
                continue
            h = value / scale_max * height
            y -= h
            parts.append(f'<rect x="{x}" y="{y:.2f}" width="{bar}" height="{h:.2f}" fill="{_color(c_index)}">'
                         f'<title>stage {stage.stage}: {_esc(label)} {value / _GIB:.2f} GiB</title></rect>')
        parts.append(f'<text x="{x}" y="{height + 14}">{stage.stage}</text>')
    if limit is not None:
        ly = height - limit / scale_max * height
        parts.append(f'<line x1="50" x2="{width}" y1="{ly:.2f}" y2="{ly:.2f}" stroke="#b00020" stroke-dasharray="4 3"/>'
                     f'<text x="52" y="{ly - 3:.2f}">usable {limit / _GIB:.1f} GiB</text>')
    parts.append(f'<text x="0" y="12">{scale_max / _GIB:.0f} GiB</text><text x="0" y="{height}">0</text>'
                 f'<text x="60" y="{height + 32}">pipeline stage</text></svg>')
    rows = "".join(
        f"<tr><td>{s.stage}</td><td>{s.layers}</td><td>{s.inflight_microbatches}</td><td>{_esc(s.peak_phase)}</td>"
        f"<td>{s.peak_allocated_bytes / _GIB:.2f}</td><td>{s.peak_reserved_bytes / _GIB:.2f}</td></tr>"
        for s in stages
    )
    table = ("<table><thead><tr><th>stage</th><th>layers</th><th>in flight</th><th>peak during</th>"
             f"<th>allocated GiB</th><th>reserved GiB</th></tr></thead><tbody>{rows}</tbody></table>")
    verdict = ""
    if est.fits is not None:
        cls = "ok" if est.fits else "bad"
        word = "fits" if est.fits else "does not fit"
        verdict = (f'<p class="{cls}">{word} on {_esc(est.gpu.name if est.gpu else "")}: headroom '
                   f'{(est.headroom_bytes or 0) / _GIB:+.2f} GiB</p>')
    from memplan.report.text import training_split

    verdict = f"<p>{est.total_parameters / 1e9:,.2f} B parameters{_esc(training_split(est))}</p>{verdict}"
    return (f"<h2>Per-stage memory (GiB = 2^30 bytes)</h2>{verdict}{_legend(labels)}"
            f"{''.join(parts)}{table}")


def _fit_section(result: FitResult, top: int) -> str:
    head = ("<tr><th>#</th><th class='l'>layout</th><th>mbs</th><th class='l'>recompute</th><th>reserved GiB</th>"
            "<th>headroom GiB</th><th>step s</th><th>tokens/s</th><th>MFU</th></tr>")
    rows = []
    for rank, cand in enumerate(result.candidates[:top], start=1):
        d = cand.to_dict()
        rows.append(
            f"<tr><td data-v=\"{rank}\">{rank}</td><td class=\"l\">{_esc(cand.layout.label)}</td>"
            f"<td>{d['micro_batch_size']}</td><td class=\"l\">{_esc(d['recompute'])}</td><td>{cand.reserved_bytes / _GIB:.2f}</td>"
            f"<td>{cand.headroom_bytes / _GIB:.2f}</td><td>{cand.step.total_s:.3f}</td>"
            f"<td data-v=\"{cand.step.tokens_per_s:.0f}\">{cand.step.tokens_per_s:,.0f}</td>"
            f"<td>{100 * cand.step.mfu:.1f}%</td></tr>"
        )
    rejected = "".join(f"<tr><td>{_esc(r.family)}</td><td>{r.layouts}</td><td>{_esc(r.reason)}</td></tr>"
                       for r in result.rejected[:top])
    meta = (f'<p class="meta">{result.gpus} x {_esc(result.gpu)}, sequence {result.seq_length}, global batch '
            f"{result.global_batch_size}, framework {_esc(result.framework)}, margin {100 * result.margin:.0f}% "
            f"(limit {result.limit_bytes / _GIB:.1f} GiB per GPU); {len(result.candidates)} fitting configurations "
            f"(a layout with a micro-batch and a recompute mode) among {result.layouts_searched} layouts, "
            f"{result.estimates} estimates in {result.seconds:.2f} s"
            f"{' (the search stopped at the fastest ones)' if not result.exhaustive else ' (every configuration estimated, as memplan fit --all: more estimates than memplan fit without it)'}</p>")
    out = (f"<h2>Configurations that fit</h2>{meta}<table class=\"sortable\"><thead>{head}</thead>"
           f"<tbody>{''.join(rows)}</tbody></table>")
    if rejected:
        out += ("<h2>Rejected families</h2><table><thead><tr><th>family</th><th>layouts</th><th>why</th></tr>"
                f"</thead><tbody>{rejected}</tbody></table>")
    return out


def _timeline_section(points: Sequence[TimelinePoint]) -> str:
    cats: list[str] = []
    for _, values in points:
        cats += [c for c in values if c not in cats]
    xs = [p[0] for p in points]
    totals = [sum(v.values()) for _, v in points]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    top = max(max(totals), 1)
    width, height, left = 900, 260, 50

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - 10)

    def py(y: float) -> float:
        return height - y / top * height

    parts = [(f'<svg role="img" aria-label="memory timeline" width="{width}" height="{height + 30}" '
              f'viewBox="0 0 {width} {height + 30}">')]
    below = [0] * len(points)
    for c_index, cat in enumerate(cats):
        above = [b + v.get(cat, 0) for b, (_, v) in zip(below, points)]
        upper = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, above))
        lower = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in reversed(list(zip(xs, below))))
        parts.append(f'<polygon points="{upper} {lower}" fill="{_color(c_index)}" fill-opacity="0.85">'
                     f"<title>{_esc(cat)}</title></polygon>")
        below = above
    peak_i = max(range(len(points)), key=lambda i: totals[i])
    parts.append(f'<text x="0" y="12">{top / _GIB:.2f} GiB</text><text x="0" y="{height}">0</text>'
                 f'<text x="{left}" y="{height + 22}">operation index {x0}–{x1}; peak {totals[peak_i] / _GIB:.2f} GiB '
                 f"at op {xs[peak_i]}</text></svg>")
    return f"<h2>Memory timeline by category</h2>{_legend(cats)}{''.join(parts)}"


def _segments_section(segments: Sequence[Mapping[str, Any]]) -> str:
    width, row, left = 900, 18, 130
    largest = max((int(s["size"]) for s in segments), default=1) or 1
    height = row * len(segments) + 10
    parts = [(f'<svg role="img" aria-label="allocator segments" width="{width}" height="{height}" '
              f'viewBox="0 0 {width} {height}">')]
    used_total = sum(int(b["size"]) for s in segments for b in s.get("blocks", ()) if b.get("allocated"))
    size_total = sum(int(s["size"]) for s in segments)
    for i, seg in enumerate(segments):
        y = 4 + i * row
        seg_w = int(seg["size"]) / largest * (width - left - 10)
        parts.append(f'<text x="0" y="{y + 12}">{int(seg["address"]):#x}</text>'
                     f'<rect x="{left}" y="{y}" width="{seg_w:.2f}" height="{row - 4}" fill="#eee" stroke="#999">'
                     f'<title>segment {int(seg["size"]) / _MIB:.1f} MiB</title></rect>')
        for block in seg.get("blocks", ()):
            bx = left + int(block["offset"]) / largest * (width - left - 10)
            bw = max(0.5, int(block["size"]) / largest * (width - left - 10))
            fill = "#0072B2" if block.get("allocated") else "#fff"
            label = f"{'allocated' if block.get('allocated') else 'free'} {int(block['size']) / _MIB:.2f} MiB"
            if block.get("category"):
                label += f" ({block['category']})"
            parts.append(f'<rect x="{bx:.2f}" y="{y}" width="{bw:.2f}" height="{row - 4}" fill="{fill}" '
                         f'stroke="#555" stroke-width="0.3"><title>{_esc(label)}</title></rect>')
    parts.append("</svg>")
    frag = 1 - used_total / size_total if size_total else 0.0
    meta = (f'<p class="meta">{len(segments)} segments, {size_total / _GIB:.2f} GiB reserved, '
            f"{used_total / _GIB:.2f} GiB allocated ({100 * frag:.1f}% free inside segments)</p>")
    return f"<h2>Allocator segments</h2>{meta}{_legend(['allocated', 'free'])}{''.join(parts)}"


def render_html(
    *,
    title: str,
    estimate: Estimate | None = None,
    fit: FitResult | None = None,
    timeline: Sequence[TimelinePoint] | None = None,
    segments: Sequence[Mapping[str, Any]] | None = None,
    top: int = 20,
    notes: Sequence[str] = (),
    extra_sections: Sequence[str] = (),
) -> str:
    """The whole report as one HTML string (no external resources); ``extra_sections`` are HTML fragments
    (already escaped) placed after the estimate (``--dataset``'s per-step section)."""
    body = [f"<h1>{_esc(title)}</h1>"]
    if estimate is not None:
        job = estimate.job.parallel
        body.append(f'<p class="meta">{_esc(estimate.model)}, framework {_esc(estimate.framework)}, '
                    f"{job.world_size} GPU{'' if job.world_size == 1 else 's'} (tp {job.tp}, pp {job.pp}, cp {job.cp}, dp {job.data_parallel}); "
                    f"peak {estimate.peak_reserved_bytes / _GIB:.2f} GiB reserved on stage {estimate.peak_stage}</p>")
    body += [f'<p class="meta">{_esc(n)}</p>' for n in notes]
    if estimate is not None:
        body.append(_stage_section(estimate))
    body += list(extra_sections)
    if fit is not None:
        body.append(_fit_section(fit, top))
    if timeline:
        body.append(_timeline_section(timeline))
    if segments:
        body.append(_segments_section(segments))
    return html_page(title, body)


def html_page(title: str, sections: Sequence[str]) -> str:
    """A whole page around ``sections`` (HTML fragments, already escaped): inline CSS, the table-sorting
    script, and the memplan version at the foot. Tables with class ``sortable`` sort on a click."""
    from memplan import __version__

    body = [*sections, f'<p class="meta">memplan {_esc(__version__)}. GiB = 2^30 bytes.</p>']
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>{''.join(body)}"
            f"<script>{_JS}</script></body></html>\n")


def write_html(path: str, **kwargs: Any) -> None:
    """:func:`render_html` written to ``path`` (UTF-8)."""
    from pathlib import Path

    from memplan.errors import ConfigError

    try:
        Path(path).write_text(render_html(**kwargs), encoding="utf-8")
    except OSError as exc:
        raise ConfigError("--output", f"cannot write the report ({exc.strerror})", path) from None
