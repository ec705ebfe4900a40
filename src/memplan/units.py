"""Byte units, dtype sizes and byte-string parsing.

Bytes are integers everywhere inside memplan; these helpers exist for presentation and
for reading sizes users type. ``GiB`` is 2**30 bytes, ``GB`` is 10**9 bytes: they are
never mixed.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from memplan.errors import ConfigError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12

Dtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "fp64"]
DTYPES: tuple[str, ...] = get_args(Dtype)

#: Bytes per element of each dtype memplan knows. The one table every module uses.
DTYPE_BYTES: dict[str, int] = {
    "fp64": 8,
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
}

_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float64": "fp64",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "e4m3": "fp8",
    "hybrid": "fp8",
}

_UNITS = {
    "": 1,
    "b": 1,
    "kb": KB,
    "mb": MB,
    "gb": GB,
    "tb": TB,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "k": KiB,
    "m": MiB,
    "g": GiB,
    "t": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (``fp32``, ``bf16``, ``fp16``, ``fp8``, ``int8``, ``fp64``)."""
    size = DTYPE_BYTES.get(dtype)  # a short name already (the estimator's hot path)
    return size if size is not None else DTYPE_BYTES[normalize_dtype(dtype)]


def normalize_dtype(dtype: str, *, field: str = "dtype") -> str:
    """Map ``bfloat16``/``float32``/... to memplan's short names; reject unknown names."""
    key = str(dtype).strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ConfigError(field, f"must be one of {', '.join(DTYPES)}", dtype)
    return key


def parse_bytes(text: str | int | float, *, field: str = "size") -> int:
    """Parse ``"80GiB"``, ``"6 GB"``, ``"512MiB"`` or a plain number of bytes into an int.

    Bare ``G``/``M``/``K`` suffixes are binary (GiB/MiB/KiB), as PyTorch and ``nvidia-smi`` use them.
    """
    if isinstance(text, bool):
        raise ConfigError(field, "must be a size such as 80GiB or a number of bytes", text)
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise ConfigError(field, "must be a size such as 80GiB, 6GB or a number of bytes", text)
        value, unit = float(match.group(1)), match.group(2).lower()
        if unit not in _UNITS:
            raise ConfigError(field, "unit must be one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB", text)
    if value < 0:
        raise ConfigError(field, "must not be negative", text)
    if not value * _UNITS[unit] < 2**64:  # also inf and nan: a size no memory has
        raise ConfigError(field, "must be below 2^64 bytes", text if len(str(text)) < 40 else f"{str(text)[:20]}...")
    return int(round(value * _UNITS[unit]))


def gib(n_bytes: int | float) -> float:
    """Bytes as GiB (2**30), for display."""
    return n_bytes / GiB


def format_bytes(n_bytes: int | float, *, precision: int = 2) -> str:
    """Human-readable binary size: ``1.50 GiB``, ``512.00 MiB``."""
    value = float(n_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= size:
            return f"{sign}{value / size:.{precision}f} {unit}"
    return f"{sign}{int(value)} B"


_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key that orders the numbers inside names by value: ``h.2`` before ``h.10``, ``layers.9`` before
    ``layers.10`` (each part is ``(0, number)`` or ``(1, text)``, so parts of either kind compare)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(text) if part)
