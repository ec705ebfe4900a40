"""Allocator settings: what ``PYTORCH_CUDA_ALLOC_CONF`` and a snapshot's ``allocator_settings`` say.

Example::

    >>> s = AllocatorSettings.parse("max_split_size_mb:128,expandable_segments:True")
    >>> s.max_split_size, s.expandable_segments
    (134217728, True)

The rules follow ``c10/cuda/CUDAAllocatorConfig.cpp``: ``max_split_size_mb`` must be greater than
20; ``garbage_collection_threshold`` lies strictly between 0 and 1; ``roundup_power2_divisions`` is
either one power of two for every size or a list ``[256:1,512:2,>:4]`` keyed by the MiB size at
which each power-of-two interval starts. Options memplan does not simulate (``backend``,
``release_lock_on_cudamalloc``, pinned-memory options) are accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from memplan.alloc.constants import (
    MAX_SPLIT_SIZE_MIN_MB,
    NO_MAX_SPLIT,
    ROUNDUP_INTERVAL_START_LOG2,
    ROUNDUP_INTERVALS,
)
from memplan.errors import ConfigError
from memplan.units import MiB

__all__ = ["AllocatorSettings"]

_IGNORED_KEYS = frozenset({
    "backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
    "pinned_num_register_threads", "pinned_use_background_threads", "graph_capture_record_stream_reuse",
})


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True, kw_only=True)
class AllocatorSettings:
    """The allocator options the simulator honours.

    ``capacity`` is the device memory the allocator may use (``None``: unlimited, no OOM); it plays
    the part of ``cudaMemGetInfo``'s total (or ``set_per_process_memory_fraction``'s maximum).
    """

    #: Blocks of at least this many bytes are never split (``max_split_size_mb`` x 1 MiB).
    max_split_size: int = NO_MAX_SPLIT
    #: Divisions per power-of-two interval of request size (0 or 1: plain 512-byte rounding).
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * ROUNDUP_INTERVALS)
    #: Fraction of ``capacity`` above which cached blocks are reclaimed before a new segment.
    garbage_collection_threshold: float = 0.0
    #: Grow one segment per stream and pool by mapping pages instead of cudaMalloc'ing segments.
    expandable_segments: bool = False
    #: Device bytes available to the allocator; ``None`` means unlimited.
    capacity: int | None = None

    def __post_init__(self) -> None:
        if self.max_split_size != NO_MAX_SPLIT and self.max_split_size <= MAX_SPLIT_SIZE_MIN_MB * MiB:
            raise ConfigError("max_split_size_mb", f"must be greater than {MAX_SPLIT_SIZE_MIN_MB}",
                              self.max_split_size // MiB)
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise ConfigError("roundup_power2_divisions", f"must have {ROUNDUP_INTERVALS} entries",
                              self.roundup_power2_divisions)
        for value in self.roundup_power2_divisions:
            if value != 0 and not _is_pow2(value):
                raise ConfigError("roundup_power2_divisions", "each value must be 0 or a power of two", value)
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise ConfigError("garbage_collection_threshold", "must be in (0.0, 1.0)",
                              self.garbage_collection_threshold)
        if self.capacity is not None and self.capacity <= 0:
            raise ConfigError("capacity", "must be a positive number of bytes", self.capacity)

    # ------------------------------------------------------------------------------------------

    def with_changes(self, **changes: Any) -> AllocatorSettings:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_split_size": None if self.max_split_size == NO_MAX_SPLIT else self.max_split_size,
            "roundup_power2_divisions": list(self.roundup_power2_divisions),
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "capacity": self.capacity,
        }

    @classmethod
    def parse(cls, text: str, *, capacity: int | None = None) -> AllocatorSettings:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string; a bad option raises ConfigError naming it."""
        values: dict[str, Any] = {"capacity": capacity}
        for item in _split_options(text):
            key, sep, raw = item.partition(":")
            key, raw = key.strip(), raw.strip()
            if not sep or not raw:
                raise ConfigError("PYTORCH_CUDA_ALLOC_CONF", "options must look like key:value", item)
            if key == "max_split_size_mb":
                mb = _int(key, raw)
                if mb <= MAX_SPLIT_SIZE_MIN_MB:
                    raise ConfigError(key, f"must be greater than {MAX_SPLIT_SIZE_MIN_MB}", mb)
                values["max_split_size"] = mb * MiB
            elif key == "garbage_collection_threshold":
                try:
                    threshold = float(raw)
                except ValueError:
                    raise ConfigError(key, "must be a number in (0.0, 1.0)", raw) from None
                if not 0.0 < threshold < 1.0:
                    raise ConfigError(key, "must be in (0.0, 1.0)", threshold)
                values[key] = threshold
            elif key == "expandable_segments":
                if raw not in ("True", "False", "true", "false", "1", "0"):
                    raise ConfigError(key, "must be True or False", raw)
                values[key] = raw in ("True", "true", "1")
            elif key == "roundup_power2_divisions":
                values[key] = _parse_divisions(raw)
            elif key not in _IGNORED_KEYS:
                raise ConfigError("PYTORCH_CUDA_ALLOC_CONF", "unknown option", key,
                                  hint="known: max_split_size_mb, roundup_power2_divisions, "
                                  "garbage_collection_threshold, expandable_segments")
        return cls(**values)

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any], *, capacity: int | None = None) -> AllocatorSettings:
        """Settings recorded in a snapshot's ``allocator_settings`` dict (torch >= 2.5)."""
        if not isinstance(data, Mapping):
            raise ConfigError("snapshot allocator_settings", "must be a dict", type(data).__name__)
        split = data.get("max_split_size", -1)
        max_split = NO_MAX_SPLIT if not isinstance(split, int) or split < 0 or split >= NO_MAX_SPLIT else split
        divisions = [0] * ROUNDUP_INTERVALS
        raw_div = data.get("roundup_power2_divisions", {})
        if isinstance(raw_div, Mapping):
            for key, value in raw_div.items():
                index = int(key).bit_length() - 1
                if 0 <= index < ROUNDUP_INTERVALS and isinstance(value, int):
                    divisions[index] = value
        elif isinstance(raw_div, (int, list, tuple)):
            seq = [raw_div] * ROUNDUP_INTERVALS if isinstance(raw_div, int) else list(raw_div)
            divisions = [int(v) for v in seq[:ROUNDUP_INTERVALS]] + [0] * (ROUNDUP_INTERVALS - len(seq))
        threshold = float(data.get("garbage_collection_threshold", 0.0) or 0.0)
        return cls(max_split_size=max_split, roundup_power2_divisions=tuple(divisions),
                   garbage_collection_threshold=threshold,
                   expandable_segments=bool(data.get("expandable_segments", False)), capacity=capacity)

    def divisions_for(self, size: int) -> int:
        """``CUDAAllocatorConfig::roundup_power2_divisions(size)``: the divisions of size's interval."""
        index = size.bit_length() - 1 - ROUNDUP_INTERVAL_START_LOG2
        index = min(max(index, 0), ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]


