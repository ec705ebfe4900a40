"""Replay a :class:`~memplan.events.Trace` through the caching-allocator model.

Example::

    >>> from memplan.events import AllocEvent, Trace
    >>> trace = Trace(events=(AllocEvent(0, "alloc", 1, 3_000_000), AllocEvent(1, "free", 1, 3_000_000)))
    >>> result = simulate(trace)
    >>> result.peak_reserved_bytes, result.peak_allocated_bytes
    (20971520, 3000320)

The result holds reserved and allocated bytes after every event, the peaks, fragmentation
(``1 - peak allocated / peak reserved``, with PyTorch's "allocated", i.e. rounded block sizes),
the segment events and the final segment map; at a ``capacity`` it also tells whether and
where the job runs out of memory, with the message PyTorch would print.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from memplan.alloc.allocator import CachingAllocator, OutOfMemory
from memplan.alloc.blocks import Block, SegmentEvent
from memplan.alloc.settings import AllocatorSettings
from memplan.events import ALLOC, AllocEvent, Trace

__all__ = ["BlockInfo", "OOMInfo", "SegmentInfo", "SimResult", "segment_map", "simulate"]


@dataclass(frozen=True)
class BlockInfo:
    """One block of a segment: offset from the segment's start, size, and whether it is allocated."""

    offset: int
    size: int
    allocated: bool
    requested: int = 0
    mapped: bool = True


@dataclass(frozen=True)
class SegmentInfo:
    """A segment with its blocks in address order."""

    address: int
    size: int
    stream: int
    pool: str
    expandable: bool
    blocks: tuple[BlockInfo, ...]

    @property
    def allocated_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.allocated)

    @property
    def mapped_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.mapped)


@dataclass(frozen=True)
class OOMInfo:
    """Where the replay ran out of memory and what PyTorch would have said."""

    event_index: int
    requested_bytes: int
    alloc_size_bytes: int
    message: str


@dataclass(frozen=True)
class SimResult:
    """What the caching allocator does with a trace."""

    settings: AllocatorSettings
    events: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    peak_requested_bytes: int
    final_reserved_bytes: int
    final_allocated_bytes: int
    num_segment_allocs: int
    num_alloc_retries: int
    segment_events: tuple[SegmentEvent, ...] = field(repr=False)
    segments: tuple[SegmentInfo, ...] = field(repr=False)
    reserved_timeline: array = field(repr=False, compare=False)
    allocated_timeline: array = field(repr=False, compare=False)
    oom: OOMInfo | None = None

    @property
    def fragmentation(self) -> float:
        """``1 - peak allocated / peak reserved`` (0 when nothing was reserved)."""
        if self.peak_reserved_bytes == 0:
            return 0.0
        return 1.0 - self.peak_allocated_bytes / self.peak_reserved_bytes

    def to_dict(self, *, timeline_points: int = 200) -> dict[str, Any]:
        step = max(1, len(self.reserved_timeline) // max(timeline_points, 1))
        return {
            "settings": self.settings.to_dict(),
            "events": self.events,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_requested_bytes": self.peak_requested_bytes,
            "final_reserved_bytes": self.final_reserved_bytes,
            "final_allocated_bytes": self.final_allocated_bytes,
            "fragmentation": round(self.fragmentation, 6),
            "num_segment_allocs": self.num_segment_allocs,
            "num_alloc_retries": self.num_alloc_retries,
            "oom": None if self.oom is None else {
                "event_index": self.oom.event_index, "requested_bytes": self.oom.requested_bytes,
                "alloc_size_bytes": self.oom.alloc_size_bytes, "message": self.oom.message},
            "timeline": {
                "event_index": list(range(0, len(self.reserved_timeline), step)),
                "reserved_bytes": list(self.reserved_timeline[::step]),
                "allocated_bytes": list(self.allocated_timeline[::step]),
            },
            "segments": [
                {"address": s.address, "size": s.size, "stream": s.stream, "pool": s.pool,
                 "expandable": s.expandable,
                 "blocks": [[b.offset, b.size, b.allocated, b.requested] for b in s.blocks]}
                for s in self.segments
            ],
        }


def simulate(
    trace: Trace | Iterable[AllocEvent],
    settings: AllocatorSettings | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Replay every event of ``trace``; stops at the first out-of-memory when a capacity is set."""
    settings = settings or AllocatorSettings()
    events = trace.events if isinstance(trace, Trace) else tuple(trace)
    alloc = CachingAllocator(settings)
    live: dict[int, Block] = {}
    reserved_tl, allocated_tl = array("q"), array("q")
    res_append, all_append = reserved_tl.append, allocated_tl.append
    malloc, free = alloc.malloc, alloc.free
    peak_r = peak_a = peak_q = 0
    oom: OOMInfo | None = None
    for position, event in enumerate(events):
        alloc.event_index = position
        if event.kind == ALLOC:
            try:
                live[event.block] = malloc(event.size, event.stream)
            except OutOfMemory as exc:
                oom = OOMInfo(position, exc.size, exc.alloc_size, str(exc))
                break
            peak_q = max(peak_q, alloc.requested)
        else:
            free(live.pop(event.block))
        reserved, allocated = alloc.reserved, alloc.allocated
        res_append(reserved)
        all_append(allocated)
        peak_r = max(peak_r, reserved)
        peak_a = max(peak_a, allocated)
        if progress is not None and position & 0xFFFF == 0:
            progress(position)
    return SimResult(
        settings=settings, events=len(reserved_tl), peak_reserved_bytes=peak_r, peak_allocated_bytes=peak_a,
        peak_requested_bytes=peak_q, final_reserved_bytes=alloc.reserved, final_allocated_bytes=alloc.allocated,
        num_segment_allocs=sum(1 for e in alloc.segment_events if e.action in ("segment_alloc", "segment_map")),
        num_alloc_retries=alloc.num_alloc_retries, segment_events=tuple(alloc.segment_events),
        segments=segment_map(alloc, live.values()), reserved_timeline=reserved_tl,
        allocated_timeline=allocated_tl, oom=oom,
    )


def segment_map(alloc: CachingAllocator, allocated: Iterable[Block]) -> tuple[SegmentInfo, ...]:
    """The allocator's segments with their blocks (allocated, cached and unmapped) by address."""
    by_segment: dict[int, list[Block]] = {address: [] for address in alloc.segments}
    pools = (alloc.small_pool, alloc.large_pool)
    everything = [*allocated, *(b for p in pools for b in p.blocks.values()),
                  *(b for p in pools for b in p.unmapped.values())]
    for block in everything:
        by_segment.setdefault(block.segment.address, []).append(block)
    out = []
    for address in sorted(by_segment):
        segment = alloc.segments.get(address)
        blocks = sorted(by_segment[address], key=lambda b: b.address)
        if segment is None or not blocks:
            continue
        infos = tuple(BlockInfo(b.address - address, b.size, b.allocated, b.requested, b.mapped) for b in blocks)
        size = segment.size if not segment.expandable else sum(b.size for b in blocks if b.mapped)
        out.append(SegmentInfo(address, size, segment.stream, "small" if segment.small else "large",
                               segment.expandable, infos))
    return tuple(out)
