"""Read ``torch.cuda.memory._dump_snapshot()`` pickles safely and turn them into memplan traces.

A snapshot is a pickle, and unpickling runs code. :func:`load_snapshot` uses an unpickler whose
``find_class`` refuses every global, so only the opcodes of plain containers and scalars (dict,
list, tuple, str, bytes, int, float, bool, None) can build anything; a pickle that names
``os.system`` or any other callable is refused before anything is called.

The format (``torch/cuda/_memory_viz.py``, ``CUDACachingAllocator.h``): ``segments`` (the state at
dump time: address, total_size, stream, segment_type, blocks with size/requested_size/state) and
``device_traces`` (per device, the allocator's ring buffer of actions: ``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``segment_map``,
``segment_unmap``, ``snapshot``, ``oom``; ``addr``, ``size``, ``stream``), and since torch 2.5
``allocator_settings``. ``size`` of ``alloc`` and ``free_*`` entries is the requested size.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memplan.alloc.settings import AllocatorSettings
from memplan.categories import MemoryCategory
from memplan.errors import ConfigError
from memplan.events import ALLOC, FREE, AllocEvent, Trace, TraceMeta
from memplan.bounds import MAX_SNAPSHOT_BYTES
from memplan.textfile import read_binary_file

__all__ = [
    "Snapshot",
    "SnapshotBlock",
    "SnapshotEntry",
    "SnapshotSegment",
    "is_pickle",
    "load_snapshot",
    "safe_loads",
    "snapshot_to_trace",
]

_FIELD = "snapshot file"
_CATEGORIES = frozenset(c.value for c in MemoryCategory)


class _PlainUnpickler(pickle.Unpickler):
    """Admits only plain containers and scalars: every global and persistent id is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise ConfigError(_FIELD, "contains a reference to a Python object, refused for safety",
                          f"{module}.{name}", hint="a real torch.cuda memory snapshot holds only "
                          "dicts, lists, strings and numbers")

    def persistent_load(self, pid: Any) -> Any:
        raise ConfigError(_FIELD, "contains a persistent id, refused for safety", str(pid)[:60])


def safe_loads(data: bytes) -> Any:
    """Unpickle ``data`` admitting only plain containers and scalars."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except ConfigError:
        raise
    except (EOFError, pickle.UnpicklingError, ValueError, IndexError, KeyError, TypeError,
            AttributeError, MemoryError, OverflowError, RecursionError) as exc:
        raise ConfigError(_FIELD, "is not a complete pickle (truncated or corrupt)", type(exc).__name__,
                          hint=str(exc)[:120]) from None


def read_snapshot_bytes(path: str | os.PathLike[str], field: str = _FIELD) -> bytes:
    """The bytes of a snapshot pickle: at most MAX_SNAPSHOT_BYTES, and starting with 0x80 (protocol 2 or later,
    what ``torch.cuda.memory._dump_snapshot`` writes); anything else is refused before it is read whole."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            first = handle.read(1)
    except OSError as exc:
        raise ConfigError(field, "must be a readable file", name, hint=exc.strerror or "") from None
    if first != b"\x80":
        raise ConfigError(field, "is not a snapshot pickle: torch.cuda.memory._dump_snapshot writes pickle protocol "
                          "2 or later, which starts with byte 0x80" + (f" (this file starts with {first[0]:#04x})"
                                                                        if first else " (this file is empty)"), name)
    return read_binary_file(name, field=field, limit=MAX_SNAPSHOT_BYTES, limit_name="MAX_SNAPSHOT_BYTES")


