"""torch.autocast's weight copies in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`).

Under ``torch.autocast`` each linear layer casts its weight to the 16-bit compute dtype when it runs
(``aten._to_copy`` in a trace, one tensor per weight) and autograd saves the copy until that layer's
backward (:func:`memplan.estimate.autocast.autocast_weight_copy_numel` says which layers keep them).
The estimate counts the decoder layers' copies in its "other" activations; the schedule instead makes
them inside each layer's forward, one tensor per linear weight (their sizes in proportion to the
layer's linear weights) spread evenly between the layer's saved tensors, and frees them with those
in its backward, so they sit in the segments beside that layer's activations as they do in a real step.
"""

from __future__ import annotations

from memplan.estimate.autocast import autocast_weight_copy_numel
from memplan.estimate.context import StageContext
from memplan.model.linears import layer_linears
from memplan.units import dtype_bytes


def _layer_copy_numel(ctx: StageContext, index: int) -> int:
    """Elements of the copies layer ``index`` keeps (every other layer counted as recomputed)."""
    run, layout = ctx.run, ctx.layout
    others = (set(layout.layer_indices) - {index}) | set(ctx.recomputed)
    return autocast_weight_copy_numel(run.model, run.job, layout, recomputed=others, policy=run.policy.kind,
                                      eager_experts=run.profile.kernels == "eager", modules=run.policy.modules)


def _split(total: int, weights: list[int]) -> list[int]:
    whole = sum(weights)
    if total <= 0 or whole <= 0:
        return [total] if total > 0 else []
    sizes = [total * w // whole for w in weights]
    sizes[-1] += total - sum(sizes)
    return [s for s in sizes if s > 0]


def layer_weight_copies(ctx: StageContext, layers: list[int]) -> list[list[int]]:
    """Per layer of ``layers`` (in order) the bytes of the weight copies its forward makes and its
    backward frees; all empty unless the job casts weights with autocast and trains the whole model
    (under fine-tuning only trained weights are cast: left in the estimate's other activations)."""
    run = ctx.run
    if run.prec.weight_copies != "autocast" or run.counts is not None:
        return [[] for _ in layers]
    compute = dtype_bytes(run.prec.compute)
    out = []
    for index in layers:
        numel = _layer_copy_numel(ctx, index) if index not in ctx.recomputed else 0
        linears = [m.weight_numel for m in layer_linears(run.model.layers[index], run.model.hidden_size,
                                                         run.model.model_type)]
        out.append(_split(numel * compute, linears))
    return out
