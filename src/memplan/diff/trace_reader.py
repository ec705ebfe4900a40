"""A memplan trace file read straight into a :class:`~memplan.diff.profile.Profile`, fast.

:func:`memplan.events.read_trace` builds one :class:`~memplan.events.AllocEvent` per line
(about 9 s for a million events on the 2-core development machine); a diff needs only each
event's kind, block and size, and the (category, module, site) of each allocation. This reader
splits each line (as bytes) of the canonical form :func:`memplan.events.write_trace` writes
(``[index,"alloc",block,size,<tail>]``) at its first four commas and decodes each distinct tail
(``"category","phase",iteration,"op","module",stream``) once with :mod:`json`, applying the same
checks as ``read_trace``: the header, the version, kinds, sizes, categories, phases, and every free
matching a live allocation of the same block and size.

A binary trace (:mod:`memplan.events_binary`) is read from its columns by
:mod:`memplan.diff.binary_reader`. A line it cannot read that way (another JSON spelling, or a bad line) sends the whole file to
``read_trace``, which reads any valid spelling and names the bad line; so both readers accept and
refuse the same files, and refuse with the same message.

In a trace, the **site** of an allocation is its operator and module (``aten.mm.default in
model.layers.0.mlp``); the **module** is the event's dotted module path.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable

from memplan.categories import MemoryCategory
from memplan.diff.frames import OUTSIDE
from memplan.diff.profile import AllocRows, Key, Profile, finish_profile, rows_of_events
from memplan.bounds import MAX_TRACE_BYTES
from memplan.events import (BINARY_MAGIC, PHASES, Trace, TraceMeta, check_event_lines, gc_paused, parse_header,
                            read_trace)
from memplan.textfile import read_inflated

__all__ = ["profile_trace", "profile_trace_file", "trace_keys"]

_CATEGORIES = frozenset(c.value for c in MemoryCategory)
_PHASES = frozenset(PHASES)
#: A tail as ``write_trace`` writes it, with a known category and phase, and strings of printable ASCII
#: without quotes or escapes (any other tail is parsed in full).
_CANONICAL_TAIL = re.compile((
    '"(?:' + "|".join(sorted(_CATEGORIES)) + ')","(?:' + "|".join(PHASES) + ')",'
    + r'-?\d+,"[ !#-\[\]-~]*","[ !#-\[\]-~]*",\d+\]'
).encode("ascii"))


class _Slow(Exception):
    """The fast path met a line it does not read; ``read_trace`` takes over."""


def trace_keys(category: str, op: str, module: str, phase: str, iteration: int) -> Key:
    """The :data:`~memplan.diff.profile.Key` of a trace allocation (site: operator and module)."""
    where = module or OUTSIDE
    site = f"{op or '(no operator)'} in {where}"
    return category, where, site, f"{phase} of iteration {iteration}" if iteration >= 0 else phase


def _tail_fields(tail: str) -> list:  # type: ignore[type-arg]
    """``[category, phase, iteration, op, module, stream]`` of a line's tail (after its size)."""
    if "\\" not in tail:  # no escapes: the strings hold no quote, so the quotes delimit them
        parts = tail.split('"')
        if len(parts) == 9 and parts[0] == "" and parts[2] == "," == parts[6] and parts[8][-1:] == "]":
            middle, last = parts[4], parts[8]
            if middle[:1] == "," == middle[-1:] and last[:1] == ",":
                try:
                    return [parts[1], parts[3], int(middle[1:-1]), parts[5], parts[7], int(last[1:-1])]
                except ValueError:
                    raise _Slow from None
    try:
        fields = json.loads("[" + tail)
    except (json.JSONDecodeError, RecursionError):
        raise _Slow from None
    if not isinstance(fields, list) or len(fields) != 6:
        raise _Slow
    return fields


def _key_maker() -> Callable[[bytes], Key]:
    """``tail -> Key``, sharing the strings of the keys that only the iteration tells apart."""
    sites: dict[tuple[str, str, str], tuple[str, str, str]] = {}
    whens: dict[tuple[str, int], str] = {}

    def make(raw: bytes) -> Key:
        try:
            tail = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Slow from None
        category, phase, iteration, op, module, stream = _tail_fields(tail)
        if category not in _CATEGORIES or phase not in _PHASES or type(iteration) is not int \
                or type(stream) is not int or not isinstance(op, str) or not isinstance(module, str):
            raise _Slow
        triple = sites.get((category, op, module))
        if triple is None:
            triple = sites[category, op, module] = trace_keys(category, op, module, "", -1)[:3]
        when = whens.get((phase, iteration))
        if when is None:
            when = whens[phase, iteration] = trace_keys(category, op, module, phase, iteration)[3]
        return (*triple, when)

    return make


