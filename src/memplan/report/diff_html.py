"""The offline page of ``memplan diff --html``: both timelines overlaid, and the attribution tables.

One self-contained file (inline SVG, CSS and a few lines of JavaScript from
:func:`memplan.report.html.html_page`; no CDN). The timeline of each side is its live requested
bytes over its event index, each point the largest value of a bucket of events (so the peaks
show); the dots mark the two peaks. Each table lists every key whose bytes changed (sortable by
a click), with a total row equal to the peak difference.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from memplan.errors import ConfigError
from memplan.report.html import html_page

if TYPE_CHECKING:
    from memplan.diff.compare import Delta, DiffResult
    from memplan.diff.profile import Profile

__all__ = ["render_diff_html", "write_diff_html"]

_GIB = 2**30
#: Colours of A and B (Okabe-Ito blue and vermillion: distinguishable by colour-blind readers).
_COLORS = ("#0072B2", "#D55E00")
_TITLES = {"categories": "category", "modules": "module", "sites": "allocation site"}


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _overlay(a: Profile, b: Profile) -> str:
    width, height, left, bottom = 900, 280, 60, 34
    x_max = max(a.events, b.events, 1)
    y_max = max(a.peak_bytes, b.peak_bytes, 1)

    def px(x: float) -> float:
        return left + x / x_max * (width - left - 10)

    def py(y: float) -> float:
        return 8 + (1 - y / y_max) * (height - 8)

    parts = [(f'<svg role="img" aria-label="live memory of A and B" width="{width}" '
              f'height="{height + bottom}" '
             f'viewBox="0 0 {width} {height + bottom}">'),
             f'<line x1="{left}" x2="{width}" y1="{height + 8}" y2="{height + 8}" stroke="#999"/>']
    for index, side in enumerate((a, b)):
        color, label = _COLORS[index], "AB"[index]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in side.timeline)
        if points:
            parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.4">'
                         f"<title>{label}: {_esc(side.path)}</title></polyline>")
        if side.peak_event >= 0:
            cx, cy = px(side.peak_event), py(side.peak_bytes)
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{color}"><title>{label} peak '
                         f"{side.peak_bytes / _GIB:.3f} GiB at event {side.peak_event} {_esc(side.peak_at)}"
                         "</title></circle>")
    parts.append(f'<text x="0" y="14">{y_max / _GIB:.2f} GiB</text><text x="0" y="{height + 8}">0</text>'
                 f'<text x="{left}" y="{height + 28}">event index (0 – {x_max:,}); each point is the largest '
                 f"live value of its bucket of events</text></svg>")
    legend = "".join(f'<span><i style="background:{_COLORS[i]}"></i>{"AB"[i]}: {_esc(s.path)} — peak '
                     f"{s.peak_bytes / _GIB:.3f} GiB at event {s.peak_event} {_esc(s.peak_at)}</span>"
                     for i, s in enumerate((a, b)))
    return f'<h2>Live memory, A and B overlaid</h2><div class="legend">{legend}</div>{"".join(parts)}'


def _table(name: str, deltas: Sequence[Delta], total: int) -> str:
    rows = []
    changed = [d for d in deltas if d.delta_bytes]
    for d in changed:
        cls = "bad" if d.delta_bytes > 0 else "ok"
        rows.append(f'<tr><td class="l">{_esc(d.key)}</td>'
                    f'<td data-v="{d.a_bytes}">{d.a_bytes / _GIB:.3f}</td>'
                    f'<td data-v="{d.b_bytes}">{d.b_bytes / _GIB:.3f}</td>'
                    f'<td class="{cls}" data-v="{d.delta_bytes}">{d.delta_bytes / _GIB:+.3f}</td></tr>')
    unchanged = len(deltas) - len(changed)
    foot = (f"<tfoot><tr><td class=\"l\">total ({len(changed)} changed, {unchanged} unchanged)</td>"
            "<td></td><td></td>"
            f"<td>{total / _GIB:+.3f}</td></tr></tfoot>")
    return (f"<h2>Peak difference by {_TITLES[name]} (GiB)</h2><table class=\"sortable\"><thead><tr>"
            f"<th class=\"l\">{_TITLES[name]}</th><th>A at its peak</th><th>B at its peak</th>"
            "<th>B − A</th></tr>"
            f"</thead><tbody>{''.join(rows)}</tbody>{foot}</table>")


def render_diff_html(result: DiffResult) -> str:
    """The whole page as one HTML string."""
    a, b = result.a, result.b
    sections = [
        "<h1>memplan diff</h1>",
        (f'<p class="meta">A: {_esc(a.path)} ({a.kind}, {_esc(a.device)}, {a.events:,} events); '
        f"B: {_esc(b.path)} ({b.kind}, {_esc(b.device)}, {b.events:,} events)</p>"),
        (f"<p>peak difference B − A: <b>{result.peak_delta_bytes / _GIB:+.3f} GiB</b> "
        f"({result.peak_delta_bytes:+,} bytes; requested bytes alive at each peak, "
        "no allocator rounding)</p>"),
        *(f'<p class="meta">note: {_esc(n)}</p>' for n in result.notes),
        _overlay(a, b),
        *(_table(name, deltas, result.peak_delta_bytes) for name, deltas in result.attributions().items()),
    ]
    return html_page("memplan diff", sections)


def write_diff_html(result: DiffResult, path: str) -> None:
    """:func:`render_diff_html` written to ``path`` (UTF-8)."""
    try:
        Path(path).write_text(render_diff_html(result), encoding="utf-8")
    except OSError as exc:
        raise ConfigError("--html", f"cannot write the page ({exc.strerror})", path) from None
