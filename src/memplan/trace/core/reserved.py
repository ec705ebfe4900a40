"""Reserved memory of a trace: its own events replayed through the caching-allocator simulator.

``memplan trace`` reports what ``torch.cuda.max_memory_reserved`` would say by replaying the
trace (each allocation on its recorded stream, see :mod:`memplan.trace.core.streams`) through
:func:`memplan.alloc.simulate` with the default ``PYTORCH_CUDA_ALLOC_CONF``. The figure is
simulated, not measured: the simulator follows PyTorch's ``CUDACachingAllocator`` rules (rounding,
20 MiB/2 MiB segments, per-stream pools, splitting, coalescing) but not NCCL's own buffers,
``record_stream`` delays or the CUDA context. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.simulator import SimResult, simulate
from memplan.events import Trace
from memplan.trace.core.streams import stream_names

__all__ = ["SimulatedReserved", "simulate_reserved"]

_GROW = frozenset(("segment_alloc", "segment_map"))
_SOURCE = "simulated: the trace's events replayed through memplan's caching-allocator model (memplan alloc)"


@dataclass(frozen=True, kw_only=True)
class SimulatedReserved:
    """Peak reserved bytes of a replayed trace, and how the reserved bytes split over streams then."""

    peak_reserved_bytes: int
    #: The simulator's peak of allocated bytes, counted in whole blocks as PyTorch counts them (a
    #: large block is not split for a remainder under 1 MiB): at least the trace's peak allocated.
    peak_allocated_bytes: int
    #: Index of the first event at which the reserved peak is reached.
    peak_event_index: int
    #: Reserved bytes per stream id at the reserved peak (every stream the trace allocates on).
    by_stream: dict[int, int]
    segment_allocs: int
    settings: AllocatorSettings

    @property
    def fragmentation(self) -> float:
        """``1 - peak allocated / peak reserved`` (0 when nothing was reserved)."""
        return 1.0 - self.peak_allocated_bytes / self.peak_reserved_bytes if self.peak_reserved_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        names = stream_names(frozenset(self.by_stream))
        return {
            "source": _SOURCE,
            "settings": self.settings.to_dict(),
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "fragmentation": round(self.fragmentation, 6),
            "peak_event_index": self.peak_event_index,
            "segment_allocs": self.segment_allocs,
            "by_stream": [{"stream": sid, "name": names[sid], "reserved_bytes": self.by_stream[sid]}
                          for sid in sorted(self.by_stream)],
        }


def simulate_reserved(trace: Trace, settings: AllocatorSettings | None = None) -> SimulatedReserved:
    """Replay ``trace`` (all its events, on their streams) and summarise the reserved peak."""
    result = simulate(trace, settings or AllocatorSettings())
    timeline = result.reserved_timeline
    peak_at = next((i for i, value in enumerate(timeline) if value == result.peak_reserved_bytes), -1)
    return SimulatedReserved(
        peak_reserved_bytes=result.peak_reserved_bytes, peak_allocated_bytes=result.peak_allocated_bytes,
        peak_event_index=peak_at, by_stream=_reserved_by_stream(result, trace, peak_at),
        segment_allocs=result.num_segment_allocs, settings=result.settings,
    )


def _reserved_by_stream(result: SimResult, trace: Trace, position: int) -> dict[int, int]:
    """Reserved bytes per stream after the event at ``position`` (segment events up to it)."""
    by_stream = {sid: 0 for sid in sorted({event.stream for event in trace.events})}
    for event in result.segment_events:
        if event.index > position:
            break
        sign = 1 if event.action in _GROW else -1
        by_stream[event.stream] = by_stream.get(event.stream, 0) + sign * event.size
    return by_stream
