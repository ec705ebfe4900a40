"""Allocator settings that may fix an out-of-memory, each verified by replaying the trace.

Candidates (``PYTORCH_CUDA_ALLOC_CONF`` options, ``c10/cuda/CUDAAllocatorConfig.cpp``), cheapest
first — none changes the step's arithmetic, so they rank before any job change:

* ``expandable_segments:True`` (torch >= 2.1): one growing segment per stream, whose free pages are
  unmapped and remapped where a request needs them;
* ``max_split_size_mb:512/256/128``: large cached blocks are not split, so big requests find them;
* ``garbage_collection_threshold:0.8``: cached blocks are returned before the reserve passes 80%;
* ``roundup_power2_divisions:4``: requests rounded to a quarter power of two reuse each other's blocks.

With a trace (or a snapshot with its trace) and a capacity, every candidate is replayed through
:mod:`memplan.alloc.simulator` at that capacity, on top of the settings the run used: it fits or it
does not (``verified``). With a message alone (a fragmentation verdict), every candidate is
replayed on the most fragmented allocation history consistent with the message's figures
(:mod:`memplan.doctor.reconstruct`; ``verified_by`` is ``reconstruction``); expandable segments
are not offered for a torch <= 2.0 message (they came in 2.1). Where no such history reproduces
the message's out-of-memory, the fix is checked by arithmetic (the request fits in free +
reserved-but-unallocated) and marked unverified.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Any

from memplan.alloc.constants import NO_MAX_SPLIT, ROUNDUP_INTERVALS
from memplan.alloc.settings import AllocatorSettings
from memplan.doctor.message import OOMMessage
from memplan.doctor.report import Fix
from memplan.doctor.words import format_bytes
from memplan.events import Trace
from memplan.units import MiB

__all__ = ["CANDIDATES", "allocator_fixes", "conf_string"]

#: (action, changes to AllocatorSettings) in order of preference.
CANDIDATES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("Use expandable segments", {"expandable_segments": True}),
    ("Do not split cached blocks of 512 MiB or more", {"max_split_size": 512 * MiB}),
    ("Do not split cached blocks of 256 MiB or more", {"max_split_size": 256 * MiB}),
    ("Do not split cached blocks of 128 MiB or more", {"max_split_size": 128 * MiB}),
    ("Return cached blocks above 80% of capacity", {"garbage_collection_threshold": 0.8}),
    ("Round requests to quarter powers of two", {"roundup_power2_divisions": (4,) * ROUNDUP_INTERVALS}),
)
_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def conf_string(settings: AllocatorSettings) -> str:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` value that sets ``settings``' non-default options."""
    parts = []
    if settings.expandable_segments:
        parts.append("expandable_segments:True")
    if settings.max_split_size != NO_MAX_SPLIT:
        parts.append(f"max_split_size_mb:{settings.max_split_size // MiB}")
    if settings.garbage_collection_threshold > 0:
        parts.append(f"garbage_collection_threshold:{settings.garbage_collection_threshold:g}")
    divisions = settings.roundup_power2_divisions
    if any(d > 1 for d in divisions):
        parts.append(f"roundup_power2_divisions:{divisions[0]}" if len(set(divisions)) == 1 else
                     "roundup_power2_divisions:[" + ",".join(f"{1 << i}:{d}" for i, d in enumerate(divisions)) + "]")
    return ",".join(parts)


def _candidates(base: AllocatorSettings) -> list[tuple[str, AllocatorSettings]]:
    out = []
    for action, changes in CANDIDATES:
        new = replace(base, **changes)
        if new != base and (changes.get("max_split_size", NO_MAX_SPLIT) < base.max_split_size
                            or "max_split_size" not in changes):
            out.append((action, new))
    return out


def allocator_fixes(problems: AbstractSet[str], msg: OOMMessage | None, events: Trace | None, replay: Any,
                    shape: Any, settings: AllocatorSettings, capacity: int | None) -> list[Fix]:
    """Allocator settings for the problems found; replayed when a trace and a capacity are known."""
    if not problems & {"fragmentation", "demand", "spike"}:
        return []
    if events is not None and capacity is not None and replay is not None:
        if replay.oom is None:
            return []
        return _replayed(events, shape, settings, capacity)
    if msg is not None and "fragmentation" in problems:
        return _reconstructed(msg, settings)
    return []


