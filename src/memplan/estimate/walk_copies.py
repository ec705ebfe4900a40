"""The autocast weight copies a walked layer's backward holds (:mod:`~memplan.estimate.recomputed_backward`), and
when each is freed.

Under ``torch.autocast`` each linear layer's autograd node saves the 16-bit copy of its weight (and bias) that
autocast made, and frees it once its backward has run. A trace of a Llama layer's backward shows the down, up
and gate projections' copies freed as each projection's backward ends (before its weight gradient is cast to
the gradient's dtype), the output projection's at its own backward, and the q, k and v projections' after the
attention core's backward. The copies a checkpoint makes again (a recomputed layer's, per-op SAC's, or the
MLP's under Megatron's ``mlp`` sub-module checkpoint: ``copies``) come with its recompute; under sub-module
checkpoints the layer's other copies were saved by its forward (the stage's other activations count them).
"""

from __future__ import annotations

from memplan.estimate.autocast import layer_weight_copy_numel
from memplan.estimate.context import RunContext
from memplan.frozen import frozen_dataclass
from memplan.units import dtype_bytes

#: The weights whose copies go as their gradients are made, in the order the backward makes them: the gated MLP's
#: (made again under the ``mlp`` checkpoint), then the output projection's. The others go after the core's backward.
_FREED_WITH_GRADIENT = ("mlp.down_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.weight",
                        "self_attn.o_proj.weight")
_MLP_WEIGHTS = 3


@frozen_dataclass
class CopyPlan:
    """A walked layer's autocast copies (bytes, one rank): (gradient position, bytes) of those freed with that
    gradient, and the bytes freed after the core's backward, of the recomputed and the saved ones."""

    recomputed: tuple[tuple[int, int], ...] = ()
    recomputed_late: int = 0
    saved: tuple[tuple[int, int], ...] = ()
    saved_late: int = 0


def copy_plan(run: RunContext, index: int, copies: int) -> CopyPlan:
    """Layer ``index``'s copies: ``copies`` bytes made again by its checkpoints
    (:func:`~memplan.estimate.layer_costs.recomputed_copies_bytes`) and, under sub-module checkpoints, the rest of
    the layer's saved by its forward; all freed after the core where the weights are not listed apart."""
    from memplan.estimate.reserved_mlp_backward import grad_positions, layer_gradient_sizes

    if run.prec.weight_copies != "autocast":
        return CopyPlan(recomputed_late=copies)
    compute = dtype_bytes(run.prec.compute)
    total = layer_weight_copy_numel(run.model, run.job, index, eager_experts=run.profile.kernels == "eager") * compute
    saved_total = max(0, total - copies) if run.dropped else 0
    numels = layer_gradient_sizes(run.model, index, 1)
    positions = grad_positions(run.model, index, len(numels), _FREED_WITH_GRADIENT)
    if positions is None:
        return CopyPlan(recomputed_late=copies, saved_late=saved_total)
    sized = tuple((p, numels[p] * compute) for p in positions)
    # a whole recomputed (or per-op SAC) layer makes every copy again; an mlp checkpoint the MLP's
    recomputed = (sized[:_MLP_WEIGHTS] if run.dropped else sized) if copies else ()
    saved = tuple(s for s in sized if s not in recomputed) if run.dropped else ()
    rest, saved_rest = copies - sum(b for _, b in recomputed), saved_total - sum(b for _, b in saved)
    if rest < 0 or saved_rest < 0:
        return CopyPlan(recomputed_late=copies, saved_late=saved_total)
    return CopyPlan(recomputed=recomputed, recomputed_late=rest, saved=saved, saved_late=saved_rest)