class _LazyKeys:
    """``keys[k]``: the :data:`Key` of the ``k``-th distinct tail, computed on first use.

    Every tail is checked when the file is read (:meth:`check`, one regular-expression match each;
    a tail it does not match is parsed fully); only the keys of the allocations alive at the peak
    are ever built.
    """

    def __init__(self) -> None:
        self.tails: list[bytes] = []
        self._make = _key_maker()
        self._built: dict[int, Key] = {}

    def check(self) -> None:
        match = _CANONICAL_TAIL.fullmatch
        for k, tail in enumerate(self.tails):
            if match(tail) is None:
                self._built[k] = self._make(tail)  # raises _Slow when the tail is not valid

    def __getitem__(self, k: int) -> Key:
        key = self._built.get(k)
        if key is None:
            key = self._built[k] = self._make(self.tails[k])
        return key

    def __len__(self) -> int:
        return len(self.tails)


def _rows(lines: list[bytes]) -> tuple[AllocRows, _LazyKeys]:
    """One pass over the event lines (the hot loop of ``memplan diff``: keep it lean)."""
    rows = AllocRows()
    allocs, freed = rows.allocs, rows.freed
    add_alloc, add_delta = allocs.append, rows.deltas.append
    keys = _LazyKeys()
    tails = keys.tails
    add_tail = tails.append
    key_of: dict[bytes, int] = {}  # tail text -> index into keys
    get_key = key_of.get
    live: dict[bytes, int] = {}  # block (as written) -> allocation row
    pop_live = live.pop
    for i, line in enumerate(lines):
        try:
            _, kind, block, size, tail = line.split(b",", 4)
            size = int(size)
        except ValueError:
            raise _Slow from None
        k = get_key(tail)
        if k is None:
            k = key_of[tail] = len(tails)
            add_tail(tail)
        if kind == b'"alloc"':
            if block in live or not block.isdigit() or size < 0:
                raise _Slow
            live[block] = len(allocs)
            add_alloc((i, size, k))
            add_delta(size)
        elif kind == b'"free"':
            row = pop_live(block, -1)
            if row < 0 or allocs[row][1] != size:
                raise _Slow
            freed[row] = i
            add_delta(-size)
        else:
            raise _Slow
    keys.check()
    return rows, keys


def _device(meta: TraceMeta) -> str:
    return f"{meta.device} rank {meta.rank}"


def profile_trace(trace: Trace, *, path: str) -> Profile:
    """The profile of a trace already in memory (validated as :func:`~memplan.events.read_trace` does)."""
    keys: list[Key] = []
    rows = rows_of_events(trace.events, lambda _i, e: trace_keys(e.category, e.op, e.module, e.phase, e.iteration),
                          keys)
    return finish_profile(rows, keys, path=path, kind="trace", device=_device(trace.meta), device_index=None)


def profile_trace_file(path: str | os.PathLike[str]) -> Profile:
    """Read a memplan trace file (binary, gzip or plain JSON lines) into its :class:`Profile`."""
    name = os.fspath(path)
    data = read_inflated(name, field="trace file", limit=MAX_TRACE_BYTES, limit_name="MAX_TRACE_BYTES")
    if data[:4] == BINARY_MAGIC[:4]:
        from memplan.diff.binary_reader import BinarySlow, binary_rows

        try:
            with gc_paused():
                rows, keys, meta = binary_rows(data, name, trace_keys)
            return finish_profile(rows, keys, path=name, kind="trace", device=_device(meta), device_index=None)
        except BinarySlow:
            return profile_trace(read_trace(name), path=name)
    try:
        with gc_paused():
            raw, data = data, b""
            check_event_lines(raw.count(b"\n"), name)
            lines = raw.splitlines()
            meta = parse_header(lines[0].decode("utf-8") if lines else "", name)
            if raw.count(b"\n[") != len(lines) - 1:  # every event line starts with "["
                raise _Slow
            del raw, lines[0]
            rows, keys = _rows(lines)
        return finish_profile(rows, keys, path=name, kind="trace", device=_device(meta), device_index=None)
    except (_Slow, OSError, EOFError, UnicodeDecodeError, zlib.error):
        return profile_trace(read_trace(name), path=name)
