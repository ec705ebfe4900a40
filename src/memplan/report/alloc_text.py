"""Rich renderables of ``memplan alloc``: a simulation, a static plan, and the strategies compared.

Sizes in GiB = 2^30 bytes. Imported only to render (it imports rich); the allocator result types
are imported for annotations only, so rendering never imports numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.table import Table

from memplan.units import GiB

if TYPE_CHECKING:
    from memplan.alloc.compare import AllocatorComparison
    from memplan.alloc.settings import AllocatorSettings
    from memplan.alloc.simulator import SimResult

__all__ = ["comparison_table", "simulation_table", "static_plan_table"]

#: Keys of a static plan's summary shown in its table, in this order.
_PLAN_KEYS = ("pool_bytes", "lower_bound_bytes", "overhead", "fragmentation", "method", "seconds")


def _gib(n: int) -> str:
    return f"{n / GiB:,.3f}"


def simulation_table(result: SimResult, settings: AllocatorSettings, name: str) -> Table:
    """Peaks (reserved, allocated, requested), fragmentation and segments of one simulated trace ``name``."""
    table = Table(title=f"caching allocator: {name} (GiB = 2^30 bytes)")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("events", f"{result.events:,}")
    table.add_row("peak reserved (GiB)", _gib(result.peak_reserved_bytes))
    table.add_row("peak allocated (GiB)", _gib(result.peak_allocated_bytes))
    table.add_row("peak requested (GiB)", _gib(result.peak_requested_bytes))
    table.add_row("fragmentation", f"{result.fragmentation:.1%}")
    table.add_row("segments created", f"{result.num_segment_allocs:,}")
    table.add_row("segments at end", f"{len(result.segments):,}")
    table.add_row("expandable segments", str(settings.expandable_segments))
    return table


def static_plan_table(summary: Mapping[str, Any], name: str, output: str) -> Table:
    """A static plan's summary (``StaticPlan.to_dict(requests=False)`` or a solved CSV's) for ``name``."""
    table = Table(title=f"static plan: {name} -> {output}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key in _PLAN_KEYS:
        if key in summary:
            value = summary[key]
            table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    return table


def comparison_table(result: AllocatorComparison, name: str) -> Table:
    """Peak reserved memory of trace ``name`` per strategy, against the lower bound."""
    table = Table(title=f"peak reserved memory: {name} (GiB = 2^30 bytes)")
    for column, justify in (("strategy", "left"), ("GiB", "right"), ("x lower bound", "right"),
                            ("fragmentation", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for strategy, value, frag in result.rows():
        ratio = value / result.lower_bound_bytes if result.lower_bound_bytes else 1.0
        table.add_row(strategy, _gib(value), f"{ratio:.3f}", f"{frag:.1%}")
    return table
