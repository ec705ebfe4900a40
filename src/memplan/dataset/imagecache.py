"""The image-token cache of ``--images-field``: per-row counts kept until the data or an image changes.

An entry (``$MEMPLAN_CACHE/images/<key>.npz``) is keyed by the sha256 of the dataset's bytes, the image
rule and the fields, and holds each row's image tokens with the image files read and their
``(st_size, st_mtime_ns)``. A later run uses it only when every file still has those stats (a ``stat``
per file: no dataset opened, no image header read); otherwise the counts are computed again.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["cache_key", "load_counts", "save_counts"]

_VERSION = "1"


def cache_key(*parts: str) -> Path:
    """The entry's file for these key parts."""
    from memplan.dataset.lengths import cache_dir

    digest = hashlib.sha256("\0".join((_VERSION, *parts)).encode()).hexdigest()
    return cache_dir() / "images" / f"{digest}.npz"


def _stats(files: list[str]) -> np.ndarray | None:
    out = np.empty((len(files), 2), dtype=np.int64)
    for i, name in enumerate(files):
        try:
            info = os.stat(name)
        except OSError:
            return None
        out[i] = (info.st_size, info.st_mtime_ns)
    return out


def load_counts(entry: Path) -> Any:
    """The cached counts (numpy int64), or None when absent, damaged or an image changed."""
    if not entry.is_file():
        return None
    try:
        with np.load(entry, allow_pickle=False) as saved:
            tokens, files, stats = saved["tokens"], [str(f) for f in saved["files"]], saved["stats"]
    except (OSError, ValueError, KeyError):
        return None
    now = _stats(files)
    return tokens if now is not None and np.array_equal(now, stats) else None


def save_counts(entry: Path, tokens: Any, files: list[Path]) -> None:
    """Write the entry atomically (an unwritable cache only costs the next run its speed)."""
    names = [str(f) for f in files]
    stats = _stats(names)
    if stats is None:
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=entry.parent, suffix=".partial")
        with os.fdopen(handle, "wb") as out:
            np.savez(out, tokens=tokens, files=np.asarray(names, dtype=str), stats=stats)
        os.replace(partial, entry)
    except OSError:
        return
