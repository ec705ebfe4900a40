"""The binary columnar encoding of a memplan trace: the same events, read four times faster.

A million-event trace in gzip JSON lines takes seconds to read, most of it JSON decoding and the
building of a million lists. This encoding stores each field of an event as one fixed-width column
(standard library only: :mod:`array`, :mod:`struct`, :mod:`zlib`) and each string field as small
integer ids into a table of its distinct strings. This module is the container, given a
:class:`Schema` (the fields in order, which are strings and what their tables may hold);
:mod:`memplan.events` gives it the trace's fields and builds the events. Layout (little-endian)::

    magic            8 bytes  89 4D 50 54 0D 0A 1A 0A  ("\\x89MPT\\r\\n\\x1a\\n")
    encoding version u32      1
    header length    u32      then that many bytes of UTF-8: the JSON header line of the JSON-lines encoding
    event count      u64      N (at most MAX_EVENTS)
    one column per field, in the schema's order, each:
      element type   1 byte   struct code: b h i q (integer fields), B H I (string fields: ids)
      string fields only: table length u32, then a zlib stream of a JSON array of the distinct strings
      data length    u64      then a zlib stream of N elements of that type (N x 1, 2, 4 or 8 bytes)

The magic follows PNG's: a first byte that is not ASCII (no text reader mistakes it for text; it is
not ``\\x80``, a pickle's first byte, nor ``\\x1f``, gzip's), then CR LF, Ctrl-Z and LF, which a text-mode
copy would mangle. The writer picks the narrowest type that holds each column. A reader refuses,
with one :class:`~memplan.errors.ConfigError` naming the file and the rule: a wrong magic, a newer
encoding version, a header that is not UTF-8, a truncated file or a column of the wrong length, an
absurd event count, an unknown element type, a bad zlib stream, a table that inflates to more than
MAX_TABLE_BYTES, is not a JSON array of strings or holds a value its field does not allow, an id
beyond its table, bytes after the last column.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from memplan.bounds import MAX_EVENTS as BOUND_EVENTS
from memplan.errors import ConfigError

__all__ = ["ENCODING_VERSION", "MAGIC", "MAX_EVENTS", "MAX_TABLE_BYTES", "Columns", "Schema", "decode_columns",
           "encode_columns"]

MAGIC = b"\x89MPT\r\n\x1a\n"
#: Layout version written by this memplan; readers accept this and older ones.
ENCODING_VERSION = 1
#: Most events a file may claim (memplan's limit :data:`memplan.bounds.MAX_EVENTS`, checked before a column is
#: inflated: a file of a few MB can claim 10^9 events that would take hundreds of GiB to read).
MAX_EVENTS = BOUND_EVENTS
#: Most bytes a string table may inflate to (a million distinct 100-character names take 100 MB).
MAX_TABLE_BYTES = 2**30
#: zlib level: 6 (zlib's default); a million events compress to about 2.3 MB (2.3 bytes each).
_LEVEL = 6

_INT_CODES = "bhiq"
_ID_CODES = "BHI"
_SIZES = {"b": 1, "B": 1, "h": 2, "H": 2, "i": 4, "I": 4, "q": 8}
_BIG_ENDIAN = sys.byteorder == "big"


def _array_code(code: str) -> str:
    """The :mod:`array` type code of the struct code ``code`` (same signedness and byte width)."""
    candidates = "bhilq" if code.islower() else "BHILQ"
    return next(c for c in candidates if array(c).itemsize == _SIZES[code])


_ARRAY_CODES = {code: _array_code(code) for code in _SIZES}


@dataclass(frozen=True)
class Schema:
    """The fields of a record, in column order, and which are strings."""

    fields: tuple[str, ...]
    #: String field -> the values its table may hold (None: any string); every other field is an integer.
    strings: Mapping[str, frozenset[str] | None]


@dataclass(frozen=True)
class Columns:
    """A decoded file: its header text and one array per field, string fields as ids."""

    header: str
    count: int
    #: Field name -> its column (string fields: ids into ``tables[field]``).
    columns: Mapping[str, array]
    tables: Mapping[str, tuple[str, ...]]

    def values(self, field: str) -> Sequence[Any]:
        """The column of ``field`` as values: an array of integers, or a tuple of strings."""
        column = self.columns[field]
        table = self.tables.get(field)
        if table is None:
            return column
        if len(table) == 1:
            return (table[0],) * self.count
        if self.count < 2:  # itemgetter of one index returns the item, not a tuple
            return tuple(table[i] for i in column)
        return itemgetter(*column)(table)  # a third of the time of list(map(table.__getitem__, column))


# ----------------------------------------------------------------------------------------------
# Writing


def encode_columns(header: str, schema: Schema, columns: Sequence[Sequence[Any]], count: int) -> bytes:
    """The binary encoding of ``count`` records given as ``columns`` (one per field of ``schema``)."""
    head = header.encode("utf-8")
    parts = [MAGIC, struct.pack("<II", ENCODING_VERSION, len(head)), head, struct.pack("<Q", count)]
    for field, values in zip(schema.fields, columns, strict=True):
        if field in schema.strings:
            table = list(dict.fromkeys(values))
            if not all(type(s) is str for s in table):
                bad = next(s for s in table if type(s) is not str)
                raise ConfigError(f"trace event {field}", "must be a string", bad)
            index = {s: i for i, s in enumerate(table)}
            code = next(c for c in _ID_CODES if len(table) <= 1 << (8 * _SIZES[c]))
            ids = list(map(index.__getitem__, values))
            packed = zlib.compress(json.dumps(table).encode("ascii"), _LEVEL)
            parts += [code.encode("ascii"), struct.pack("<I", len(packed)), packed]
            parts += _column(code, ids)
        else:
            parts += _int_column(field, values)
    return b"".join(parts)


def _int_column(field: str, values: Any) -> list[bytes]:
    if not set(map(type, values)) <= {int}:  # bool and int subclasses too: array() would store them as ints
        bad = next(v for v in values if type(v) is not int)
        raise ConfigError(f"trace event {field}", "must be an integer", bad)
    low, high = (min(values), max(values)) if values else (0, 0)
    code = next((c for c in _INT_CODES if -(1 << (8 * _SIZES[c] - 1)) <= low and high < 1 << (8 * _SIZES[c] - 1)),
                None)
    if code is None:
        raise ConfigError(f"trace event {field}", "must fit in a signed 64-bit integer for the binary encoding",
                          high if high >= 1 << 63 else low, hint="write JSON lines instead (encoding='jsonl')")
    return [code.encode("ascii"), *_column(code, values)]


def _column(code: str, values: Any) -> list[bytes]:
    column = array(_ARRAY_CODES[code], values)
    if _BIG_ENDIAN:
        column.byteswap()
    data = zlib.compress(column.tobytes(), _LEVEL)
    return [struct.pack("<Q", len(data)), data]


# ----------------------------------------------------------------------------------------------
# Reading


class _Reader:
    """Bytes taken in order from ``data``; a short read is a truncated file."""

    def __init__(self, data: bytes, name: str) -> None:
        self.data, self.name, self.pos = memoryview(data), name, 0

    def fail(self, rule: str) -> ConfigError:
        return ConfigError("binary trace file", rule, self.name)

    def take(self, size: int, what: str) -> memoryview:
        end = self.pos + size
        if end > len(self.data):
            raise self.fail(f"is truncated: {what} needs {size} bytes, {len(self.data) - self.pos} remain")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def unpack(self, fmt: str, what: str) -> int:
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt), what))
        return value

    def inflate(self, blob: memoryview, expected: int, what: str) -> bytes:
        """``blob`` decompressed, which must be exactly ``expected`` bytes (never inflates more)."""
        stream = zlib.decompressobj()
        try:
            out = stream.decompress(blob, expected + 1)
        except zlib.error as exc:
            raise self.fail(f"{what} must be a zlib stream ({exc})") from None
        if len(out) != expected or not stream.eof or stream.unused_data:
            size = "more" if len(out) > expected or stream.unconsumed_tail else f"{len(out)}"
            raise self.fail(f"{what} must hold {expected} bytes, it holds {size}")
        return out


def decode_columns(data: bytes, name: str, schema: Schema) -> Columns:
    """The columns of the binary file ``data`` (``name``, for messages) of ``schema``'s records; every
    rule of the module docstring is checked."""
    reader = _Reader(data, name)
    if bytes(reader.take(len(MAGIC), "the magic number")) != MAGIC:
        raise reader.fail(f"must start with the magic number {MAGIC!r}")
    version = reader.unpack("<I", "the encoding version")
    if not 1 <= version <= ENCODING_VERSION:
        raise reader.fail(f"has encoding version {version}; this memplan reads 1 to {ENCODING_VERSION}"
                          + ("; upgrade memplan to read it" if version > ENCODING_VERSION else ""))
    header = reader.take(reader.unpack("<I", "the header length"), "the header")
    try:
        text = bytes(header).decode("utf-8")
    except UnicodeDecodeError:
        raise reader.fail("must have a UTF-8 JSON header") from None
    count = reader.unpack("<Q", "the event count")
    if count > MAX_EVENTS:
        raise reader.fail(f"claims {count} events, more than the {MAX_EVENTS:,} a trace may hold (memplan's limit "
                          "MAX_EVENTS)")
    columns: dict[str, array] = {}
    tables: dict[str, tuple[str, ...]] = {}
    for field in schema.fields:
        code = bytes(reader.take(1, f"column {field!r}")).decode("latin-1")
        allowed = _ID_CODES if field in schema.strings else _INT_CODES
        if code not in allowed:
            raise reader.fail(f"column {field!r} must have element type one of {list(allowed)} (got {code!r})")
        if field in schema.strings:
            tables[field] = _table(reader, field, schema.strings[field])
        blob = reader.take(reader.unpack("<Q", f"column {field!r} length"), f"column {field!r}")
        column = array(_ARRAY_CODES[code])
        column.frombytes(reader.inflate(blob, count * _SIZES[code], f"column {field!r}"))
        if _BIG_ENDIAN:
            column.byteswap()
        if field in tables and not _ids_below(column, len(tables[field])):
            raise reader.fail(f"column {field!r} must hold ids below its table's {len(tables[field])} strings "
                              f"(got {max(column)})")
        columns[field] = column
    if reader.pos != len(data):
        raise reader.fail(f"must end after its last column ({len(data) - reader.pos} bytes follow)")
    return Columns(header=text, count=count, columns=columns, tables=tables)


def _table(reader: _Reader, field: str, allowed: frozenset[str] | None) -> tuple[str, ...]:
    blob = reader.take(reader.unpack("<I", f"table {field!r} length"), f"table {field!r}")
    stream = zlib.decompressobj()
    try:
        text = stream.decompress(blob, MAX_TABLE_BYTES + 1)
        if len(text) > MAX_TABLE_BYTES:
            raise reader.fail(f"table {field!r} must inflate to at most {MAX_TABLE_BYTES} bytes")
        table = json.loads(text.decode("ascii"))
    except (zlib.error, UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # deep nesting too
        table = None
    if not isinstance(table, list) or not all(type(s) is str for s in table) or not stream.eof:
        raise reader.fail(f"table {field!r} must be a zlib stream of a JSON array of strings") from None
    if allowed is not None and not set(table) <= allowed:
        raise reader.fail(f"table {field!r} must hold only {sorted(allowed)} "
                          f"(got {min(set(table) - allowed)!r})")
    return tuple(table)


def _ids_below(column: array, size: int) -> bool:
    """Every id of ``column`` is below ``size`` (one-byte ids: a C byte translation, not a max over boxed ints)."""
    if not column or (column.itemsize == 1 and size >= 256):
        return True
    if column.itemsize == 1:
        return not column.tobytes().translate(None, bytes(range(size)))
    return max(column) < size