def _reconstructed(msg: OOMMessage, settings: AllocatorSettings) -> list[Fix]:
    """Every candidate replayed on the most fragmented history consistent with ``msg`` (or arithmetic)."""
    from memplan.doctor.reconstruct import message_history
    from memplan.doctor.replay import trace_shape

    history = message_history(msg, settings)
    if history is None:
        return [_by_arithmetic(msg, settings)]
    fixes = _replayed(history.trace, trace_shape(history.trace.events), settings, history.limit_bytes,
                      expandable=msg.layout != "torch<=2.0")
    lead = (f"on a history rebuilt from the message ({history.segments:,} segments, each with one cached hole "
            f"of at most {format_bytes(history.largest_hole_bytes)}: the most fragmented layout consistent with "
            "its figures, and it reproduces the out-of-memory), ")
    return [replace(f, verified_by="reconstruction", verification=lead + f.verification) for f in fixes]


def _replayed(events: Trace, shape: Any, settings: AllocatorSettings, capacity: int, *,
              expandable: bool = True) -> list[Fix]:
    """Replay each candidate at ``capacity``. Two replays are skipped, the answer unchanged:

    * the run's own peak without a limit (a full replay) is needed only to say what a fitting
      candidate saves, so it is replayed at the first candidate that fits, if any does;
    * once a ``max_split_size_mb`` value fits, the smaller ones (tried after it) are not replayed:
      :func:`_one_max_split` keeps the first fitting value and drops every other, whatever they give.
    """
    from memplan.doctor.replay import replay_trace

    base = replace(settings, capacity=None)
    base_peak: int | None = None
    split_fits = False
    fixes = []
    for action, candidate in _candidates(base):
        if candidate.expandable_segments and not base.expandable_segments and not expandable:
            continue
        splits = candidate.max_split_size != base.max_split_size
        if splits and split_fits:
            continue
        result = replay_trace(events, replace(candidate, capacity=capacity), shape)
        fits = result.oom is None
        split_fits = split_fits or (splits and fits)
        if fits:
            if base_peak is None:
                base_peak = replay_trace(events, base, shape).peak_reserved_bytes
            peak = result.peak_reserved_bytes
            how = (f"{result.events:,} events" if result.repeated_from is None else
                   f"{result.events_replayed:,} of {result.events:,} events (iteration run {result.repeated_from} "
                   "left the allocator as the one before; the rest repeat it)")
            text = (f"replayed {how} at {format_bytes(capacity)}: peak reserved "
                    f"{format_bytes(peak)} (was {format_bytes(base_peak)} without a limit), no out-of-memory")
        else:
            peak = None
            text = (f"replayed at {format_bytes(capacity)}: still out of memory at event {result.oom.event_index} "
                    f"({format_bytes(result.oom.alloc_size_bytes)} requested)")
        fixes.append(Fix(action=action, kind="allocator", setting=f"{_ENV}={conf_string(candidate)}",
                         saves_bytes=None if peak is None or base_peak is None else base_peak - peak, verified=fits,
                         verified_by="simulation", verification=text, peak_bytes=peak, limit_bytes=capacity,
                         config_key=_ENV))
    return _one_max_split(fixes)


def _one_max_split(fixes: list[Fix]) -> list[Fix]:
    """Of the max_split_size_mb values, keep the largest that fits (the least change), else the smallest tried."""
    splits = [f for f in fixes if "max_split_size_mb" in f.setting]
    if not splits:
        return fixes
    fitting = [f for f in splits if f.verified]
    keep = fitting[0] if fitting else splits[-1]
    return [f for f in fixes if f not in splits or f is keep]


def _by_arithmetic(msg: OOMMessage, settings: AllocatorSettings) -> Fix:
    """A message alone: expandable segments (torch >= 2.1) or max_split_size_mb, checked by a bound."""
    req, free, unalloc = msg.requested.bytes, msg.free.bytes, msg.unallocated.bytes
    if msg.layout == "torch<=2.0":
        action, new = "Do not split cached blocks of 128 MiB or more", replace(settings, max_split_size=128 * MiB)
    else:
        action, new = "Use expandable segments", replace(settings, expandable_segments=True)
    text = (f"requested {format_bytes(req)} <= free {format_bytes(free)} + reserved-but-unallocated "
            f"{format_bytes(unalloc)}; not replayed (no trace): dump a snapshot with its trace "
            "(torch.cuda.memory._record_memory_history) to verify")
    return Fix(action=action, kind="allocator", setting=f"{_ENV}={conf_string(new)}", saves_bytes=unalloc,
               verified=False, verified_by="arithmetic", verification=text, limit_bytes=msg.pytorch_limit_bytes,
               config_key=_ENV)
