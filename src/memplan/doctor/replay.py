"""Replay a trace through memplan's caching-allocator model, stopping once the rest can only repeat.

Every check the doctor makes (the run as recorded, each candidate setting) replays the trace with
:class:`memplan.alloc.allocator.CachingAllocator`, the model :func:`memplan.alloc.simulator.simulate`
drives, event by event. A training trace is mostly the same iteration over and over; once an
iteration leaves the allocator exactly as the iteration before left it, and every later iteration
is the same sequence of requests, the allocator is deterministic, so every later iteration repeats
that one: same blocks, same segments, same peaks, no new out-of-memory. The replay stops there and
says so (``repeated_from``); the answer is the one a full replay gives (a test compares both).

What "the same" means, precisely:

* two iterations (maximal runs of events with one ``iteration`` value) are the same sequence when
  each event has the same kind, size and stream, and each free refers to the allocation the same
  number of iterations back at the same position within its iteration;
* two allocator states are the same when the segments, every free block (address, size, stream,
  pool, mapping, and its garbage-collection age), every live block (address, size, requested size)
  and the address of the next segment are equal, the live blocks matched by where they were
  allocated, relative to the iteration for those of the repeating iterations.

A trace with no repeating tail (no iteration check would ever be made) is replayed by the optional C
extension ``memplan.alloc._replay_core`` when it is built (``setup.py``): the same rules as
:class:`~memplan.alloc.allocator.CachingAllocator`, the same :class:`ReplayResult` (a hypothesis test
compares both on random traces at random settings), about twenty times faster; it also computes
:func:`trace_shape` (the same test compares). Without it, or with :data:`PURE_PYTHON_ENV` set to
``1``, both run in pure Python.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from memplan.alloc.allocator import CachingAllocator, OutOfMemory, oom_message
from memplan.alloc.blocks import Block
from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.simulator import OOMInfo
from memplan.events import ALLOC, AllocEvent, Trace

_native: ModuleType | None
try:  # the optional C extension (setup.py); without it every trace is replayed in pure Python
    _native = importlib.import_module("memplan.alloc._replay_core")
except ImportError:  # pragma: no cover - depends on the build
    _native = None

__all__ = ["HAS_NATIVE", "PURE_PYTHON_ENV", "ReplayResult", "TraceShape", "replay_native", "replay_trace",
           "trace_shape"]

#: True when the C replay core (``memplan.alloc._replay_core``) was built and imported.
HAS_NATIVE = _native is not None
#: Set this environment variable to ``1`` to replay in pure Python even when the C core is built.
PURE_PYTHON_ENV = "MEMPLAN_REPLAY_PURE_PYTHON"


@dataclass(frozen=True)
class TraceShape:
    """Where the iterations of a trace start and which repeat the one before (computed once per trace)."""

    #: Index of the first event of each run (a maximal stretch of one ``iteration`` value).
    run_starts: tuple[int, ...]
    #: ``same_as_previous[r]``: run ``r`` is the same request sequence as run ``r - 1``.
    same_as_previous: tuple[bool, ...]

    def repeats_to_end(self, run: int) -> bool:
        """True when run ``run`` and every later run are the same sequence as run ``run - 1``."""
        return run >= 1 and all(self.same_as_previous[run:])

    @property
    def has_repeating_tail(self) -> bool:
        """True when a replay checks the allocator's state at some run's end (a run ``r``, not the last,
        with :meth:`repeats_to_end`): that needs the last two runs to repeat their previous ones."""
        same = self.same_as_previous
        return len(same) >= 3 and same[-1] and same[-2]


def trace_shape(events: Sequence[AllocEvent], *, engine: Literal["auto", "python"] = "auto") -> TraceShape:
    """The runs of ``events`` and which repeat the previous one (one linear pass; in the C core when it
    is built, unless ``engine`` is ``"python"`` or :data:`PURE_PYTHON_ENV` is ``1``)."""
    if _native_allowed(engine) and _native is not None:
        native = _native.shape(events, ALLOC)
        if native is not None:  # None: iterations, ids, sizes or streams beyond 64-bit ints
            return TraceShape(run_starts=native[0], same_as_previous=native[1])
    starts: list[int] = []
    same: list[bool] = []
    where: dict[int, tuple[int, int]] = {}
    previous: list[tuple[int, ...]] | None = None
    current: list[tuple[int, ...]] = []
    iteration: Any = object()
    run = -1
    start = 0
    for position, event in enumerate(events):
        if event.iteration != iteration:
            if run >= 0:
                same.append(previous == current)
                previous = current
            iteration = event.iteration
            run += 1
            starts.append(position)
            start = position
            current = []
        if event.kind == ALLOC:
            where[event.block] = (run, position - start)
            current.append((1, event.size, event.stream))
        else:
            alloc_run, offset = where.pop(event.block, (-1, -1))
            current.append((0, run - alloc_run, offset, event.stream))
    if run >= 0:
        same.append(previous == current)
    return TraceShape(run_starts=tuple(starts), same_as_previous=tuple(same))


@dataclass(frozen=True)
class ReplayResult:
    """What the allocator did with a trace at some settings (peaks over the whole trace)."""

    settings: AllocatorSettings
    events: int
    #: Events actually replayed (the rest repeat; see ``repeated_from``).
    events_replayed: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    #: Reserved and allocated bytes just before the out-of-memory, or at the end.
    reserved_bytes: int
    allocated_bytes: int
    #: Largest free (cached, mapped) block of any segment at that moment.
    largest_free_block_bytes: int
    oom: OOMInfo | None
    #: Run index from which every later run repeats the one before it (None: replayed to the end).
    repeated_from: int | None = None


def _state(alloc: CachingAllocator, live: dict[int, Block], origin: dict[int, tuple[int, int]], run: int,
           stable_start: int, gc: bool) -> tuple[Any, ...]:
    """A hashable picture of the allocator after run ``run`` (see the module docstring)."""
    pools = (alloc.small_pool, alloc.large_pool)
    free = tuple(tuple(p.keys) for p in pools)
    unmapped = tuple(tuple((k, p.unmapped[k].size) for k in p.unmapped_keys) for p in pools)
    ages = tuple(tuple(p.free_calls - p.blocks[k].gc_base for k in p.keys) for p in pools) if gc else ()
    blocks = []
    for block_id, block in live.items():
        alloc_run, offset = origin[block_id]
        label = (run - alloc_run, offset) if alloc_run >= stable_start else (-1, block_id)
        blocks.append((label, block.address, block.size, block.requested))
    blocks.sort()
    segments = tuple(sorted((a, s.size) for a, s in alloc.segments.items()))
    return (alloc.reserved, alloc.allocated, alloc.requested, alloc._next_address, free, unmapped, ages,
            tuple(blocks), segments)


def _native_allowed(engine: str) -> bool:
    """The C core may run: ``engine`` is ``"auto"`` and :data:`PURE_PYTHON_ENV` is not ``1``."""
    return engine == "auto" and os.environ.get(PURE_PYTHON_ENV) != "1"


def replay_native(trace: Trace, settings: AllocatorSettings) -> ReplayResult | None:
    """Replay all of ``trace`` in the C core; None when it is not built or the trace is outside what it
    handles (block ids or streams beyond 64 bits, sizes of 2**50 bytes or more, a free of a block not
    allocated: the pure-Python replay gives its own answer, or error, for those)."""
    if _native is None:
        return None
    out = _native.replay(trace.events, ALLOC, settings.max_split_size, settings.roundup_power2_divisions,
                         settings.garbage_collection_threshold, settings.expandable_segments, settings.capacity)
    if out is None:
        return None
    replayed, peak_r, peak_a, reserved, allocated, largest, oom = out
    info = None
    if oom is not None:
        position, size, alloc_size, oom_reserved, oom_allocated = oom
        info = OOMInfo(position, size, alloc_size, oom_message(settings.capacity, oom_reserved, oom_allocated,
                                                                alloc_size))
    return ReplayResult(settings=settings, events=len(trace.events), events_replayed=replayed,
                        peak_reserved_bytes=peak_r, peak_allocated_bytes=peak_a, reserved_bytes=reserved,
                        allocated_bytes=allocated, largest_free_block_bytes=largest, oom=info)


def replay_trace(trace: Trace, settings: AllocatorSettings, shape: TraceShape | None = None, *,
                 engine: Literal["auto", "python"] = "auto") -> ReplayResult:
    """Replay ``trace`` at ``settings`` (a capacity makes it stop at the first out-of-memory).

    ``engine``: ``"auto"`` replays a trace without a repeating tail in the C core when it is built
    (unless :data:`PURE_PYTHON_ENV` is ``1``), ``"python"`` always in the pure-Python model.
    """
    events = trace.events
    shape = shape if shape is not None else trace_shape(events)
    if _native_allowed(engine) and not shape.has_repeating_tail:
        native = replay_native(trace, settings)
        if native is not None:
            return native
    alloc = CachingAllocator(settings)
    malloc, free = alloc.malloc, alloc.free
    live: dict[int, Block] = {}
    origin: dict[int, tuple[int, int]] = {}
    gc = settings.garbage_collection_threshold > 0
    peak_r = peak_a = 0
    oom: OOMInfo | None = None
    previous_state: Any = None
    stable_start = -1
    repeated_from = None
    replayed = 0
    runs = len(shape.run_starts)
    run_starts = (*shape.run_starts, len(events))
    run, start, run_last = -1, 0, -1  # the current run, its first and its last event
    for position, event in enumerate(events):
        if position > run_last:
            run += 1
            start, run_last = run_starts[run], run_starts[run + 1] - 1
        alloc.event_index = position
        if event.kind == ALLOC:
            try:
                live[event.block] = malloc(event.size, event.stream)
            except OutOfMemory as exc:
                oom = OOMInfo(position, exc.size, exc.alloc_size, str(exc))
                break
            origin[event.block] = (run, position - start)
            # Only an allocation raises the reserved or allocated bytes (a free returns a block to its
            # pool and may unmap pages; it never maps or cudaMallocs), so the peaks are taken here.
            # An ``if`` rather than max(): a call per event costs a tenth of a replay.
            if alloc.allocated > peak_a:  # noqa: PLR1730
                peak_a = alloc.allocated
            if alloc.reserved > peak_r:  # noqa: PLR1730
                peak_r = alloc.reserved
        else:
            free(live.pop(event.block))
            del origin[event.block]
        replayed = position + 1
        if position == run_last and run + 1 < runs and shape.repeats_to_end(run):
            if stable_start < 0:
                stable_start = run
            state = _state(alloc, live, origin, run, stable_start, gc)
            if state == previous_state:
                repeated_from = run
                break
            previous_state = state
    largest = max((b.size for p in (alloc.small_pool, alloc.large_pool) for b in p.blocks.values()), default=0)
    return ReplayResult(settings=settings, events=len(events), events_replayed=replayed, peak_reserved_bytes=peak_r,
                        peak_allocated_bytes=peak_a, reserved_bytes=alloc.reserved, allocated_bytes=alloc.allocated,
                        largest_free_block_bytes=largest, oom=oom, repeated_from=repeated_from)
