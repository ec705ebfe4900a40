"""Tensor parallelism's tensors in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`).

The schedule spreads the estimate's per-rank parameter, gradient and optimizer-state bytes over the
model's parameter tensors in proportion to their sizes, so each tensor's share must be its size on one
rank: tensor parallelism splits a decoder layer's linear weights (column- or row-wise) over the TP ranks
and keeps its norms whole, and splits the vocabulary-wide embedding and head only where the framework's
plan does (:func:`memplan.profiles.framework.vocab_split`, ``head_rows_split``: Hugging Face's TP plan
gathers the head's output and keeps the embedding whole; a trace of such a job makes the embedding's
and head's gradients, moments and step temporaries vocabulary-sized on every rank).
"""

from __future__ import annotations

from memplan.model.linears import ParamTensor
from memplan.model.spec import ModelSpec
from memplan.profiles.framework import FrameworkProfile, head_rows_split, vocab_split

#: Parameter-name parts of tensors every TP rank holds whole (norms, learned positions).
_WHOLE = ("norm", ".ln_", "ln_f", "wpe")


def rank_numel(model: ModelSpec, profile: FrameworkProfile, tp: int, tensor: ParamTensor) -> int:
    """Elements of ``tensor`` of ``model`` on one of ``tp`` tensor-parallel ranks under ``profile``'s plan."""
    tp = max(tp, 1)
    if tp == 1 or any(part in tensor.name for part in _WHOLE):
        return tensor.numel
    if tensor.layer is not None:
        return tensor.numel // tp
    if "lm_head" in tensor.name:
        return tensor.numel // head_rows_split(profile, tp, model.tie_word_embeddings)
    return tensor.numel // vocab_split(profile, tp)
