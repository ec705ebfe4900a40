"""Read a user's input file as text, or fail with one :class:`~memplan.errors.ConfigError` line.

Every text dialect memplan reads (job files, Megatron arguments, DeepSpeed JSON, ``config.json``)
goes through :func:`read_text_file`, so a wrong path gets the same clear answer everywhere: the flag,
the rule and the path, e.g. ``--deepspeed-config: is a gzip-compressed file, not text; decompress it
first (got 'ds.json.gz')`` — never a ``UnicodeDecodeError`` traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

from memplan.errors import ConfigError

__all__ = ["read_binary_file", "read_text_file"]

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


def read_binary_file(path: str | os.PathLike[str], *, field: str) -> bytes:
    """The bytes of ``path`` (a snapshot pickle, a trace); ``ConfigError(field, "must be a readable
    file", path)`` when it cannot be read."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise ConfigError(field, "must be a readable file", name, hint=exc.strerror or "") from None


def read_text_file(path: str | os.PathLike[str], *, field: str, allow_empty: bool = False,
                   error: type[ConfigError] = ConfigError) -> str:
    """The UTF-8 text of ``path`` (a BOM is dropped).

    Raises ``error(field, rule, path)`` (a ConfigError subclass) when the path is missing or a directory, cannot be
    read, is binary (compressed, pickle, NUL bytes), is not UTF-8, or holds only whitespace (unless
    ``allow_empty``).
    """
    name = os.fspath(path)
    file = Path(name)
    if file.is_dir():
        raise error(field, "is a directory, not a file", name)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise error(field, "no such file", name) from None
    except OSError as exc:
        raise error(field, f"cannot read the file ({exc.strerror or exc})", name) from None
    for magic, kind in _MAGIC.items():
        if data.startswith(magic):
            raise error(field, f"is a {kind} file, not text", name,
                              hint="decompress it first" if kind.endswith("compressed") else "")
    if b"\x00" in data[:_SNIFF_BYTES]:
        raise error(field, "is a binary file, not text", name)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(field, f"is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})",
                          name) from None
    if not allow_empty and not text.strip():
        raise error(field, "is empty", name)
    return text
