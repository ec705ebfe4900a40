"""A ``torch.cuda.memory._dump_snapshot()`` pickle read into a :class:`~memplan.diff.profile.Profile`.

The pickle is opened only with memplan's restricted unpickler (:func:`memplan.alloc.snapshot.safe_loads`:
plain containers and scalars, no globals), validated and turned into an event stream by
:func:`memplan.alloc.snapshot.parse_snapshot` and :func:`~memplan.alloc.snapshot.snapshot_to_trace`
(requested sizes, frees at ``free_completed``); the frames of each ``alloc`` entry then give the
allocation its category, module and site (:mod:`memplan.diff.frames`).

Blocks alive before the trace began (the snapshot's ring buffer does not reach their ``alloc``)
are counted at their requested size under category ``unknown`` and the site
``(allocated before the trace began)``. A snapshot without a trace (state only) is profiled as its state at
dump time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from memplan.alloc.snapshot import Snapshot, parse_snapshot, read_snapshot_bytes, safe_loads, snapshot_to_trace
from memplan.diff.frames import OUTSIDE, UNKNOWN, frame_keys
from memplan.diff.profile import Key, Profile, finish_profile, rows_of_events
from memplan.diff.trace_reader import trace_keys
from memplan.errors import ConfigError
from memplan.events import ALLOC, PHASES

__all__ = ["BEFORE_TRACE", "profile_snapshot", "profile_snapshot_file"]

#: Site of a block whose allocation is older than the snapshot's trace.
BEFORE_TRACE = "(allocated before the trace began)"
_FREE_ACTIONS = ("free_completed", "free")
_BEFORE: Key = (UNKNOWN, OUTSIDE, BEFORE_TRACE, "")


def _memplan_key(category: str, raw: Mapping[str, Any]) -> Key:
    """A snapshot written by ``memplan trace --snapshot``: one frame, the module as file, the op as name."""
    frames = raw.get("frames")
    frame = frames[0] if isinstance(frames, list) and frames and isinstance(frames[0], Mapping) else {}
    module, name = str(frame.get("filename", "")), str(frame.get("name", ""))
    op = "" if name in PHASES else name  # memplan names the frame after the phase when there is no operator
    return trace_keys(category, op, "" if module == "(top level)" else module, "", -1)


def _in_trace_keys(snapshot: Snapshot, entries: Sequence[Any]) -> list[Key]:
    """Keys of the trace's alloc/free events in the order :func:`snapshot_to_trace` emits them."""
    completed = any(e.action == "free_completed" for e in snapshot.entries)
    frees = _FREE_ACTIONS if completed else ("free_requested", "free")
    out = []
    for parsed, raw in zip(snapshot.entries, entries):
        if parsed.action == ALLOC and parsed.category and isinstance(raw, Mapping):
            out.append(_memplan_key(parsed.category, raw))
        elif parsed.action == ALLOC:
            out.append((*frame_keys(raw.get("frames") if isinstance(raw, Mapping) else None), ""))
        elif parsed.action in frees:
            out.append(_BEFORE)  # a free: its key is never used
    return out


def _oom_note(snapshot: Snapshot) -> list[str]:
    ooms = [e for e in snapshot.entries if e.action == "oom"]
    if not ooms:
        return []
    last = ooms[-1]
    return [(f"the trace ends in an out-of-memory error: {last.size:,} bytes requested, "
            f"{last.addr:,} bytes free on the device (PyTorch records them as size and addr)")]


def profile_snapshot(raw: Any, *, path: str, device: int | None = None) -> Profile:
    """The profile of an unpickled snapshot (see the module docstring)."""
    snapshot = parse_snapshot(raw, device=device, source=path)
    traces = raw.get("device_traces") if isinstance(raw, Mapping) else None
    if device is not None and not snapshot.segments and not snapshot.entries:
        raise ConfigError("--device", "must name a CUDA device this snapshot holds memory or events of",
                          device, hint=path)
    entries = traces[snapshot.device] if isinstance(traces, list) and snapshot.device < len(traces) else []
    trace = snapshot_to_trace(snapshot)
    in_trace = _in_trace_keys(snapshot, entries)
    setup = len(trace.events) - len(in_trace)
    if setup < 0 or any(e.phase != "setup" for e in trace.events[:setup]):
        raise ConfigError("snapshot file", "has a device trace memplan cannot align with its events", path)
    keys: list[Key] = [_BEFORE]
    rows = rows_of_events(trace.events, lambda i, _e: in_trace[i - setup] if i >= setup else keys[0], keys)
    notes = _oom_note(snapshot)
    if not snapshot.has_trace:
        notes.append("no trace in this snapshot (state only): its peak is the state at dump time")
    return finish_profile(rows, keys, path=path, kind="snapshot", device=f"cuda:{snapshot.device}",
                          device_index=snapshot.device, notes=notes)


def profile_snapshot_file(path: str | os.PathLike[str], *, device: int | None = None) -> Profile:
    """Load a snapshot pickle safely (truncated or hostile files raise ConfigError) and profile it."""
    name = os.fspath(path)
    return profile_snapshot(safe_loads(read_snapshot_bytes(name, "snapshot file")), path=name, device=device)
