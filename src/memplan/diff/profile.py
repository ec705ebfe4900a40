"""One side of a diff: the peak of live bytes and what is alive at it, by category, module and site.

A :class:`Profile` is computed from an event stream (a memplan trace or a snapshot's device
trace) by :func:`finish_profile`: the peak is the largest number of requested bytes alive at
once (no allocator rounding, as :attr:`memplan.events.Trace.peak_live_bytes`), reached first at
event ``peak_event``; each breakdown sums the sizes of the blocks alive right after that event,
grouped by one key, so every breakdown adds up to ``peak_bytes`` exactly.

The timeline kept for the HTML page is the live-bytes curve cut into at most
:data:`TIMELINE_POINTS` equal buckets of events, each bucket shown by its largest value (the peak
is never smoothed away).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Literal

from memplan.events import ALLOC

__all__ = ["TIMELINE_POINTS", "AllocRows", "Key", "Profile", "bucket_width", "build_profile",
           "finish_profile"]

#: Most points kept of a timeline (bucket maxima).
TIMELINE_POINTS = 1500

SourceKind = Literal["trace", "snapshot"]
#: What a reader knows of an allocation: ``(category, module, site, when)``; ``when`` (``"forward of
#: iteration 1"``, or ``""``) only describes where a peak falls, it is not an attribution.
Key = tuple[str, str, str, str]


@dataclass(frozen=True)
class Profile:
    """The peak of one trace or snapshot and what was alive at it (bytes are requested sizes)."""

    path: str
    kind: SourceKind
    #: ``"cuda:0"`` for a snapshot of device 0; a trace's meta device and rank (``"cuda rank 0"``).
    device: str
    #: CUDA device index of a snapshot; ``None`` for a trace.
    device_index: int | None
    events: int
    peak_bytes: int
    #: Index of the event after which the peak is first reached (-1: nothing was ever allocated).
    peak_event: int
    by_category: Mapping[str, int]
    by_module: Mapping[str, int]
    by_site: Mapping[str, int]
    #: The allocation that reached the peak: its site, and its phase and iteration when known.
    peak_at: str = ""
    #: ``(first event of the bucket, largest live bytes in the bucket)``.
    timeline: tuple[tuple[int, int], ...] = ()
    notes: tuple[str, ...] = field(default=())

    def summary(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "device": self.device, "events": self.events,
                "peak_bytes": self.peak_bytes, "peak_event": self.peak_event, "peak_at": self.peak_at,
                "notes": list(self.notes)}


@dataclass
class AllocRows:
    """What a reader collects in one pass, for :func:`finish_profile`.

    ``deltas[i]`` is the signed size of event ``i``; ``allocs[j]`` starts with ``(event index, bytes, key)``
    of the ``j``-th allocation (``key`` indexes the reader's key table; a reader may append fields),
    and ``freed[j]`` the event
    index of its free (absent while it is alive at the end).
    """

    deltas: list[int] = field(default_factory=list)
    allocs: list[tuple[Any, ...]] = field(default_factory=list)
    freed: dict[int, int] = field(default_factory=dict)


def rows_of_events(events: Sequence[Any], key_of: Callable[[int, Any], Key], keys: list[Key]) -> AllocRows:
    """One pass over validated ``events``: every allocation's row keyed by ``key_of(i, event)``
    (an index into ``keys``, which grows as new keys appear), and the signed deltas."""
    rows = AllocRows()
    key_index = {key: k for k, key in enumerate(keys)}
    live: dict[int, int] = {}
    for i, event in enumerate(events):
        if event.kind == ALLOC:
            key = key_of(i, event)
            k = key_index.setdefault(key, len(keys))
            if k == len(keys):
                keys.append(key)
            live[event.block] = len(rows.allocs)
            rows.allocs.append((i, event.size, k))
            rows.deltas.append(event.size)
        else:
            rows.freed[live.pop(event.block)] = i
            rows.deltas.append(-event.size)
    return rows


def bucket_width(events: int) -> int:
    """Events per timeline bucket: at most :data:`TIMELINE_POINTS` buckets."""
    return max(1, -(-events // TIMELINE_POINTS))


def _timeline(live: Sequence[int]) -> tuple[tuple[int, int], ...]:
    width = bucket_width(len(live))
    return tuple((start, max(live[start:start + width])) for start in range(0, len(live), width))


def _group(alive: Sequence[tuple[Any, ...]], keys: Sequence[Key], field: int) -> dict[str, int]:
    by_key: dict[int, int] = {}
    for _, size, key, *_ in alive:
        by_key[key] = by_key.get(key, 0) + size
    out: dict[str, int] = {}
    for key, size in by_key.items():
        name = keys[key][field]
        out[name] = out.get(name, 0) + size
    return out


def _peak_at(alive: Sequence[tuple[Any, ...]], keys: Sequence[Key], peak_event: int) -> str:
    """The allocation made at the peak event: the last one alive (rows are in event order)."""
    if not alive or alive[-1][0] != peak_event:
        return ""
    _, _, site, when = keys[alive[-1][2]]
    return f"{site}, {when}" if when else site


def build_profile(*, alive: Sequence[tuple[Any, ...]], keys: Sequence[Key], peak_event: int, events: int,
                  timeline: tuple[tuple[int, int], ...], path: str, kind: SourceKind, device: str,
                  device_index: int | None, notes: Sequence[str] = ()) -> Profile:
    """The :class:`Profile` from the rows ``(event index, bytes, key)`` alive right after ``peak_event``
    (in event order); ``keys[k]`` is read only for those, so a reader may build keys lazily."""
    by = [_group(alive, keys, field) for field in range(3)]
    peak = sum(row[1] for row in alive)
    if any(sum(b.values()) != peak for b in by):  # pragma: no cover - a grouping that loses bytes is a bug
        raise AssertionError("a breakdown does not add up to the peak")
    return Profile(path=path, kind=kind, device=device, device_index=device_index, events=events,
                   peak_bytes=peak, peak_event=peak_event, peak_at=_peak_at(alive, keys, peak_event),
                   by_category=by[0], by_module=by[1], by_site=by[2], timeline=timeline, notes=tuple(notes))


def finish_profile(rows: AllocRows, keys: Sequence[Key], *, path: str, kind: SourceKind,
                   device: str, device_index: int | None, notes: Sequence[str] = ()) -> Profile:
    """The :class:`Profile` of the events in ``rows``; ``keys[k]`` is the :data:`Key` of key ``k``."""
    live = list(accumulate(rows.deltas))
    peak = max(live, default=0)
    peak_event = live.index(peak) if live and peak > 0 else -1
    never = len(live)
    freed = rows.freed.get
    last = bisect_left(rows.allocs, (peak_event + 1,))  # allocations are in event order
    alive = [row for j, row in enumerate(rows.allocs[:last]) if freed(j, never) > peak_event]
    if sum(row[1] for row in alive) != peak:  # pragma: no cover - the live set at the peak is the peak
        raise AssertionError("the allocations alive at the peak do not add up to it")
    return build_profile(alive=alive, keys=keys, peak_event=peak_event, events=len(live), timeline=_timeline(live),
                         path=path, kind=kind, device=device, device_index=device_index, notes=notes)
