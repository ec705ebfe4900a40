"""Read a user's input file as text, or fail with one :class:`~memplan.errors.ConfigError` line.

Every text dialect memplan reads (job files, Megatron arguments, DeepSpeed JSON, ``config.json``)
goes through :func:`read_text_file`, so a wrong path gets the same clear answer everywhere: the flag,
the rule and the path, e.g. ``--deepspeed-config: is a gzip-compressed file, not text; decompress it
first (got 'ds.json.gz')`` — never a ``UnicodeDecodeError`` traceback.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memplan.bounds import MAX_INPUT_BYTES, MAX_NAME_CHARS
from memplan.errors import ConfigError

__all__ = ["read_binary_file", "read_capped", "read_inflated", "read_text_file", "write_atomic"]

#: Leading bytes of compressed/archive formats people pass by mistake, and their names.
_MAGIC = {
    b"\x1f\x8b": "gzip-compressed",
    b"PK\x03\x04": "zip",
    b"BZh": "bzip2-compressed",
    b"\xfd7zXZ\x00": "xz-compressed",
    b"\x28\xb5\x2f\xfd": "zstd-compressed",
    b"\x80": "pickle",
}
#: How many leading bytes are checked for NUL (a text file never holds one).
_SNIFF_BYTES = 8192


def read_binary_file(path: str | os.PathLike[str], *, field: str, limit: int | None = None,
                     limit_name: str = "") -> bytes:
    """The bytes of ``path`` (a snapshot pickle, a trace); ``ConfigError(field, "must be a readable
    file", path)`` when it cannot be read, or holds more than ``limit`` bytes (``limit_name``: the
    limit's name for the message; the read stops at the limit, so an endless stream is refused)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            data = handle.read() if limit is None else read_at_most(handle, limit + 1)
    except OSError as exc:
        raise ConfigError(field, "must be a readable file", _shown(name), hint=exc.strerror or "") from None
    if limit is not None and len(data) > limit:
        raise ConfigError(field, f"is larger than {limit:,} bytes (memplan's limit {limit_name})", _shown(name))
    return data


def read_inflated(path: str | os.PathLike[str], *, field: str, limit: int, limit_name: str) -> bytes:
    """The bytes of ``path``, gunzipped when it is gzip; at most ``limit`` bytes of either, read and
    inflated no further than that (a gzip bomb or an endless stream stops at the cap)."""
    import gzip
    import zlib

    name = os.fspath(path)
    data = read_binary_file(name, field=field, limit=limit, limit_name=limit_name)
    if data[:2] != b"\x1f\x8b":
        return data
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as stream:
            out = read_at_most(stream, limit + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise ConfigError(field, "must be a complete gzip JSON-lines memplan trace", _shown(name), hint=str(exc)) from None
    if len(out) > limit:
        raise ConfigError(field, f"inflates to more than {limit:,} bytes (memplan's limit {limit_name})", _shown(name))
    return out


def read_at_most(stream: Any, size: int) -> bytes:
    """At most ``size`` bytes of ``stream``, read 1 MiB at a time (``read(size)`` would allocate ``size`` bytes
    up front, a few GiB for a large limit, even when the file is small). When all ``size`` bytes came (the caller's
    limit plus one: a refusal) they are returned as the buffer itself, not copied."""
    buffer = bytearray()
    while len(buffer) < size:
        chunk = stream.read(min(size - len(buffer), 1 << 20))
        if not chunk:
            return bytes(buffer)
        buffer += chunk
    return buffer  # type: ignore[return-value]  # too long: only its length is read


def _shown(name: str) -> str:
    """A path as messages show it: at most 120 characters (the middle elided)."""
    return name if len(name) <= 120 else f"{name[:60]}...{name[-57:]}"


def read_capped(path: str | os.PathLike[str], *, field: str, limit: int = MAX_INPUT_BYTES,
                limit_name: str = "MAX_INPUT_BYTES", error: type[ConfigError] = ConfigError) -> bytes:
    """At most ``limit`` bytes of ``path``; ``error(field, ...)`` when it is missing, a directory,
    unreadable, longer than the limit (the read stops at ``limit + 1`` bytes: ``/dev/zero`` is refused at
    the cap) or its name is longer than MAX_NAME_CHARS."""
    name = os.fspath(path)
    if len(name) > MAX_NAME_CHARS:
        raise error(field, f"is a path of {len(name):,} characters; at most {MAX_NAME_CHARS} (memplan's limit "
                    "MAX_NAME_CHARS)", _shown(name))
    file = Path(name)
    try:
        if file.is_dir():
            raise error(field, "is a directory, not a file", name)
        with open(file, "rb") as handle:
            head = handle.read(_SNIFF_BYTES)
            _refuse_binary(head, field, name, error)
            data = head + read_at_most(handle, limit + 1 - len(head)) if len(head) == _SNIFF_BYTES else head
    except FileNotFoundError:
        raise error(field, "no such file", _shown(name)) from None
    except OSError as exc:
        raise error(field, f"cannot read the file ({exc.strerror or exc})", _shown(name)) from None
    if len(data) > limit:
        raise error(field, f"is larger than {limit:,} bytes (memplan's limit {limit_name})", _shown(name))
    return data


def _refuse_binary(head: bytes, field: str, name: str, error: type[ConfigError]) -> None:
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            raise error(field, f"is a {kind} file, not text", _shown(name),
                        hint="decompress it first" if kind.endswith("compressed") else "")
    if b"\x00" in head:
        raise error(field, "is a binary file, not text", _shown(name))


def read_text_file(path: str | os.PathLike[str], *, field: str, allow_empty: bool = False,
                   error: type[ConfigError] = ConfigError) -> str:
    """The UTF-8 text of ``path`` (a BOM is dropped).

    Raises ``error(field, rule, path)`` (a ConfigError subclass) when the path is missing or a directory, cannot be
    read, is larger than MAX_INPUT_BYTES (16 MiB), is binary (compressed, pickle, NUL bytes), is not UTF-8, or
    holds only whitespace (unless ``allow_empty``).
    """
    name = os.fspath(path)
    data = read_capped(name, field=field, error=error)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(field, f"is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})",
                          name) from None
    if not allow_empty and not text.strip():
        raise error(field, "is empty", name)
    return text


def write_atomic(path: str | os.PathLike[str], content: str | bytes | Callable[[Path], None], *,
                 suffix: str = ".partial", mode: int = 0o644) -> None:
    """Write ``path`` whole or not at all: into a temporary file in the same folder, then renamed over it.

    ``content``: text (UTF-8), bytes, or a function writing the temporary file it is given (``suffix``
    names that file's type for writers that go by it, e.g. ``savefig``). A failure leaves ``path`` as it
    was and no temporary file behind; the error propagates.
    """
    target = Path(path)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(handle)
    partial = Path(name)
    try:
        if callable(content):
            content(partial)
        else:
            partial.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        os.chmod(partial, mode)
        os.replace(partial, target)
    finally:
        if partial.exists():
            partial.unlink()
