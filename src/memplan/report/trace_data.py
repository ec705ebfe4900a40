"""Plain data for the HTML report from a trace: the memory timeline by category and the
allocator's segments at the moment of peak reserved memory.

The timeline is the live requested bytes of every category after each event, thinned to at most
``max_points`` points (the global peak is always one of them). The segments come from replaying
the trace through :func:`memplan.alloc.simulator.simulate` up to the event where reserved memory
peaks, so the picture shows the fragmentation when it matters most.
"""

from __future__ import annotations

from typing import Any

from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.simulator import simulate
from memplan.events import ALLOC, Trace

__all__ = ["category_timeline", "peak_segments"]


def category_timeline(trace: Trace, *, max_points: int = 800) -> list[tuple[int, dict[str, int]]]:
    """``[(event index, {category: live bytes})]``, at most ``max_points`` points plus the peak."""
    events = trace.events
    if not events:
        return []
    step = max(1, len(events) // max_points)
    live: dict[str, int] = {}
    total = peak = peak_index = 0
    points: list[tuple[int, dict[str, int]]] = []
    peak_point: tuple[int, dict[str, int]] | None = None
    for position, event in enumerate(events):
        delta = event.size if event.kind == ALLOC else -event.size
        live[event.category] = live.get(event.category, 0) + delta
        total += delta
        if total > peak:
            peak, peak_index = total, position
            peak_point = (position, {k: v for k, v in live.items() if v})
        if position % step == 0 or position == len(events) - 1:
            points.append((position, {k: v for k, v in live.items() if v}))
    if peak_point is not None and all(index != peak_index for index, _ in points):
        points.append(peak_point)
        points.sort(key=lambda point: point[0])
    return points


def peak_segments(trace: Trace, settings: AllocatorSettings | None = None) -> list[dict[str, Any]]:
    """The simulated caching allocator's segments (with their blocks) at peak reserved memory."""
    if not trace.events:
        return []
    full = simulate(trace, settings)
    timeline = full.reserved_timeline
    peak_at = max(range(len(timeline)), key=timeline.__getitem__) if len(timeline) else len(trace.events) - 1
    upto = simulate(trace.events[: peak_at + 1], settings)
    return [
        {
            "address": segment.address,
            "size": segment.size,
            "blocks": [{"offset": b.offset, "size": b.size, "allocated": b.allocated} for b in segment.blocks],
        }
        for segment in upto.segments
    ]
