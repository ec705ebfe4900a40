"""Open a training dataset with the ``datasets`` library, as the trainers do, and hash its content.

Formats: JSON/JSONL (``.json``, ``.jsonl``), Parquet, CSV, Arrow (``.arrow``), a folder written by
``Dataset.save_to_disk`` (a ``DatasetDict`` folder gives its ``train`` split), and a Hub dataset id
already in the local ``datasets`` cache (offline: memplan never downloads). Every failure is one
:class:`~memplan.errors.ConfigError` naming the file (and the row, where one is at fault).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError

__all__ = ["content_digest", "open_dataset"]

FLAG = "--dataset"
#: File suffix -> the ``datasets`` packaged builder that reads it.
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_CHUNK = 1 << 22


def content_digest(path: str) -> str:
    """sha256 of the file's bytes (of every file, by relative name, for a folder): the cache key's data half."""
    root = Path(path).expanduser()
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    if not root.exists():
        digest.update(b"hub\0" + path.encode())
        return digest.hexdigest()
    for file in files:
        digest.update(str(file.relative_to(root) if root.is_dir() else file.name).encode() + b"\0")
        with file.open("rb") as handle:
            while block := handle.read(_CHUNK):
                digest.update(block)
    return digest.hexdigest()


def open_dataset(path: str) -> Any:
    """The ``datasets.Dataset`` at ``path`` (see the module docstring for the formats)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    root = Path(path).expanduser()
    if root.is_dir():
        loaded = _load_folder(root)
    elif root.is_file():
        loaded = _load_file(root)
    else:
        loaded = _load_hub(path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(FLAG, f"{path}: has no 'train' split (splits: {', '.join(loaded)})")
        loaded = loaded["train"]
    if len(loaded) == 0:
        raise ConfigError(FLAG, f"{path}: has no rows")
    return loaded


def _load_folder(root: Path) -> Any:
    import datasets

    if not ((root / "state.json").is_file() or (root / "dataset_dict.json").is_file()):
        raise ConfigError(FLAG, f"{root}: a folder must be one written by Dataset.save_to_disk (no state.json or "
                          "dataset_dict.json inside)")
    try:
        return datasets.load_from_disk(str(root))
    except Exception as exc:  # datasets raises many kinds; each is bad input here
        raise ConfigError(FLAG, f"{root}: not a readable save_to_disk folder ({_first_line(exc)})") from None


def _load_file(root: Path) -> Any:
    import datasets

    builder = BUILDERS.get(root.suffix.lower())
    if builder is None:
        raise ConfigError(FLAG, f"{root}: the file type must be one of {', '.join(sorted(BUILDERS))}")
    if root.stat().st_size == 0:
        raise ConfigError(FLAG, f"{root}: the file is empty")
    try:
        return datasets.load_dataset(builder, data_files=str(root), split="train", keep_in_memory=True)
    except Exception as exc:  # pyarrow/datasets errors on a malformed file
        if builder == "json":
            _check_json_lines(root)
        raise ConfigError(FLAG, f"{root}: not a readable {builder} file ({_first_line(exc)})") from None


def _check_json_lines(root: Path) -> None:
    """Name the first malformed row of a JSON Lines file (``datasets`` only says the file failed)."""
    with root.open("rb") as handle:
        head = handle.read(1).lstrip()
    if head == b"[":
        return  # one JSON document; datasets reports it as a whole
    with root.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ConfigError(FLAG, f"{root}: row {number}: not valid JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ConfigError(FLAG, f"{root}: row {number}: must be a JSON object", type(row).__name__)


def _load_hub(ref: str) -> Any:
    import datasets

    from memplan.model.hub import looks_like_hub_id

    if not looks_like_hub_id(ref):
        raise ConfigError(FLAG, "must be a dataset file, a save_to_disk folder or a cached Hub dataset id", ref)
    previous = os.environ.get("HF_DATASETS_OFFLINE")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        return datasets.load_dataset(ref, split="train")
    except Exception as exc:
        raise ConfigError(FLAG, f"{ref}: not a file here and not in the local datasets cache "
                          f"({_first_line(exc)})") from None
    finally:
        if previous is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = previous


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
