"""The allocation event log shared by ``trace``, ``alloc`` and ``ckpt``: one format, one reader.

A :class:`Trace` is the list of storage allocations and frees of one process (one rank) over one
or more training iterations, in program order, plus the metadata that says what produced it.

On disk a trace has two encodings of the same events, told apart by their first bytes; both are
read by :func:`read_trace`, forever. :func:`write_trace` writes the binary columnar one of
:mod:`memplan.events_binary` (read about four times faster) unless the path ends in ``.jsonl`` or
``.jsonl.gz``, or ``encoding="jsonl"`` is asked. The JSON-lines encoding is a gzip-compressed
(or plain) text file:

* line 1, the header: ``{"format": "memplan-trace", "version": 1, "meta": {...}}``;
* every further line, one event as a JSON array in the order of :data:`EVENT_FIELDS`::

      [index, kind, block, size, category, phase, iteration, op, module, stream]

  ``index`` counts events from 0; ``kind`` is ``"alloc"`` or ``"free"``; ``block`` identifies the
  storage (an alloc and its free share it; a block id may be reused after its free); ``size`` is the
  number of bytes the program requested (before any allocator rounding); ``category`` is a
  :class:`~memplan.categories.MemoryCategory` value; ``phase`` one of :data:`PHASES`;
  ``iteration`` counts training iterations from 0 (``-1``: setup before the first one); ``op`` the
  operator that allocated or freed (``aten.mm.default``), ``module`` the dotted module path
  (``""`` outside any module); ``stream`` the CUDA stream (0 = default).

Arrays rather than objects keep a million-event file small and fast to read. A reader refuses a
file whose ``version`` is newer than :data:`TRACE_VERSION` (it cannot know what changed) and any
line that is not a well-formed event, naming the line.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import field
from itertools import repeat
from operator import itemgetter
from typing import Any, Literal, NamedTuple

from memplan.bounds import MAX_EVENTS, MAX_TRACE_BYTES
from memplan.categories import MemoryCategory
from memplan.errors import ConfigError
from memplan.events_binary import MAGIC as BINARY_MAGIC
from memplan.events_binary import Columns, Schema, decode_columns, encode_columns
from memplan.frozen import frozen_dataclass
from memplan.textfile import read_inflated

__all__ = [
    "ALLOC",
    "BINARY_MAGIC",
    "EVENT_FIELDS",
    "FREE",
    "PHASES",
    "TRACE_ENCODINGS",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "AllocEvent",
    "Trace",
    "TraceMeta",
    "binary_columns",
    "gc_paused",
    "parse_header",
    "read_trace",
    "trace_to_binary",
    "validate_events",
    "write_trace",
]

TRACE_FORMAT = "memplan-trace"
#: Version written by this memplan; readers accept this and older versions.
TRACE_VERSION = 1
#: The two encodings of a trace file (see the module docstring).
TraceEncoding = Literal["binary", "jsonl"]
TRACE_ENCODINGS: tuple[str, ...] = ("binary", "jsonl")

ALLOC = "alloc"
FREE = "free"
_KINDS = frozenset((ALLOC, FREE))

#: Phases of a training iteration an event can belong to.
PHASES: tuple[str, ...] = ("setup", "forward", "backward", "optimizer", "other")
_PHASES = frozenset(PHASES)
_CATEGORIES = frozenset(c.value for c in MemoryCategory)

#: Order of the fields of an event line.
EVENT_FIELDS: tuple[str, ...] = (
    "index", "kind", "block", "size", "category", "phase", "iteration", "op", "module", "stream",
)


class AllocEvent(NamedTuple):
    """One allocation or free of a storage.

    A named tuple rather than a frozen dataclass: equally immutable, and a million of them are built
    in a fifth of the time when a trace is read (``AllocEvent(*row)``; change one with ``_replace``).
    """

    index: int
    kind: str
    block: int
    size: int
    category: str = MemoryCategory.TEMPORARY.value
    phase: str = "other"
    iteration: int = 0
    op: str = ""
    module: str = ""
    stream: int = 0

    @property
    def is_alloc(self) -> bool:
        return self.kind == ALLOC

    def to_row(self) -> list[Any]:
        return [self.index, self.kind, self.block, self.size, self.category, self.phase,
                self.iteration, self.op, self.module, self.stream]


@frozen_dataclass
class TraceMeta:
    """What produced a trace.

    ``device`` is ``"cuda"`` when sizes were recorded as a CUDA run requests them, ``"cpu"`` for a
    CPU run; ``source`` names the producer (``"memplan trace"``, ``"cuda snapshot"``,
    ``"minimalloc csv"``); ``extra`` holds anything else (model name, job, torch version, ...).
    """

    source: str = "memplan trace"
    device: str = "cuda"
    rank: int = 0
    world_size: int = 1
    iterations: int = 1
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "device": self.device, "rank": self.rank,
            "world_size": self.world_size, "iterations": self.iterations, "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TraceMeta:
        if not isinstance(data, Mapping):
            raise ConfigError("trace header meta", "must be a JSON object", type(data).__name__)
        known = {"source", "device", "rank", "world_size", "iterations", "extra"}
        kwargs = {k: data[k] for k in known if k in data}
        return cls(**kwargs)


@frozen_dataclass
class Trace:
    """An ordered allocation/free log with its metadata."""

    events: tuple[AllocEvent, ...]
    meta: TraceMeta = field(default_factory=TraceMeta)

    def __len__(self) -> int:
        return len(self.events)

    def live_bytes(self) -> Iterator[int]:
        """Bytes live after each event (requested sizes, no allocator rounding)."""
        live = 0
        for event in self.events:
            live += event.size if event.kind == ALLOC else -event.size
            yield live

    @property
    def peak_live_bytes(self) -> int:
        """Largest number of requested bytes alive at once: the lower bound of any allocator."""
        return max(self.live_bytes(), default=0)


# ----------------------------------------------------------------------------------------------
# Validation


def validate_events(events: Iterable[AllocEvent]) -> None:
    """Check the log is consistent: each free matches a live alloc of the same block and size."""
    live: dict[int, int] = {}
    for position, event in enumerate(events):
        if event.size < 0:
            raise ConfigError(f"trace event {position} size", "must be >= 0", event.size)
        if event.kind == ALLOC:
            if event.block in live:
                raise ConfigError(f"trace event {position} block", "is allocated again before it was freed",
                                  event.block)
            live[event.block] = event.size
        elif event.kind == FREE:
            size = live.pop(event.block, None)
            if size is None:
                raise ConfigError(f"trace event {position} block", "is freed but not live", event.block)
            if size != event.size:
                raise ConfigError(f"trace event {position} size",
                                  f"must equal the size of its allocation ({size})", event.size)
        else:
            raise ConfigError(f"trace event {position} kind", "must be 'alloc' or 'free'", event.kind)


# ----------------------------------------------------------------------------------------------
# File I/O


def write_trace(trace: Trace, path: str | os.PathLike[str], *, encoding: TraceEncoding | None = None) -> None:
    """Write ``trace`` to ``path``: ``encoding="binary"`` (see :mod:`memplan.events_binary`) or ``"jsonl"``
    (gzip JSON lines, see the module docstring); by default JSON lines for a path ending in ``.jsonl`` or
    ``.jsonl.gz``, binary otherwise."""
    name = os.fspath(path)
    if encoding is None:
        encoding = "jsonl" if name.endswith((".jsonl", ".jsonl.gz")) else "binary"
    if encoding == "binary":
        data = trace_to_binary(trace)
        with open(name, "wb") as raw:
            raw.write(data)
        return
    if encoding != "jsonl":
        raise ConfigError("trace encoding", f"must be one of {list(TRACE_ENCODINGS)}", encoding)
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "meta": trace.meta.to_dict()}
    with gzip.open(name, "wt", encoding="utf-8", compresslevel=6) as handle:
        handle.write(json.dumps(header, separators=(",", ":")) + "\n")
        dumps = json.JSONEncoder(separators=(",", ":")).encode
        for event in trace.events:
            handle.write(dumps(event.to_row()))
            handle.write("\n")


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace written by :func:`write_trace` in either encoding (told apart by the first bytes);
    malformed or newer files raise ConfigError."""
    name = os.fspath(path)
    data = read_inflated(name, field="trace file", limit=MAX_TRACE_BYTES, limit_name="MAX_TRACE_BYTES")
    if data[:4] == BINARY_MAGIC[:4]:  # a damaged magic is named by the binary reader
        return _binary_trace(data, name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("trace file", "must be a complete gzip JSON-lines memplan trace", name,
                          hint=str(exc)) from None
    del data
    check_event_lines(text.count("\n"), name)
    return _fast_parse(text, name) or _parse(text.splitlines(keepends=True), name)


def check_event_lines(newlines: int, name: str) -> None:
    """Refuse a JSON-lines trace of ``newlines`` line breaks that holds more than MAX_EVENTS events
    (counted before a line is parsed)."""
    if newlines > MAX_EVENTS + 1:
        raise ConfigError("trace file", f"holds more than {MAX_EVENTS:,} events (memplan's limit MAX_EVENTS)", name)


def _fast_parse(text: str, name: str) -> Trace | None:
    """The events of a well-formed trace decoded as one JSON array and checked column by column (C
    loops, the cyclic garbage collector paused while a million small objects are made); None when
    an event line is off, for :func:`_parse` to find and name the bad line (a bad header raises here)."""
    first, _, body = text.partition("\n")
    meta = parse_header(first, name)
    with gc_paused():
        core = body.strip()
        lines = core.replace("\n", ",") if "\n\n" not in core else ",".join(
            line for line in core.split("\n") if line.strip())
        try:
            rows = json.loads("[" + lines + "]")
        except (json.JSONDecodeError, RecursionError):  # RecursionError: a line nested thousands deep
            return None
        if rows and not _columns_valid(rows):
            return None
        events = list(map(tuple.__new__, repeat(AllocEvent), rows))
    validate_events(events)
    return Trace(events=tuple(events), meta=meta)


def _columns_valid(rows: list[Any]) -> bool:
    """Every row a list of :data:`EVENT_FIELDS` with a known kind, category and phase, and integer
    block and size (size >= 0) — what :func:`_parse` checks line by line."""
    if set(map(type, rows)) != {list} or set(map(len, rows)) != {len(EVENT_FIELDS)}:
        return False
    kind, block, size, category, phase = (itemgetter(i) for i in (1, 2, 3, 4, 5))
    sizes = list(map(size, rows))
    return (set(map(kind, rows)) <= _KINDS and set(map(category, rows)) <= _CATEGORIES
            and set(map(phase, rows)) <= _PHASES and set(map(type, sizes)) == {int} and min(sizes) >= 0
            and set(map(type, map(block, rows))) == {int})


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while millions of small acyclic objects are made (it would
    only rescan them, again and again)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_header(line: str, name: str) -> TraceMeta:
    """The metadata of a trace file's header ``line``; a line that is no memplan-trace header, or a
    version this memplan does not read, raises ConfigError (``name``: the file, for the message)."""
    try:
        header = json.loads(line)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: arrays nested thousands deep
        raise ConfigError("trace file", "must start with a memplan-trace JSON header line", name) from None
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        raise ConfigError("trace file", f"must start with a header whose format is {TRACE_FORMAT!r}", name)
    version = header.get("version")
    if not isinstance(version, int) or version < 1:
        raise ConfigError("trace header version", "must be a positive integer", version)
    if version > TRACE_VERSION:
        raise ConfigError("trace header version", f"is newer than this memplan reads (<= {TRACE_VERSION})",
                          version, hint="upgrade memplan to read it")
    return TraceMeta.from_dict(header.get("meta", {}))


def _parse(lines: Iterable[str], name: str) -> Trace:
    iterator = iter(lines)
    meta = parse_header(next(iterator, ""), name)
    events: list[AllocEvent] = []
    append = events.append
    loads = json.loads
    for number, line in enumerate(iterator, start=2):
        if not line.strip():
            continue
        try:
            row = loads(line)
            index, kind, block, size, category, phase, iteration, op, module, stream = row
        except (json.JSONDecodeError, ValueError, TypeError, RecursionError):
            raise ConfigError(f"trace file line {number}",
                              f"must be a JSON array of {len(EVENT_FIELDS)} fields {EVENT_FIELDS}",
                              line.strip()[:80]) from None
        if kind not in _KINDS or type(size) is not int or size < 0 or type(block) is not int:
            raise ConfigError(f"trace file line {number}",
                              "must have kind 'alloc'/'free', an integer block and a size >= 0",
                              line.strip()[:80])
        if category not in _CATEGORIES:
            raise ConfigError(f"trace file line {number} category",
                              f"must be one of {sorted(_CATEGORIES)}", category)
        if phase not in _PHASES:
            raise ConfigError(f"trace file line {number} phase", f"must be one of {list(PHASES)}", phase)
        append(AllocEvent(index, kind, block, size, category, phase, iteration, op, module, stream))
    validate_events(events)
    return Trace(events=tuple(events), meta=meta)


# ----------------------------------------------------------------------------------------------
# The binary encoding's fields (the container is memplan.events_binary)

#: The string fields of an event and the values they may hold (None: any string).
_BINARY_SCHEMA = Schema(fields=EVENT_FIELDS, strings={
    "kind": _KINDS, "category": _CATEGORIES, "phase": _PHASES, "op": None, "module": None})


def trace_to_binary(trace: Trace) -> bytes:
    """The binary encoding of ``trace`` (:mod:`memplan.events_binary`); :func:`write_trace` writes it."""
    header = json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION, "meta": trace.meta.to_dict()},
                        separators=(",", ":"))
    count = len(trace.events)
    columns = list(zip(*trace.events)) if count else [()] * len(EVENT_FIELDS)
    return encode_columns(header, _BINARY_SCHEMA, columns, count)


