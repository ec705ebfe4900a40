"""The dataset section of ``memplan report --dataset``: the per-step peak drawn against the GPU (inline
SVG, no external resources), the worst step and the length percentiles."""

from __future__ import annotations

from html import escape

import numpy as np

from memplan.dataset.peaks import DatasetPeaks, pooled_peaks
from memplan.units import GiB

__all__ = ["dataset_section"]

def dataset_section(peaks: DatasetPeaks) -> str:
    """An HTML fragment: heading, summary line, per-step SVG chart and the worst step's table."""
    data = peaks.to_dict()
    worst = peaks.worst
    over = "" if peaks.steps_over_gpu is None else f"; {peaks.steps_over_gpu:,} steps over the GPU"
    lengths = ", ".join(f"{k} {v:,}" for k, v in data["length_percentiles"].items())
    meta = (f'<p class="meta">{peaks.examples:,} examples, {len(peaks.shapes):,} steps (--batching '
            f"{escape(peaks.rule)}, {peaks.distinct_shapes:,} distinct shapes){over}. Example tokens: {lengths}. "
            f"{escape(peaks.pricing[:1].upper() + peaks.pricing[1:])}.</p>")
    table = ("<table><thead><tr><th>worst step</th><th>rows</th><th>tokens per row</th><th>peak allocated</th>"
             f"<th>phase</th></tr></thead><tbody><tr><td>{worst.index}</td><td>{worst.batch_size}</td>"
             f"<td>{worst.seq_length}</td><td>{worst.peak_allocated_bytes / GiB:.2f} GiB</td>"
             f"<td>{escape(worst.peak_phase)}</td></tr></tbody></table>")
    return f"<h2>Per-step peak on the dataset</h2>{meta}{_chart(peaks)}{table}"


def _chart(peaks: DatasetPeaks) -> str:
    values = peaks.peak_allocated_bytes
    series = pooled_peaks(values)
    size = series["steps_per_point"]
    pooled = np.asarray(series["max_bytes"], dtype=np.float64)
    usable = peaks.gpu_usable_bytes
    top = max(float(pooled.max()), float(usable or 0), 1.0) * 1.05
    width, height, left = 900, 240, 60

    def px(i: float) -> float:
        return left + i / max(len(pooled) - 1, 1) * (width - left - 10)

    def py(v: float) -> float:
        return height - v / top * height

    points = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in enumerate(pooled.tolist()))
    parts = [f'<svg role="img" aria-label="per-step peak" width="{width}" height="{height + 30}" '
             f'viewBox="0 0 {width} {height + 30}">',
             f'<polyline points="{points}" fill="none" stroke="#0072B2" stroke-width="1"/>']
    if usable is not None:
        parts.append(f'<line x1="{left}" x2="{width - 10}" y1="{py(usable):.1f}" y2="{py(usable):.1f}" '
                     f'stroke="#D55E00" stroke-dasharray="6 3"><title>GPU usable {usable / GiB:.2f} GiB</title>'
                     "</line>")
    worst = peaks.worst
    parts.append(f'<circle cx="{px(worst.index / size):.1f}" cy="{py(worst.peak_allocated_bytes):.1f}" r="4" '
                 f'fill="#000"><title>worst step {worst.index}</title></circle>'
                 f'<text x="0" y="12">{top / GiB:.1f} GiB</text><text x="0" y="{height}">0</text>'
                 f'<text x="{left}" y="{height + 22}">step 0–{len(values) - 1}'
                 f"{'' if size == 1 else f' (each point the highest of {size} steps)'}</text></svg>")
    return "".join(parts)
