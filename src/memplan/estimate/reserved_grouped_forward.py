"""transformers' grouped experts' forward in the reserved-memory schedule (:mod:`memplan.estimate.reserved_sim`): each
tensor alive as long as ``grouped_mm_experts_forward`` holds it (resv13's plan, session 13; kept in session 14 with
the recomputed layer's backward laid out op by op, :mod:`~memplan.estimate.reserved_grouped_experts`).

The experts (transformers ``integrations/moe.py``: DeepSeek, Qwen-MoE, Mixtral; gpt-oss's clamped SwiGLU has its own
plan, :func:`~memplan.estimate.reserved_experts_backward.experts_forward`) gather the routed rows (``index``), make
fc1's output, the activation of its gate half and the product, then the expert outputs, their weighted product and
the rows put back in token order, summed over the picks. A trace of deepseek-v2-lite (cut to 4 layers, torchtitan,
``save_on_cpu``, full recompute, s4096 b2) keeps each alive as long as the Python function holds it: the dispatched
rows and the expert outputs until the experts return, fc1's output and the activation until the product is made, the
product until the outputs are, the weighted product until the rows are put back (``aten.index`` 384, grouped GEMM
528, ``silu`` 264, ``mul`` 264, grouped GEMM 384, ``mul`` 384, ``index`` 384 MiB). Where the forward frees what it
makes (``save_on_cpu``, a checkpointed layer: a trace of the same model under Hugging Face's non-reentrant checkpoint
makes the same tensors in its forward) the schedule made them one after the other, each freed once the
next was made, two at a time: it reserved no segment for the others, and the tensors the trace later puts in those
segments took the ones the head's and the embedding's gradients share in the trace. A recomputed layer keeps the
saved ones; the weighted product and the rows put back are made around the outputs there too.
"""

from __future__ import annotations

from memplan.estimate.reserved_replay import Block, Replay

_DISPATCHED, _FC1, _ACT, _PRODUCT, _OUTPUTS = range(5)  # reserved_mlp_backward.GROUPED_TERMS' order
_NAMES = ("dispatched", "fc1", "act", "product")


def grouped_forward(replay: Replay, index: int, size: int, kept: bool, temps: dict[str, Block | None]) -> Block | None:
    """Make the grouped experts' tensor ``index`` (:data:`~memplan.estimate.reserved_mlp_backward.GROUPED_TERMS`) of
    ``size`` bytes and free what the forward frees there (see the module); the expert outputs' step also makes the
    weighted product and the rows put back (each of the outputs' size). ``kept``: the tensor is saved (returned for
    the caller to hold), else the forward frees it (None returned); ``temps`` carries the live tensors between calls
    (the caller frees what is left at the layer's end)."""
    block = replay.take(size)
    if index == _PRODUCT:
        replay.give(temps.pop("act", None), temps.pop("fc1", None))
    if index != _OUTPUTS:
        if kept:
            return block
        temps[_NAMES[index]] = block
        return None
    replay.give(temps.pop("product", None))
    weighted = replay.take(size)
    gathered = replay.take(size)
    replay.give(weighted, temps.pop("dispatched", None))
    if not kept:
        replay.give(block)
    replay.give(gathered)
    return block if kept else None
