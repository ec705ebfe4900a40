"""Packing rules of TRL and torchtune, on token lengths only (what each packed row holds, in order).

:func:`bfd_rows` follows ``trl.data_utils._pack_bfd`` (``on_seq_length_overflow="truncate"``): empty
sequences dropped, lengths sorted in decreasing order (a stable sort, as Arrow's), each placed in the
open bin with the least room that still fits it (a new bin when none does; among equal rooms the
oldest bin first), rows listed in the order their bins were opened. :func:`wrapped_rows` follows
``_pack_wrapped``: the block's tokens concatenated and cut every ``seq_length``. :func:`greedy_packs`
follows torchtune's ``PackedDataset`` with ``split_across_pack=False``.
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

__all__ = ["bfd_rows", "greedy_packs", "wrapped_rows"]


def bfd_rows(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """Tokens per packed row (best-fit decreasing) of one ``Dataset.map`` block."""
    lengths = np.minimum(lengths[lengths > 0], seq_length)
    ordered = lengths[np.argsort(-lengths, kind="stable")]
    rooms: list[int] = []  # distinct free rooms (< seq_length) with an open bin, ascending
    bins_by_room: dict[int, deque[int]] = {}
    filled: list[int] = []
    for length in ordered.tolist():
        at = bisect.bisect_left(rooms, length)
        if at < len(rooms):
            room = rooms[at]
            queue = bins_by_room[room]
            index = queue.popleft()
            if not queue:
                del rooms[at]
        else:
            room, index = seq_length, len(filled)
            filled.append(0)
        filled[index] += length
        left = room - length
        if left > 0:
            queue = bins_by_room.setdefault(left, deque())
            if not queue:
                bisect.insort(rooms, left)
            queue.append(index)
    return np.asarray(filled, dtype=np.int64)


def wrapped_rows(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """Tokens per row when the block's tokens are concatenated and cut every ``seq_length``."""
    total = int(lengths.sum())
    full, rest = divmod(total, seq_length)
    return np.asarray([seq_length] * full + ([rest] if rest else []), dtype=np.int64)


def greedy_packs(lengths: np.ndarray, max_seq_len: int) -> np.ndarray:
    """Real tokens per pack of torchtune's ``PackedDataset`` (each pack is then padded to ``max_seq_len``)."""
    packs: list[int] = []
    current = 0
    for length in lengths.tolist():
        if current + length > max_seq_len:
            packs.append(current)
            current = 0
        current += length
    if current:
        packs.append(current)
    return np.asarray(packs, dtype=np.int64)
