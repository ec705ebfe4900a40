"""The doctor's inputs made uniform: a snapshot (path, dict or loaded) with its trace, its allocation
sites (top user frames) and its iterations (from the optimizer-step annotations torch records).

A snapshot's alloc entries carry their Python frames; the site of an allocation is its first frame
outside torch and the Python runtime (``file.py:line in function``). Iterations come from the
``Optimizer.step`` END annotations of ``external_annotations`` (torch >= 2.5 records them): an
event belongs to the iteration whose step it precedes. Without them every event is iteration 0.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from memplan.alloc.snapshot import Snapshot, parse_snapshot, read_snapshot_bytes, safe_loads, snapshot_to_trace
from memplan.errors import ConfigError
from memplan.events import ALLOC, AllocEvent, Trace

__all__ = ["SnapshotInput", "alloc_conf_settings", "capacity_bytes", "read_snapshot", "with_message_request"]

_SKIP_PARTS = ("/torch/", "/site-packages/", "/dist-packages/", "/lib/python", "<frozen", "runpy.py")


@dataclass(frozen=True)
class SnapshotInput:
    """A snapshot, its trace (None without alloc entries), and the site of every trace event."""

    snapshot: Snapshot
    trace: Trace | None
    #: Site of the event at each trace position ("" where unknown).
    sites: tuple[str, ...]
    #: Optimizer steps found in the annotations.
    steps: int
    #: The request of the trace's ``oom`` entry, and reserved + the device free it recorded.
    oom_requested_bytes: int | None = None
    oom_capacity_bytes: int | None = None


def read_snapshot(source: Snapshot | Mapping[str, Any] | str | os.PathLike[str]) -> SnapshotInput:
    """Load a snapshot from a pickle path, a ``torch.cuda.memory._snapshot()`` dict or a loaded one."""
    raw: Any = None
    if isinstance(source, Snapshot):
        snapshot = source
    else:
        if isinstance(source, (str, os.PathLike)):
            name = os.fspath(source)
            raw = safe_loads(read_snapshot_bytes(name, "snapshot file"))
            snapshot = parse_snapshot(raw, source=name)
        else:
            raw = source
            snapshot = parse_snapshot(raw, source="<snapshot>")
    if not snapshot.segments and not snapshot.entries:
        raise ConfigError("snapshot file", "holds no memory (no segments and no trace entries on the device): take "
                          "the snapshot while the job holds memory, e.g. in an OutOfMemoryError handler, with "
                          "torch.cuda.memory._record_memory_history() on", snapshot.source or None)
    oom = _oom_entry(raw, snapshot)
    if not snapshot.has_trace:
        return SnapshotInput(snapshot=snapshot, trace=None, sites=(), steps=0, oom_requested_bytes=oom[0],
                             oom_capacity_bytes=oom[1])
    trace = snapshot_to_trace(snapshot)
    entries = _raw_entries(raw, snapshot.device)
    sites, times = _entry_sites_and_times(entries, trace)
    step_ends = _step_ends(raw)
    if step_ends and times:
        trace = _with_iterations(trace, times, step_ends)
    if oom[0] is not None:
        trace, sites = with_failed_request(trace, sites, oom[0])
    return SnapshotInput(snapshot=snapshot, trace=trace, sites=sites, steps=len(step_ends), oom_requested_bytes=oom[0],
                         oom_capacity_bytes=oom[1])


def with_failed_request(trace: Trace, sites: tuple[str, ...], size: int) -> tuple[Trace, tuple[str, ...]]:
    """The trace with the request that ran out of memory appended: replays then meet it too."""
    last = trace.events[-1] if trace.events else None
    block = max((e.block for e in trace.events), default=-1) + 1
    event = AllocEvent(len(trace.events), ALLOC, block, size, "temporary", "other",
                       last.iteration if last is not None else 0, "", "", last.stream if last is not None else 0)
    return Trace(events=(*trace.events, event), meta=trace.meta), (*sites, "the request that ran out of memory")


def with_message_request(snap: SnapshotInput, requested: int) -> SnapshotInput:
    """A snapshot whose trace has no ``oom`` entry, with the OOM message's request as its last event
    (a snapshot dumped at the out-of-memory, the message telling what failed)."""
    if snap.trace is None or snap.oom_requested_bytes is not None:
        return snap
    trace, sites = with_failed_request(snap.trace, snap.sites or ("",) * len(snap.trace.events), requested)
    return replace(snap, trace=trace, sites=sites, oom_requested_bytes=requested)


def _oom_entry(raw: Any, snapshot: Snapshot) -> tuple[int | None, int | None]:
    """The last ``oom`` entry's request and (reserved at dump + its ``device_free``), when there is one.

    PyTorch records ``{"action": "oom", "size": <request>, "device_free": <bytes>}`` when an
    allocation fails while memory history is on; the segments are dumped after it.
    """
    ooms = [e for e in _raw_entries(raw, snapshot.device) if isinstance(e, Mapping) and e.get("action") == "oom"]
    if not ooms:
        if any(e.action == "oom" for e in snapshot.entries):
            last = [e for e in snapshot.entries if e.action == "oom"][-1]
            return last.size, None
        return None, None
    last = ooms[-1]
    size = last.get("size")
    free = last.get("device_free")
    reserved = sum(s.total_size for s in snapshot.segments)
    return (size if type(size) is int else None,
            reserved + free if type(free) is int and free >= 0 else None)


def _raw_entries(raw: Any, device: int) -> list[Any]:
    if not isinstance(raw, Mapping):
        return []
    traces = raw.get("device_traces") or []
    return traces[device] if isinstance(traces, list) and device < len(traces) else []


def _site(frames: Any) -> str:
    if not isinstance(frames, list):
        return ""
    for frame in frames:
        if not isinstance(frame, Mapping):
            continue
        name = str(frame.get("filename", ""))
        if name.endswith(".py") and not any(part in name for part in _SKIP_PARTS):
            return f"{os.path.basename(name)}:{frame.get('line', 0)} in {frame.get('name', '?')}"
    return ""


def _entry_sites_and_times(entries: Sequence[Any], trace: Trace) -> tuple[tuple[str, ...], list[int]]:
    """Per trace event: the site of its allocation and the time of its entry (setup events: first time).

    :func:`snapshot_to_trace` emits its setup allocations first, then one event per alloc / free
    entry in order; the same walk here lines the entries up with the events.
    """
    completed = any(isinstance(e, Mapping) and e.get("action") == "free_completed" for e in entries)
    frees = {"free_completed", "free"} if completed else {"free_requested", "free"}
    kept = [e for e in entries if isinstance(e, Mapping) and (e.get("action") == ALLOC or e.get("action") in frees)]
    setup = len(trace.events) - len(kept)
    if setup < 0:
        return (), []
    site_by_addr: dict[int, str] = {}
    sites: list[str] = [""] * setup
    times: list[int] = []
    for entry in kept:
        addr = entry.get("addr", 0)
        if entry.get("action") == ALLOC:
            site = _site(entry.get("frames"))
            site_by_addr[addr] = site
        else:
            site = site_by_addr.pop(addr, "")
        sites.append(site)
        time_us = entry.get("time_us", 0)
        times.append(time_us if type(time_us) is int else 0)
    first = times[0] if times else 0
    return tuple(sites), [first] * setup + times


def _step_ends(raw: Any) -> list[int]:
    if not isinstance(raw, Mapping):
        return []
    notes = raw.get("external_annotations") or []
    ends = [n.get("time_us", 0) for n in notes if isinstance(n, Mapping) and n.get("stage") == "END"
            and str(n.get("name", "")).startswith("Optimizer.step")]
    return sorted(t for t in ends if type(t) is int)


def _with_iterations(trace: Trace, times: list[int], step_ends: list[int]) -> Trace:
    events = tuple(e._replace(iteration=-1 if e.phase == "setup" else bisect_right(step_ends, t))
                   for e, t in zip(trace.events, times, strict=True))
    return Trace(events=events, meta=replace(trace.meta, iterations=len(step_ends) + 1))


def capacity_bytes(text: str | int | None, *, field: str) -> int | None:
    """The memory the allocator may use, from ``78GiB`` or a number of bytes (None: not given)."""
    if text is None:
        return None
    from memplan.units import parse_bytes

    return parse_bytes(text, field=field)


def alloc_conf_settings(conf: str | None) -> Any:
    """The :class:`~memplan.alloc.settings.AllocatorSettings` of a ``PYTORCH_CUDA_ALLOC_CONF`` (None: not given)."""
    if conf is None:
        return None
    from memplan.alloc.settings import AllocatorSettings

    return AllocatorSettings.parse(conf)