def is_pickle(path: str | os.PathLike[str]) -> bool:
    """True when the file starts like a pickle (protocol 2+ header byte 0x80)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(1) == b"\x80"
    except OSError:
        return False


@dataclass(frozen=True)
class SnapshotBlock:
    address: int
    size: int
    requested_size: int
    state: str  # active_allocated | active_pending_free | inactive

    @property
    def active(self) -> bool:
        return self.state.startswith("active")


@dataclass(frozen=True)
class SnapshotSegment:
    address: int
    total_size: int
    stream: int
    segment_type: str  # small | large
    is_expandable: bool
    blocks: tuple[SnapshotBlock, ...]


@dataclass(frozen=True)
class SnapshotEntry:
    """One entry of a device trace."""

    action: str
    addr: int
    size: int
    stream: int
    time_us: int = 0
    #: memplan's category, in snapshots written by ``memplan trace --snapshot`` ("" otherwise).
    category: str = ""


@dataclass(frozen=True)
class Snapshot:
    """A loaded snapshot (one device)."""

    segments: tuple[SnapshotSegment, ...]
    entries: tuple[SnapshotEntry, ...]
    settings: AllocatorSettings | None
    device: int = 0
    source: str = ""

    @property
    def has_trace(self) -> bool:
        return any(e.action == ALLOC for e in self.entries)


def load_snapshot(path: str | os.PathLike[str], *, device: int | None = None) -> Snapshot:
    """Load a snapshot pickle; malformed, truncated or hostile files raise ConfigError (exit 2)."""
    name = os.fspath(path)
    raw = safe_loads(read_snapshot_bytes(name))
    return parse_snapshot(raw, device=device, source=name)


def parse_snapshot(raw: Any, *, device: int | None = None, source: str = "") -> Snapshot:
    """Validate the unpickled structure and pick one device (default: the one with most entries)."""
    if isinstance(raw, list):  # very old format: the list of segments only
        raw = {"segments": raw, "device_traces": []}
    if not isinstance(raw, Mapping) or not isinstance(raw.get("segments"), list):
        raise ConfigError(_FIELD, "must be a torch.cuda memory snapshot (a dict with 'segments')",
                          type(raw).__name__)
    traces = raw.get("device_traces") or []
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ConfigError(_FIELD, "'device_traces' must be a list of lists", type(traces).__name__)
    if device is None:
        device = max(range(len(traces)), key=lambda i: len(traces[i])) if traces else 0
    segments = tuple(_segment(s, i) for i, s in enumerate(raw["segments"]) if _int(s, "device", i, 0) == device)
    entries = tuple(_entry(e, i) for i, e in enumerate(traces[device])) if device < len(traces) else ()
    settings = raw.get("allocator_settings")
    parsed = AllocatorSettings.from_snapshot(settings) if isinstance(settings, Mapping) else None
    return Snapshot(segments=segments, entries=entries, settings=parsed, device=device, source=source)


def _int(obj: Any, key: str, index: int, default: int | None = None) -> int:
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{_FIELD} item {index}", "must be a dict", type(obj).__name__)
    value = obj.get(key, default)
    if type(value) is not int:
        raise ConfigError(f"{_FIELD} item {index} {key}", "must be an integer", value)
    return value


def _segment(raw: Any, index: int) -> SnapshotSegment:
    address = _int(raw, "address", index)
    blocks, offset = [], address
    for j, b in enumerate(raw.get("blocks") or []):
        size = _int(b, "size", j)
        block_address = b.get("address", offset) if isinstance(b, Mapping) else offset
        blocks.append(SnapshotBlock(int(block_address), size, _int(b, "requested_size", j, size),
                                    str(b.get("state", "inactive"))))
        offset = int(block_address) + size
    return SnapshotSegment(address=address, total_size=_int(raw, "total_size", index),
                           stream=_int(raw, "stream", index, 0), segment_type=str(raw.get("segment_type", "large")),
                           is_expandable=bool(raw.get("is_expandable", False)), blocks=tuple(blocks))


def _entry(raw: Any, index: int) -> SnapshotEntry:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("action"), str):
        raise ConfigError(f"{_FIELD} trace entry {index}", "must be a dict with an 'action'", raw)
    time_us = raw.get("time_us", 0)
    size = _int(raw, "size", index, 0)
    category = raw.get("category")
    # memplan's own snapshots also carry the requested size and the category of each alloc.
    return SnapshotEntry(raw["action"], _int(raw, "addr", index, 0), _int(raw, "requested_size", index, size),
                         _int(raw, "stream", index, 0), time_us if type(time_us) is int else 0,
                         category if type(category) is str and category in _CATEGORIES else "")


def snapshot_to_trace(snapshot: Snapshot) -> Trace:
    """The snapshot as a memplan trace: requested sizes, frees at ``free_completed``.

    Blocks alive before the trace began (freed inside it without an ``alloc``, or active at dump
    time without one) become ``setup`` allocations at iteration -1, in address order. Categories
    are unknown in a snapshot, so every block is ``temporary``.
    """
    events: list[AllocEvent] = []
    live: dict[int, int] = {}
    sizes: dict[int, int] = {}
    categories: dict[int, str] = {}
    pre: list[tuple[int, int, int, int]] = []  # (addr, size, stream, block id)
    next_id = 0
    temp = MemoryCategory.TEMPORARY.value
    completed = any(e.action == "free_completed" for e in snapshot.entries)
    free_actions = {"free_completed", "free"} if completed else {"free_requested", "free"}
    for entry in snapshot.entries:
        if entry.action == ALLOC:
            live[entry.addr] = next_id
            sizes[next_id] = entry.size
            categories[next_id] = entry.category or temp
            events.append(AllocEvent(0, ALLOC, next_id, entry.size, entry.category or temp, "other", 0, "", "",
                                     entry.stream))
            next_id += 1
        elif entry.action in free_actions:
            block = live.pop(entry.addr, None)
            if block is None:
                block = next_id
                next_id += 1
                sizes[block] = entry.size
                pre.append((entry.addr, entry.size, entry.stream, block))
            events.append(AllocEvent(0, FREE, block, sizes[block], categories.get(block, temp), "other", 0, "", "",
                                     entry.stream))
    known = set(live) | {p[0] for p in pre}
    for segment in snapshot.segments:
        for b in segment.blocks:
            if b.active and b.address not in known:
                pre.append((b.address, b.requested_size, segment.stream, next_id))
                next_id += 1
    setup = [AllocEvent(0, ALLOC, bid, size, temp, "setup", -1, "", "", stream)
             for _, size, stream, bid in sorted(pre)]
    ordered = [AllocEvent(i, e.kind, e.block, e.size, e.category, e.phase, e.iteration, e.op, e.module, e.stream)
               for i, e in enumerate([*setup, *events])]
    extra = {"snapshot": os.path.basename(snapshot.source), "device": snapshot.device}
    if snapshot.settings is not None:
        extra["allocator_settings"] = snapshot.settings.to_dict()
    return Trace(events=tuple(ordered), meta=TraceMeta(source="cuda snapshot", device="cuda", extra=extra))
