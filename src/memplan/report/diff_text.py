"""Rich renderables of ``memplan diff``: the two peaks, and the difference by category, module and site.

Each table lists the ``top`` keys whose bytes changed most, then one ``other`` row for the rest
and a ``total`` row, so every table adds up to the peak difference as the JSON does. Sizes are
binary (GiB = 2^30 bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from memplan.units import format_bytes

if TYPE_CHECKING:
    from memplan.diff.compare import Delta, DiffResult

__all__ = ["render_diff"]

_TITLES = {"categories": "category", "modules": "module", "sites": "allocation site"}


def _signed(n_bytes: int) -> str:
    return ("+" if n_bytes > 0 else "") + format_bytes(n_bytes) if n_bytes else "0"


def _table(name: str, deltas: Sequence[Delta], top: int, total: int) -> Any:
    from rich.table import Table

    from memplan.report.fitting import BreakAt

    table = Table(title=f"Peak difference by {_TITLES[name]}", title_justify="left", show_edge=False,
                  header_style="bold")
    table.add_column(_TITLES[name], justify="left", overflow="fold", max_width=70)
    for column in ("A at its peak", "B at its peak", "B − A"):
        table.add_column(column, justify="right", no_wrap=True)
    changed = [d for d in deltas if d.delta_bytes]
    for d in changed[:top]:
        style = "red" if d.delta_bytes > 0 else "green"
        table.add_row(BreakAt(d.key), format_bytes(d.a_bytes), format_bytes(d.b_bytes),
                      f"[{style}]{_signed(d.delta_bytes)}")
    rest = changed[top:]
    if rest:
        table.add_row(f"other ({len(rest)} keys)", format_bytes(sum(d.a_bytes for d in rest)),
                      format_bytes(sum(d.b_bytes for d in rest)), _signed(sum(d.delta_bytes for d in rest)))
    unchanged = len(deltas) - len(changed)
    if unchanged:
        table.add_row(f"unchanged ({unchanged} keys)", "", "", "0")
    table.add_row("[bold]total", "", "", f"[bold]{_signed(total)}")
    return table


def render_diff(result: DiffResult, *, top: int = 10) -> Any:
    """The head lines and the three attribution tables of a :class:`~memplan.diff.compare.DiffResult`."""
    from rich.console import Group
    from rich.text import Text

    head = Text()
    for label, side in (("A", result.a), ("B", result.b)):
        head.append(f"{label} ", style="bold")
        head.append(f"{side.path} ({side.kind}, {side.device}, {side.events:,} events): peak ")
        head.append(format_bytes(side.peak_bytes), style="bold")
        head.append(f" at event {side.peak_event}" + (f" ({side.peak_at})" if side.peak_at else "") + "\n")
    delta = result.peak_delta_bytes
    head.append("peak difference B − A: ", style="bold")
    head.append(_signed(delta), style="bold red" if delta > 0 else "bold green")
    head.append(" (requested bytes alive at each peak; no allocator rounding)")
    out: list[Any] = [head]
    for note in result.notes:
        out.append(Text(f"note: {note}", style="yellow"))
    for name, deltas in result.attributions().items():
        out += [Text(""), _table(name, deltas, top, delta)]
    return Group(*out)
