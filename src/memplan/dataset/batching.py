"""Every micro-batch's token shape, batched as each trainer batches (read from their code).

Rules (``--batching``):

``hf``
    transformers ``Trainer``: examples truncated to ``max_length`` by the tokenizer; the order is
    accelerate's ``SeedableRandomSampler`` (``torch.randperm`` with a generator seeded
    ``data_seed or seed`` plus the epoch; Trainer's default ``use_seedable_sampler=True``), or
    ``LengthGroupedSampler`` with ``group_by_length`` (``get_length_grouped_indices`` on the global RNG
    ``set_seed(seed)`` leaves), or the dataset order (``train_sampling_strategy="sequential"``); batches of
    ``per_device_train_batch_size``, the last dropped with ``dataloader_drop_last``; the collator pads to
    the longest example of the batch (``pad_to_multiple_of`` rounds it up). Shape ``(rows, longest)``.
``trl``
    TRL ``SFTTrainer`` without packing: truncation to ``max_length`` (SFTConfig's default 1024) at
    preparation, ``shuffle_dataset`` (``Dataset.shuffle(seed)``), then the Trainer's sampler and TRL's
    collator, which pads to the longest. Shape ``(rows, longest)``.
``trl-padding-free``
    As ``trl``, with ``padding_free=True``: the batch flattened into one row of all its tokens.
    Shape ``(1, tokens)``, priced as a packed row (``--packing``).
``trl-packing``
    ``packing=True``: ``pack_dataset`` with ``packing_strategy`` ``bfd`` (best-fit decreasing, sequences
    truncated to ``max_length``, in ``Dataset.map`` blocks of 1,000 rows) or ``wrapped`` (the block's
    tokens cut every ``max_length``); ``bfd`` implies padding-free batches of ``(1, tokens)``.
``torchtune``
    torchtune recipes without packing: ``DistributedSampler`` (``shuffle=True``, seed 0 plus the epoch),
    ``drop_last=True``, ``padded_collate_sft`` pads to the longest. Shape ``(rows, longest)``.
``torchtune-packing``
    ``PackedDataset``: examples taken in order and packed greedily into ``max_seq_len`` (a sample that
    does not fit starts the next pack; ``split_across_pack=False``), every pack padded to
    ``max_seq_len``. Shape ``(rows, max_seq_len)``, priced as packed rows.
``axolotl``
    Axolotl's ``sample_packing`` (:mod:`memplan.dataset.multipack`): examples over ``sequence_len``
    (``--max-length``) dropped, first-fit bins of ``micro_batch_size × sequence_len`` tokens, one bin per
    step concatenated into a row padded to a multiple of ``sequence_len`` rounded up to 64 (or
    ``--pad-to-multiple-of``). Shape ``(1, padded tokens)``, priced as a packed row. The order is a
    stand-in (see that module).

The permutations are ``torch.randperm``'s, reproduced with numpy (:mod:`memplan.dataset.rng`):
batching never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from memplan.dataset.rng import torch_randperm
from memplan.dataset.rules import RULES, Rule
from memplan.errors import ConfigError

__all__ = ["RULES", "Batching", "StepShapes", "plan_steps"]

#: ``datasets.Dataset.map``'s default ``batch_size``: TRL packs each block of this many rows apart.
MAP_BLOCK = 1000
#: SFTConfig's default ``max_length``.
TRL_MAX_LENGTH = 1024


@dataclass(frozen=True, kw_only=True)
class Batching:
    """A trainer's batching settings (the names are the trainers' own)."""

    rule: Rule = "hf"
    #: ``per_device_train_batch_size`` / torchtune's ``batch_size``.
    micro_batch_size: int = 8
    #: Truncation length (HF tokenizer ``max_length``, SFTConfig ``max_length``, torchtune ``max_seq_len``).
    max_length: int | None = None
    seed: int = 42
    data_seed: int | None = None
    drop_last: bool = False
    group_by_length: bool = False
    sequential: bool = False
    pad_to_multiple_of: int | None = None
    packing_strategy: Literal["bfd", "wrapped"] = "bfd"
    #: SFTConfig ``shuffle_dataset``.
    shuffle_dataset: bool = False
    epochs: int = 1
    gradient_accumulation_steps: int = 1

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ConfigError("--batching", f"must be one of {', '.join(RULES)}", self.rule)
        for flag, value in (("--mbs", self.micro_batch_size), ("--epochs", self.epochs),
                            ("--gradient-accumulation", self.gradient_accumulation_steps)):
            if value < 1:
                raise ConfigError(flag, "must be at least 1", value)
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError("--max-length", "must be at least 1", self.max_length)
        if self.rule in ("trl-packing", "torchtune-packing", "axolotl") and self.effective_max_length is None:
            raise ConfigError("--max-length", f"--batching {self.rule} packs rows of --max-length tokens; give it")

    @property
    def effective_max_length(self) -> int | None:
        if self.max_length is None and self.rule in ("trl", "trl-packing"):  # padding-free refuses max_length
            return TRL_MAX_LENGTH
        return self.max_length

    @property
    def packed(self) -> bool:
        """Whether a step is priced as packed rows (attention per document)."""
        return self.rule in ("trl-padding-free", "torchtune-packing", "axolotl") or (
            self.rule == "trl-packing" and self.packing_strategy == "bfd")


@dataclass(frozen=True)
class StepShapes:
    """One entry per micro-batch, in training order: rows, tokens per row (padded) and real tokens."""

    batch_size: np.ndarray
    seq_length: np.ndarray
    tokens: np.ndarray
    packed: bool

    def __len__(self) -> int:
        return len(self.batch_size)


def plan_steps(lengths: np.ndarray, batching: Batching) -> StepShapes:
    """The micro-batch shapes of one run over ``lengths`` (token counts per example) for ``epochs`` epochs."""
    lengths = np.asarray(lengths, dtype=np.int64)
    limit = batching.effective_max_length
    if batching.rule == "torchtune-packing":
        assert limit is not None
        return _torchtune_packed(lengths, batching, limit)
    if batching.rule == "axolotl":
        assert limit is not None
        return _axolotl_packed(lengths, batching, limit)
    if limit is not None and batching.rule != "trl-packing":  # packing cuts rows itself (wrapped: no truncation)
        lengths = np.minimum(lengths, limit)
    if batching.rule == "trl-packing":
        assert limit is not None
        lengths = _trl_pack(_trl_order(lengths, batching), batching, limit)
    elif batching.rule.startswith("trl"):
        lengths = _trl_order(lengths, batching)
    parts = [_batches(lengths, _order(lengths, batching, epoch), batching) for epoch in range(batching.epochs)]
    return StepShapes(*(np.concatenate([p[i] for p in parts]) for i in range(3)), packed=batching.packed)


def _trl_order(lengths: np.ndarray, batching: Batching) -> np.ndarray:
    """SFTTrainer's ``dataset.shuffle(seed=args.seed)`` when ``shuffle_dataset`` (numpy's default_rng)."""
    if not batching.shuffle_dataset:
        return lengths
    return lengths[np.random.default_rng(batching.seed).permutation(len(lengths))]


def _trl_pack(lengths: np.ndarray, batching: Batching, limit: int) -> np.ndarray:
    from memplan.dataset.packing import bfd_rows, wrapped_rows

    pack = bfd_rows if batching.packing_strategy == "bfd" else wrapped_rows
    blocks = [pack(lengths[i:i + MAP_BLOCK], limit) for i in range(0, len(lengths), MAP_BLOCK)]
    rows = np.concatenate(blocks) if blocks else lengths[:0]
    return _trl_order(rows, batching)  # SFTTrainer shuffles again after packing


def _order(lengths: np.ndarray, batching: Batching, epoch: int) -> np.ndarray:
    """The sampler's index order for ``epoch``."""
    n = len(lengths)
    if batching.sequential:
        return np.arange(n)
    if batching.rule.startswith("torchtune"):
        return torch_randperm(n, 0 + epoch)  # DistributedSampler(seed=0).set_epoch(epoch)
    if batching.group_by_length:
        return _length_grouped(lengths, batching)
    seed = batching.data_seed if batching.data_seed is not None else batching.seed
    return torch_randperm(n, seed + epoch)