def binary_columns(data: bytes, name: str) -> tuple[TraceMeta, Columns]:
    """The metadata and columns of the binary trace ``data`` (file ``name``), every rule of the encoding
    checked but the alloc/free pairing (for a reader that needs only some columns, as ``memplan diff``)."""
    cols = decode_columns(data, name, _BINARY_SCHEMA)
    return parse_header(cols.header, name), cols


def _binary_trace(data: bytes, name: str) -> Trace:
    """The :class:`Trace` of the binary trace ``data``, validated as every trace is."""
    meta, cols = binary_columns(data, name)
    with gc_paused():
        # blocks and sizes as lists: their ints are made once for the events and the check
        fields = [cols.values(f).tolist() if f in ("block", "size") else cols.values(f)  # type: ignore[attr-defined]
                  for f in EVENT_FIELDS]
        events = tuple(map(tuple.__new__, repeat(AllocEvent), zip(*fields)))
        blocks, sizes = fields[EVENT_FIELDS.index("block")], fields[EVENT_FIELDS.index("size")]
        valid = _pairs_valid(cols.columns["kind"].tolist(), cols.tables["kind"], blocks, sizes)
    if not valid:
        validate_events(events)  # raises, naming the first bad event
    return Trace(events=events, meta=meta)


def _pairs_valid(kinds: list[int], table: tuple[str, ...], blocks: list[int], sizes: list[int]) -> bool:
    """:func:`validate_events`'s rules on the columns (kind ids into ``table``), in half its time."""
    if sizes and min(sizes) < 0:
        return False
    alloc_id = table.index(ALLOC) if ALLOC in table else -1
    live: dict[int, int] = {}
    pop = live.pop
    for kind, block, size in zip(kinds, blocks, sizes):
        if kind == alloc_id:
            if block in live:
                return False
            live[block] = size
        elif pop(block, -1) != size:
            return False
    return True
