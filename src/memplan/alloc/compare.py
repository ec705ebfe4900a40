"""One table of what a trace costs under each allocator: lower bound, caching, expandable, plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.simulator import SimResult, simulate
from memplan.events import Trace

if TYPE_CHECKING:
    from memplan.alloc.planner import StaticPlan

__all__ = ["AllocatorComparison", "compare"]


@dataclass(frozen=True)
class AllocatorComparison:
    """Peak reserved bytes of one trace under each strategy (lower bound = peak live requested bytes)."""

    lower_bound_bytes: int
    caching: SimResult
    expandable: SimResult
    plan: StaticPlan

    @property
    def caching_reserved_bytes(self) -> int:
        return self.caching.peak_reserved_bytes

    @property
    def expandable_reserved_bytes(self) -> int:
        return self.expandable.peak_reserved_bytes

    @property
    def plan_bytes(self) -> int:
        return self.plan.pool_bytes

    def rows(self) -> list[tuple[str, int, float]]:
        """(strategy, bytes, fragmentation) rows; fragmentation is 1 - peak allocated / reserved."""
        return [
            ("lower bound (peak live bytes)", self.lower_bound_bytes, 0.0),
            ("caching allocator", self.caching_reserved_bytes, self.caching.fragmentation),
            ("expandable segments", self.expandable_reserved_bytes, self.expandable.fragmentation),
            ("static plan", self.plan_bytes, self.plan.fragmentation),
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "lower_bound_bytes": self.lower_bound_bytes,
            "caching_reserved_bytes": self.caching_reserved_bytes,
            "expandable_reserved_bytes": self.expandable_reserved_bytes,
            "plan_bytes": self.plan_bytes,
            "caching_fragmentation": round(self.caching.fragmentation, 6),
            "expandable_fragmentation": round(self.expandable.fragmentation, 6),
            "plan_fragmentation": round(self.plan.fragmentation, 6),
        }


def compare(
    trace: Trace, settings: AllocatorSettings | None = None, *, time_limit: float = 20.0
) -> AllocatorComparison:
    """Simulate ``trace`` with and without expandable segments and plan it (the plan needs numpy)."""
    from memplan.alloc.planner import plan_trace

    settings = settings or AllocatorSettings()
    caching = simulate(trace, settings.with_changes(expandable_segments=False))
    expandable = simulate(trace, settings.with_changes(expandable_segments=True))
    plan = plan_trace(trace, time_limit=time_limit)
    return AllocatorComparison(trace.peak_live_bytes, caching, expandable, plan)
