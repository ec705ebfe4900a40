"""Replay an allocation schedule of plain ints through the caching-allocator model.

A schedule is a list of ints, one per event: an allocation of ``size`` bytes on ``stream`` is
:func:`alloc_op` (``size << 8 | stream``), a free is :func:`free_op` of the allocation's position in
the list (``~position``). The estimator's reserved-memory schedule
(:mod:`memplan.estimate.reserved_replay`) records one this way, tracking the requested bytes itself,
and asks only for the peaks at the end; this module replays it in the optional C core
(``memplan.alloc._replay_core.schedule``, built by ``setup.py``) or, without it or with
:data:`memplan.doctor.replay.PURE_PYTHON_ENV` set to ``1``, through
:class:`~memplan.alloc.allocator.CachingAllocator` event by event. Both give the same answer (a
hypothesis test compares them on random schedules at random settings). Example::

    >>> from memplan.alloc.settings import AllocatorSettings
    >>> ops = [alloc_op(3_000_000), free_op(0), alloc_op(1_000)]
    >>> replay_schedule(ops, AllocatorSettings()).peak_reserved_bytes
    20971520
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from memplan.alloc.allocator import CachingAllocator, OutOfMemory
from memplan.alloc.blocks import Block
from memplan.alloc.settings import AllocatorSettings

__all__ = ["STREAM_BITS", "ScheduleResult", "alloc_op", "free_op", "repeat_copies", "replay_schedule"]

_native: ModuleType | None
try:  # the optional C extension (setup.py)
    _native = importlib.import_module("memplan.alloc._replay_core")
except ImportError:  # pragma: no cover - depends on the build
    _native = None

#: Low bits of an allocation's op that hold its stream (streams 0 to 255).
STREAM_BITS = 8
_STREAM_MASK = (1 << STREAM_BITS) - 1
#: The environment variable that keeps the replay in pure Python (the doctor's, same meaning).
_PURE_PYTHON_ENV = "MEMPLAN_REPLAY_PURE_PYTHON"


def alloc_op(size: int, stream: int = 0) -> int:
    """The op of an allocation of ``size`` bytes (>= 0) on ``stream`` (0 to 255)."""
    return size << STREAM_BITS | stream


def free_op(position: int) -> int:
    """The op that frees the allocation made at ``position`` in the schedule."""
    return ~position


@dataclass(frozen=True)
class ScheduleResult:
    """The allocator's peaks over a schedule, and its bytes at the end (or at the out-of-memory)."""

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    #: Position of the allocation that ran out of memory (the replay stops there), or None.
    oom_at: int | None


def replay_schedule(ops: list[int], settings: AllocatorSettings, *, engine: str = "auto") -> ScheduleResult:
    """Replay ``ops`` (see the module) at ``settings``: in the C core when it is built, ``engine`` is
    ``"auto"`` and the pure-Python environment variable is not ``1``, else in pure Python."""
    if engine == "auto" and _native is not None and os.environ.get(_PURE_PYTHON_ENV) != "1":
        out = _native.schedule(ops, settings.max_split_size, settings.roundup_power2_divisions,
                               settings.garbage_collection_threshold, settings.expandable_segments,
                               settings.capacity)
        if out is not None:  # None: an op outside the core's range; Python gives its own answer or error
            peak_r, peak_a, reserved, allocated, oom_at = out
            return ScheduleResult(peak_r, peak_a, reserved, allocated, None if oom_at < 0 else oom_at)
    return _replay_python(ops, settings)


def repeat_copies(ops: list[int], template: list[int], outside_at: list[int], sides: list[Sequence[int | None]],
                  sizes: tuple[int, ...], result: list[list[int | None]], base: int, *, engine: str = "auto"
                  ) -> list[list[int | None]] | None:
    """Append to ``ops`` one copy of a recorded stretch per side, and return each copy's ``result`` moved.

    ``template``: the stretch's ops as recorded, its first op at position ``len(ops) - base``; copy ``c``
    (from 0) starts ``base + c * len(template)`` positions after that, so its frees of its own blocks move
    by that much; ``outside_at``: flat (position in the stretch, index in the side) pairs of the stretch's
    frees of blocks made before it, which in copy ``c`` free ``sides[c][index]`` instead; ``sizes``: the ops
    (``-1`` for None) every side's blocks must have. Returns ``[[b + delta ...] for each copy for each list
    of result]`` (None stays None), or None with ``ops`` unchanged when a side's sizes differ. In the C core
    when built (see :func:`replay_schedule`), else in Python: both give the same answer (a test)."""
    if engine == "auto" and _native is not None and os.environ.get(_PURE_PYTHON_ENV) != "1":
        return _native.repeat_copies(ops, template, outside_at, sides, sizes, result, base)
    return _repeat_copies_python(ops, template, outside_at, sides, sizes, result, base)


def _repeat_copies_python(ops: list[int], template: list[int], outside_at: list[int],
                          sides: list[Sequence[int | None]], sizes: tuple[int, ...], result: list[list[int | None]],
                          base: int) -> list[list[int | None]] | None:
    for side in sides:
        if len(side) != len(sizes) or any((-1 if b is None else ops[b]) != size for b, size in zip(side, sizes)):
            return None
    span = len(template)
    deltas = [base + c * span for c in range(len(sides))]
    copied = [op if op >= 0 else op - delta for delta in deltas for op in template]
    pairs = list(zip(outside_at[::2], outside_at[1::2]))
    for c, side in enumerate(sides):
        for at, index in pairs:
            copied[c * span + at] = ~side[index]  # type: ignore[operator]
    ops += copied
    return [[None if b is None else b + delta for b in blocks] for delta in deltas for blocks in result]


def _replay_python(ops: list[int], settings: AllocatorSettings) -> ScheduleResult:
    alloc = CachingAllocator(settings)
    live: dict[int, Block] = {}
    peak_r = peak_a = 0
    oom_at = None
    for position, op in enumerate(ops):
        if op >= 0:
            try:
                live[position] = alloc.malloc(op >> STREAM_BITS, op & _STREAM_MASK)
            except OutOfMemory:
                oom_at = position
                break
            peak_r, peak_a = max(peak_r, alloc.reserved), max(peak_a, alloc.allocated)
            continue
        block = live.pop(~op, None)
        if block is None:
            raise ValueError(f"schedule op {position} frees position {~op}, which is not a live allocation "
                             "made earlier in the schedule")
        alloc.free(block)
    return ScheduleResult(peak_r, peak_a, alloc.reserved, alloc.allocated, oom_at)