def _split_options(text: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    items, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    return [i.strip() for i in items if i.strip()]


def _int(key: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(key, "must be an integer", raw) from None


def _parse_divisions(raw: str) -> tuple[int, ...]:
    key = "roundup_power2_divisions"
    if not raw.startswith("["):
        value = _int(key, raw)
        if value != 0 and not _is_pow2(value):
            raise ConfigError(key, "must be 0 or a power of two", value)
        return (value,) * ROUNDUP_INTERVALS
    if not raw.endswith("]"):
        raise ConfigError(key, "a list must be written [size_mb:divisions,...,>:divisions]", raw)
    divisions = [0] * ROUNDUP_INTERVALS
    last_index, first = 0, True
    for pair in raw[1:-1].split(","):
        size_text, sep, value_text = pair.partition(":")
        value = _int(key, value_text.strip())
        if not sep or (value != 0 and not _is_pow2(value)):
            raise ConfigError(key, "each entry must be size_mb:divisions with divisions 0 or a power of two", pair)
        if size_text.strip() == ">":
            for i in range(last_index + 1, ROUNDUP_INTERVALS):
                divisions[i] = value
            continue
        size_mb = _int(key, size_text.strip())
        if not _is_pow2(size_mb):
            raise ConfigError(key, "interval sizes must be powers of two (MiB)", size_mb)
        index = min(size_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            for i in range(index):
                divisions[i] = value
            first = False
        divisions[index] = value
        last_index = index
    return tuple(divisions)
