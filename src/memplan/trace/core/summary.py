"""What a trace says: the peak, its breakdown by category, module and phase (no torch import)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memplan.categories import MemoryCategory
from memplan.events import ALLOC, PHASES, AllocEvent, Trace
from memplan.trace.cuda.rounding import cuda_allocated_size
from memplan.units import natural_key

if TYPE_CHECKING:
    from memplan.trace.core.reserved import SimulatedReserved

__all__ = ["TraceSummary", "summarize", "timeline"]


@dataclass(frozen=True, kw_only=True)
class TraceSummary:
    """The peak of a trace and where its bytes are (bytes are integers).

    Sizes are "as allocated": rounded as the CUDA caching allocator rounds them for a ``cuda``
    trace, exactly as requested for a ``cpu`` trace. ``peak_requested_bytes`` is the unrounded peak.
    """

    device: str
    #: Largest live total, like ``torch.cuda.max_memory_allocated`` over the traced iterations.
    peak_allocated_bytes: int
    #: Largest live total of requested (unrounded) sizes.
    peak_requested_bytes: int
    #: Index of the event at which the peak is reached, and its phase / iteration / op / module.
    peak_event_index: int
    peak_phase: str
    peak_iteration: int
    peak_op: str
    peak_module: str
    #: Bytes live at the peak per category (every category present, zeros included).
    by_category: dict[str, int]
    #: Bytes live at the peak per allocating module, largest first (top N).
    by_module: tuple[tuple[str, int], ...]
    #: Highest live total reached while each phase ran.
    by_phase: dict[str, int]
    #: Highest live bytes of each category over the whole trace (at different moments).
    max_by_category: dict[str, int]
    #: The same in requested (unrounded) bytes: what the estimator's element counts give.
    max_requested_by_category: dict[str, int]
    #: Number of events in the trace.
    events: int
    iterations: int
    #: Parameter elements with and without ``requires_grad`` in the traced model (None: not known,
    #: e.g. a summary of a trace file); a quantized weight counts unpacked, as peft counts it.
    trainable_params: int | None = None
    frozen_params: int | None = None
    #: Reserved memory from replaying this trace through the caching-allocator simulator, per
    #: stream (``cuda`` traces made by ``memplan trace``; None otherwise).
    reserved: SimulatedReserved | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: ``peak_allocated_bytes``, ``by_category``, ``events`` and the rest."""
        return {
            "device": self.device,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_requested_bytes": self.peak_requested_bytes,
            "peak": {"event_index": self.peak_event_index, "phase": self.peak_phase,
                     "iteration": self.peak_iteration, "op": self.peak_op, "module": self.peak_module},
            "by_category": dict(self.by_category),
            "by_module": [{"module": m, "bytes": b} for m, b in self.by_module],
            "by_phase": dict(self.by_phase),
            "max_by_category": dict(self.max_by_category),
            "max_requested_by_category": dict(self.max_requested_by_category),
            "events": self.events,
            "iterations": self.iterations,
            **({"trainable_params": self.trainable_params, "frozen_params": self.frozen_params}
               if self.trainable_params is not None else {}),
            **({"simulated_reserved": self.reserved.to_dict()} if self.reserved is not None else {}),
            **self.extra,
        }


def _sizer(device: str) -> Callable[[int], int]:
    return cuda_allocated_size if device == "cuda" else int


def summarize(trace: Trace, *, top: int = 10) -> TraceSummary:
    """Walk ``trace`` once; find the peak and break it down. Rounds sizes for a ``cuda`` trace."""
    size_of = _sizer(trace.meta.device)
    live: dict[int, AllocEvent] = {}
    total = requested = peak = peak_requested = 0
    peak_at = -1
    by_phase: dict[str, int] = {p: 0 for p in PHASES}
    current = {c.value: 0 for c in MemoryCategory}
    highest, current_requested, highest_requested = dict(current), dict(current), dict(current)
    for position, event in enumerate(trace.events):
        size = size_of(event.size)
        if event.kind == ALLOC:
            live[event.block] = event
            total += size
            requested += event.size
            current[event.category] += size
            current_requested[event.category] += event.size
            highest[event.category] = max(highest[event.category], current[event.category])
            highest_requested[event.category] = max(highest_requested[event.category],
                                                    current_requested[event.category])
        else:
            current_requested[event.category] -= event.size
            live.pop(event.block, None)
            total -= size
            requested -= event.size
            current[event.category] -= size
        peak_requested = max(peak_requested, requested)
        by_phase[event.phase] = max(by_phase[event.phase], total)
        if total > peak:
            peak, peak_at = total, position
    peak_live = _live_at(trace.events, peak_at) if peak_at >= 0 else []
    by_category = {c.value: 0 for c in MemoryCategory}
    by_module: dict[str, int] = defaultdict(int)
    for event in peak_live:
        by_category[event.category] += size_of(event.size)
        by_module[event.module or "(top level)"] += size_of(event.size)
    at = trace.events[peak_at] if peak_at >= 0 else AllocEvent(0, ALLOC, 0, 0)
    modules = sorted(by_module.items(), key=lambda item: (-item[1], natural_key(item[0])))[: max(top, 0)]
    return TraceSummary(
        device=trace.meta.device, peak_allocated_bytes=peak, peak_requested_bytes=peak_requested,
        peak_event_index=at.index, peak_phase=at.phase, peak_iteration=at.iteration, peak_op=at.op,
        peak_module=at.module, by_category=by_category, by_module=tuple(modules),
        by_phase={p: v for p, v in by_phase.items() if v}, max_by_category=highest,
        max_requested_by_category=highest_requested, events=len(trace.events),
        iterations=trace.meta.iterations,
    )


def _live_at(events: tuple[AllocEvent, ...], position: int) -> list[AllocEvent]:
    live: dict[int, AllocEvent] = {}
    for event in events[: position + 1]:
        if event.kind == ALLOC:
            live[event.block] = event
        else:
            live.pop(event.block, None)
    return list(live.values())


def timeline(trace: Trace, *, max_points: int = 4000) -> tuple[list[int], dict[str, list[int]]]:
    """Live bytes per category after each event, at most about ``max_points`` points: each stretch of
    events keeps its highest point (the total's maximum and the breakdown there) and the trace's last, so
    the plot's peak is the summary's peak (:func:`summarize`), not whichever event a stride lands on."""
    size_of = _sizer(trace.meta.device)
    step = max(1, -(-len(trace.events) // max(1, max_points)))
    current = {c.value: 0 for c in MemoryCategory}
    xs: list[int] = []
    series: dict[str, list[int]] = {c: [] for c in current}
    total, best, best_at, best_values = 0, -1, -1, dict(current)
    last = len(trace.events) - 1
    for position, event in enumerate(trace.events):
        change = size_of(event.size) if event.kind == ALLOC else -size_of(event.size)
        current[event.category] += change
        total += change
        if total > best:
            best, best_at, best_values = total, position, dict(current)
        if position % step == step - 1 or position == last:
            xs.append(best_at)
            for name, value in best_values.items():
                series[name].append(value)
            if position == last and best_at != last:
                xs.append(last)
                for name, value in current.items():
                    series[name].append(value)
            best = -1
    return xs, series