def _length_grouped(lengths: np.ndarray, batching: Batching) -> np.ndarray:
    """transformers' ``get_length_grouped_indices`` on the global RNG after ``set_seed(seed)`` (first epoch).

    The DataLoader iterator draws its base seed (``random_()`` on an int64: two 32-bit outputs) first."""
    group = batching.micro_batch_size * batching.gradient_accumulation_steps
    mult = max(1, min(len(lengths) // (group * 4), 50))
    indices = torch_randperm(len(lengths), batching.seed, skip=2)
    size = mult * group
    megabatches = [indices[i:i + size] for i in range(0, len(lengths), size)]
    megabatches = [m[np.argsort(-lengths[m], kind="stable")] for m in megabatches]
    first = int(np.argmax([lengths[m[0]] for m in megabatches]))
    megabatches[0][0], megabatches[first][0] = megabatches[first][0], megabatches[0][0]
    return np.concatenate(megabatches)


def _batches(lengths: np.ndarray, order: np.ndarray, batching: Batching) -> tuple[np.ndarray, ...]:
    mbs = batching.micro_batch_size
    drop_last = batching.drop_last or batching.rule.startswith("torchtune")
    count = len(order) // mbs if drop_last else -(-len(order) // mbs)
    ordered = lengths[order[:count * mbs]] if drop_last else lengths[order]
    padded = np.zeros(count * mbs, dtype=np.int64)
    padded[:len(ordered)] = ordered
    rows = padded.reshape(count, mbs)
    tokens = rows.sum(axis=1)
    sizes = np.full(count, mbs, dtype=np.int64)
    if not drop_last and len(ordered) % mbs:
        sizes[-1] = len(ordered) % mbs
    if batching.rule in ("trl-padding-free",) or (batching.rule == "trl-packing" and batching.packed):
        seq, sizes = tokens, np.ones(count, dtype=np.int64)
    else:
        seq = rows.max(axis=1)
    return sizes.astype(np.int64), _round_up(seq, batching.pad_to_multiple_of), tokens


def _round_up(values: np.ndarray, multiple: int | None) -> np.ndarray:
    if not multiple:
        return values
    return -(-values // multiple) * multiple


def _torchtune_packed(lengths: np.ndarray, batching: Batching, limit: int) -> StepShapes:
    from memplan.dataset.packing import greedy_packs

    packs = greedy_packs(np.minimum(lengths, limit), limit)
    count = len(packs) // batching.micro_batch_size * batching.epochs
    mbs = batching.micro_batch_size
    return StepShapes(np.full(count, mbs), np.full(count, limit), np.full(count, mbs * limit), packed=True)


def _axolotl_packed(lengths: np.ndarray, batching: Batching, limit: int) -> StepShapes:
    from memplan.dataset.multipack import MIN_SAMPLE_LEN, first_fit_bins, pad_multiple

    kept = lengths[(lengths >= MIN_SAMPLE_LEN) & (lengths <= limit)]
    capacity = batching.micro_batch_size * limit
    bins = [first_fit_bins(kept[torch_randperm(len(kept), batching.seed + epoch)], capacity)
            for epoch in range(batching.epochs)]
    tokens = np.concatenate(bins) if bins else kept[:0]
    seq = _round_up(tokens, batching.pad_to_multiple_of or pad_multiple(limit))
    return StepShapes(np.ones(len(tokens), dtype=np.int64), seq, tokens, packed=True)
