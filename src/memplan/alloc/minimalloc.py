"""MiniMalloc CSV instances: ``id,lower,upper,size[,offset]``, one buffer per row.

A buffer is live on the half-open interval ``[lower, upper)`` and needs ``size`` bytes
(github.com/google/minimalloc). Reading checks every row and names the line of the first bad
one: duplicate ids, negative sizes or bounds, ``upper <= lower``, non-integers.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass

from memplan.errors import ConfigError

__all__ = ["Buffer", "read_minimalloc_csv", "write_minimalloc_csv"]


@dataclass(frozen=True, slots=True)
class Buffer:
    """A request with a fixed lifetime: live on ``[start, end)``, ``size`` bytes."""

    id: str
    start: int
    end: int
    size: int
    offset: int | None = None


def read_minimalloc_csv(path: str | os.PathLike[str]) -> list[Buffer]:
    """Read a MiniMalloc CSV; bad rows raise ConfigError naming the line (CLI exit 2)."""
    name = os.fspath(path)
    try:
        handle = open(name, newline="", encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise ConfigError("csv file", "must be a readable file", name, hint=exc.strerror or "") from None
    with handle:
        rows = list(csv.reader(handle))
    if not rows:
        raise ConfigError("csv file", "is empty; expected a header id,lower,upper,size[,offset]", name)
    header = [h.strip().lower() for h in rows[0]]
    if header[:4] != ["id", "lower", "upper", "size"] or header[4:] not in ([], ["offset"]):
        raise ConfigError("csv file line 1", "header must be id,lower,upper,size[,offset]", ",".join(rows[0]))
    has_offset = len(header) == 5
    buffers: list[Buffer] = []
    seen: set[str] = set()
    for number, row in enumerate(rows[1:], start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise ConfigError(f"csv file line {number}", f"must have {len(header)} fields", ",".join(row))
        ident = row[0].strip()
        try:
            lower, upper, size = (int(row[i]) for i in (1, 2, 3))
            offset = int(row[4]) if has_offset and row[4].strip() else None
        except ValueError:
            raise ConfigError(f"csv file line {number}", "lower, upper, size (and offset) must be integers",
                              ",".join(row)) from None
        if ident in seen:
            raise ConfigError(f"csv file line {number} id", "duplicates an earlier buffer id", ident)
        if size < 0:
            raise ConfigError(f"csv file line {number} size", "must not be negative", size)
        if lower < 0:
            raise ConfigError(f"csv file line {number} lower", "must not be negative", lower)
        if upper <= lower:
            raise ConfigError(f"csv file line {number} upper", f"must be greater than lower ({lower})", upper)
        if offset is not None and offset < 0:
            raise ConfigError(f"csv file line {number} offset", "must not be negative", offset)
        seen.add(ident)
        buffers.append(Buffer(ident, lower, upper, size, offset))
    return buffers


def write_minimalloc_csv(path: str | os.PathLike[str], buffers: Sequence[Buffer],
                         offsets: Sequence[int]) -> None:
    """Write the buffers back with an ``offset`` column (the same rows, in the same order)."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["id", "lower", "upper", "size", "offset"])
        for buffer, offset in zip(buffers, offsets, strict=True):
            writer.writerow([buffer.id, buffer.start, buffer.end, buffer.size, offset])
