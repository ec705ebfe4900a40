"""Axolotl's sample packing (``sample_packing: true``), on token lengths: every step's packed row.

Read from Axolotl's source (``axolotl/utils/samplers/multipack.py``, ``MultipackBatchSampler`` with its
``pack_parallel``/``pack_group``; ``AxolotlTrainer._create_multipack_sampler`` and ``_get_train_sampler``;
the collator settings of ``HFCausalTrainerBuilder``; the config validator ``hint_sample_packing_padding``):

* Examples longer than ``sequence_len`` (and shorter than ``min_sample_len``, 2) are dropped while the
  dataset is prepared (``excess_length_strategy: drop``, the default).
* The base sampler is a ``RandomSampler``; with ``multipack_real_batches: false`` (the default) the
  batch sampler makes bins of capacity ``micro_batch_size × sequence_len`` tokens and one bin per step
  (``batch_size=1``); ``drop_last=True`` never drops with one bin per batch.
* Bins are filled **first-fit in the sampler's order** (``pack_group``: no sorting despite its
  "first-fit decreasing" docstring): each example goes into the first open bin with room for it and
  fewer than ``sample_packing_bin_size`` (200) examples, else opens a bin; the sampled indices are
  packed in groups of ``sample_packing_group_size`` (100,000), each group's bins listed in order.
* The collator (``V2BatchSamplerDataCollatorForSeq2Seq``) concatenates a bin into one row and pads it to
  a multiple of ``64 × ceil(sequence_len / 64)`` (``pad_to_sequence_len``, which the validator sets to
  true with ``sample_packing``), or of 64 when ``pad_to_sequence_len: false`` was given on older
  versions. Shape ``(1, padded tokens)``, priced as a packed row (attention per document).

The permutation: Axolotl's ``RandomSampler`` has no generator of its own; it seeds one from torch's
*global* RNG when iterated, after model initialisation and the sampler's own ``len()`` passes have drawn
from it, so no seed alone replays it. memplan packs ``torch.randperm`` seeded ``seed + epoch`` instead:
the shapes are Axolotl's for *a* shuffled order (every packed row is at most the bin capacity, so the
worst step is bounded), not step-for-step those of a given run. Fed that order, Axolotl 0.19.0's own
``MultipackBatchSampler`` makes the same bins (tests/dataset/test_axolotl_sampler.py).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BIN_SIZE", "GROUP_SIZE", "MIN_SAMPLE_LEN", "first_fit_bins", "pad_multiple"]

#: ``min_sample_len``: shorter examples are dropped with the long ones.
MIN_SAMPLE_LEN = 2
#: ``sample_packing_bin_size``: at most this many examples per bin.
BIN_SIZE = 200
#: ``sample_packing_group_size``: the sampled indices are packed in groups of this many.
GROUP_SIZE = 100_000
#: Axolotl's collator rounds to multiples of this (``multiple = 64``).
MULTIPLE = 64


def pad_multiple(sequence_len: int) -> int:
    """The collator's ``pad_to_multiple_of`` with ``pad_to_sequence_len: true``."""
    return MULTIPLE * -(-sequence_len // MULTIPLE)


def first_fit_bins(lengths: np.ndarray, capacity: int, *, bin_size: int = BIN_SIZE,
                   group_size: int = GROUP_SIZE) -> np.ndarray:
    """Tokens per bin of ``pack_group`` over ``lengths`` (in the sampler's order), group by group.

    First fit in O(n log n): a max-tree over the bins' usable room (a full bin's room counts as -1)."""
    out: list[np.ndarray] = []
    for start in range(0, len(lengths), group_size):
        out.append(_group(lengths[start:start + group_size].tolist(), capacity, bin_size))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _group(lengths: list[int], capacity: int, bin_size: int) -> np.ndarray:
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    tree = [-1] * (2 * size)  # leaves: room of bin i (-1: not open, or holding bin_size examples)
    filled: list[int] = []
    counts: list[int] = []
    for length in lengths:
        index = _first_with_room(tree, size, length) if tree[1] >= length else -1
        if index < 0:
            index = len(filled)
            filled.append(0)
            counts.append(0)
        filled[index] += length
        counts[index] += 1
        room = capacity - filled[index] if counts[index] < bin_size else -1
        _set(tree, size, index, room)
    return np.asarray(filled, dtype=np.int64)


def _first_with_room(tree: list[int], size: int, length: int) -> int:
    node = 1
    while node < size:
        node = 2 * node if tree[2 * node] >= length else 2 * node + 1
    return node - size


def _set(tree: list[int], size: int, index: int, room: int) -> None:
    node = index + size
    tree[node] = room
    node //= 2
    while node:
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
        node //= 2
