"""A binary memplan trace (:mod:`memplan.events_binary`) read straight into a diff's rows, fast.

The columns are decoded (every rule of the binary encoding checked) and one pass over the kind, block
and size columns pairs each free with its allocation, as :func:`memplan.events.validate_events`
does; an allocation's key is the tuple of its category, phase, op and module ids and iteration, turned
into a :data:`~memplan.diff.profile.Key` only for the allocations alive at the peak. A pairing
that is off raises :class:`BinarySlow`, for the caller to read the file with
:func:`memplan.events.read_trace`, which names the bad event: both paths refuse the same files
with the same message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memplan.diff.profile import AllocRows, Key
from memplan.events import ALLOC, TraceMeta, binary_columns

__all__ = ["BinarySlow", "binary_rows"]

_KEY_FIELDS = ("category", "op", "module", "phase", "iteration")


class BinarySlow(Exception):
    """The events do not pair up; :func:`memplan.events.read_trace` names the bad one."""


class _Keys(Sequence[Key]):
    """``keys[k]``: the :data:`Key` of the ``k``-th distinct id tuple, built on first use."""

    def __init__(self, combos: list[tuple[int, ...]], tables: dict[str, tuple[str, ...]],
                 make: Callable[[str, str, str, str, int], Key]) -> None:
        self._combos, self._tables, self._make = combos, tables, make
        self._built: dict[int, Key] = {}

    def __getitem__(self, k):  # type: ignore[no-untyped-def, override]
        key = self._built.get(k)
        if key is None:
            category, op, module, phase, iteration = self._combos[k]
            t = self._tables
            key = self._built[k] = self._make(t["category"][category], t["op"][op], t["module"][module],
                                              t["phase"][phase], iteration)
        return key

    def __len__(self) -> int:
        return len(self._combos)


def binary_rows(data: bytes, name: str,
                make_key: Callable[[str, str, str, str, int], Key]) -> tuple[AllocRows, _Keys, TraceMeta]:
    """The diff rows, lazy keys (``make_key(category, op, module, phase, iteration)``) and metadata of
    the binary trace ``data``; :class:`BinarySlow` when its frees do not pair with its allocations."""
    meta, cols = binary_columns(data, name)
    columns = cols.columns
    sizes = columns["size"].tolist()
    if sizes and min(sizes) < 0:
        raise BinarySlow
    kind_table = cols.tables["kind"]
    alloc_id = kind_table.index(ALLOC) if ALLOC in kind_table else -1
    rows = AllocRows()
    allocs, freed = rows.allocs, rows.freed
    add_alloc, add_delta = allocs.append, rows.deltas.append
    combos: list[tuple[int, ...]] = []
    key_of: dict[tuple[int, ...], int] = {}
    live: dict[int, int] = {}
    pop_live = live.pop
    ids = zip(*(columns[field] for field in _KEY_FIELDS))
    for i, (kind, block, size, combo) in enumerate(zip(columns["kind"], columns["block"], sizes, ids)):
        if kind == alloc_id:
            if block in live:
                raise BinarySlow
            k = key_of.get(combo)
            if k is None:
                k = key_of[combo] = len(combos)
                combos.append(combo)
            live[block] = len(allocs)
            add_alloc((i, size, k))
            add_delta(size)
        else:
            row = pop_live(block, -1)
            if row < 0 or allocs[row][1] != size:
                raise BinarySlow
            freed[row] = i
            add_delta(-size)
    return rows, _Keys(combos, dict(cols.tables), make_key), meta
