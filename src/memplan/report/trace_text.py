"""Rich renderables of ``memplan trace``: a traced step, and the trace beside the estimator.

Sizes in GiB = 2^30 bytes. Imported only to render (it imports rich); the trace types are
imported for annotations only, so rendering never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memplan.units import format_bytes

if TYPE_CHECKING:
    from memplan.trace.compare import Comparison
    from memplan.trace.core.reserved import SimulatedReserved
    from memplan.trace.core.summary import TraceSummary

__all__ = ["render_comparison", "render_compiled", "render_summary"]


def _table(title: str, *columns: str) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_edge=False, header_style="bold")
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    return table


def render_summary(model: str, summary: TraceSummary) -> Any:
    """Peak, the categories at the peak, the top modules and the per-phase highs."""
    from rich.console import Group
    from rich.text import Text

    rounding = " (CUDA allocator rounding)" if summary.device == "cuda" else ""
    head = Text.assemble(
        ("peak allocated ", "bold"), (format_bytes(summary.peak_allocated_bytes), "bold green"),
        f"{rounding} — {model}, {summary.events} events over {summary.iterations} iterations; "
        f"peak in the {summary.peak_phase} of iteration {summary.peak_iteration} at {summary.peak_op or '-'}"
        f" in {summary.peak_module or '(top level)'}",
    )
    if summary.reserved is not None:
        head.append("\n")
        head.append_text(_reserved_line(summary.reserved))
    if summary.trainable_params is not None and summary.frozen_params is not None:
        total_params = summary.trainable_params + summary.frozen_params
        head.append(f"\ntrainable parameters {summary.trainable_params:,} of {total_params:,} "
                    f"({summary.frozen_params:,} frozen)")
    categories = _table("At the peak, by category", "category", "bytes", "share")
    total = summary.peak_allocated_bytes or 1
    for name, value in summary.by_category.items():
        if value:
            categories.add_row(name, format_bytes(value), f"{100 * value / total:.1f}%")
    modules = _table("At the peak, by allocating module (top)", "module", "bytes")
    for name, value in summary.by_module:
        modules.add_row(name, format_bytes(value))
    phases = _table("Highest live memory per phase", "phase", "bytes")
    for name, value in summary.by_phase.items():
        phases.add_row(name, format_bytes(value))
    return Group(head, Text(""), categories, Text(""), modules, Text(""), phases)


def _reserved_line(reserved: SimulatedReserved) -> Any:
    """``peak reserved X (simulated ...)``, with the per-stream split when more than one stream allocates."""
    from rich.text import Text

    from memplan.trace.core.streams import stream_names

    line = Text.assemble(("peak reserved ", "bold"), (format_bytes(reserved.peak_reserved_bytes), "bold"),
                         f" (simulated caching allocator, default settings; fragmentation "
                         f"{100 * reserved.fragmentation:.1f}%)")
    if len(reserved.by_stream) > 1:
        names = stream_names(frozenset(reserved.by_stream))
        split = ", ".join(f"{names[sid]} {format_bytes(value)}" for sid, value in sorted(reserved.by_stream.items()))
        line.append(f"\nreserved at that peak by stream: {split}")
    return line


def render_comparison(comparison: Comparison) -> Any:
    """Trace and estimator side by side, with differences per category."""
    table = _table(f"Trace vs estimator ({comparison.framework} profile)", "category", "traced", "estimated", "difference", "rel.")
    for row in comparison.rows:
        rel = "-" if row.relative is None else f"{100 * row.relative:+.1f}%"
        table.add_row(row.category, format_bytes(row.traced_bytes), format_bytes(row.estimated_bytes),
                      format_bytes(row.difference_bytes), rel)
    return table


def render_compiled(compiled_layers: dict[str, Any]) -> Any:
    """``memplan trace --compile``: what AOT autograd's min-cut partitioner saved in each compiled layer (per
    layer: values the layer computed, and the graph inputs it keeps), then the first layer's saved values."""
    from rich.console import Group

    table = _table("compiled layers: the partitioner's saved set", "layer", "computed", "inputs kept", "values")
    for path, saved in compiled_layers.items():
        computed = sum(t["bytes"] for t in saved if not t["graph_input"])
        inputs = sum(t["bytes"] for t in saved if t["graph_input"])
        table.add_row(path, format_bytes(computed), format_bytes(inputs), str(len(saved)))
    first, saved = next(iter(compiled_layers.items()))
    values = _table(f"{first}: saved values", "value", "shape", "dtype", "bytes")
    for t in saved:
        values.add_row(t["name"] + (" (input)" if t["graph_input"] else ""), "x".join(map(str, t["shape"])) or "scalar",
                       t["dtype"], format_bytes(t["bytes"]))
    return Group(table, values)
