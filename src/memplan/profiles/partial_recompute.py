"""Which partial recomputes a framework can run: full recompute of only some layers of each pipeline stage.

memplan prices a partial recompute as ``--recompute full --recompute-method block --recompute-layers k``: the
first k layers of each stage (model chunk) are checkpointed. A profile says how its framework gets there
(:attr:`memplan.profiles.framework.FrameworkProfile.partial_recompute`):

- ``"layers"``: any k (Megatron-LM ``--recompute-method block --recompute-num-layers k``);
- ``"every-nth"``: torchtitan's per-layer selective checkpointing (``selective_ac_option = N``) checkpoints
  every N-th layer of each rank, a process-wide counter over its layers; memplan prices the fewest any rank
  checkpoints, so only the counts :func:`every_nth_counts` lists are runnable;
- ``"none"``: the Hugging Face Trainer's and DeepSpeed's (the model's) gradient checkpointing wraps every layer.

``memplan fit`` searches only the counts the framework runs, the torchtitan reader reads ``N`` back through the
same rule, and :mod:`memplan.frameworks.native_fix` writes the ``N`` that gives a count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

__all__ = ["PartialRecompute", "every_nth", "every_nth_counts", "rank_layers"]

PartialRecompute = Literal["layers", "every-nth", "none"]


def rank_layers(chunk_layers: Sequence[int], pp: int) -> list[int]:
    """Decoder layers each pipeline rank holds: its chunks ``rank, rank + pp, ...`` summed."""
    return [sum(chunk_layers[rank::pp]) for rank in range(pp)]


def every_nth(every: int, per_rank: Sequence[int]) -> int:
    """Layers checkpointed per stage when every ``every``-th layer of each rank is (0 or 1: all): the fewest on
    any rank."""
    return min(layers if every <= 1 else layers // every for layers in per_rank)


def every_nth_counts(per_rank: Sequence[int]) -> dict[int, int]:
    """Each partial count (0 < k < the fewest layers of a rank) that some ``N >= 2`` gives, with the largest
    such ``N`` (the fewest checkpointed layers for that count), smallest count first."""
    fewest = min(per_rank)
    out: dict[int, int] = {}
    for every in range(2, max(per_rank) + 1):
        count = every_nth(every, per_rank)
        if 0 < count < fewest:
            out[count] = every  # a larger N with the same count replaces a smaller one
    return dict(sorted(out.items()))
