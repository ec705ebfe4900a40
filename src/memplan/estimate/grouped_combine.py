"""The backward of transformers' grouped experts' combine (helper moegrad11, session 11).

``grouped_mm_experts_forward`` (transformers ``integrations/moe.py``) ends with
``(proj_out * sample_weights_g)[inv_perm].view(tokens, k, h).sum(1)``. Its backward, the first of the MoE block's:
the summed gradient expanded and copied to routed rows (``reshape``'s ``clone``), ``index_backward``'s zeros
(``FunctionsManual.cpp``) that it accumulates into in place, the copy freed; then the product's backward makes the
gradient of each factor (``grad * sample_weights`` and ``grad * proj_out``, the second summed to the weights'
gradient) beside the zeros. Three routed-rows tensors in the product's dtype, the size of the expert outputs the
product keeps (:data:`~memplan.estimate.activations.EXPERT_OUTPUTS`), beside the layer's output gradient, before
the block has released anything it saved. The general rule (two of the largest saved term) prices two.

Torchtitan's ``GroupedExperts`` and Megatron's experts combine otherwise (scatter-add, fused unpermute): only
transformers' code under eager kernels (:attr:`~memplan.estimate.activations.ActivationShape.grouped_experts_combine`).
"""

from __future__ import annotations

from memplan.estimate.activations import ActivationShape, Term, divided, output_gradient_bytes
from memplan.estimate.recompute_modules import SITES_DROPPED_BY
from memplan.estimate.terms import TermRole

#: The sites a checkpoint of the whole MoE block makes again before the combine's backward runs.
_MOE_BLOCK_SITES = SITES_DROPPED_BY["moe"]


def combine_gradient_bytes(rest: list[Term], shape: ActivationShape) -> int:
    """The three routed-rows gradients of the combine's backward (one rank); 0 when the product keeps no expert
    outputs (a frozen router: one factor's gradient only) or other experts' code runs."""
    if not shape.grouped_experts_combine:
        return 0
    return 3 * sum(divided(t, shape) for t in rest if t.role is TermRole.EXPERT_OUTPUTS)


def combine_backward_bytes(rest: list[Term], shape: ActivationShape, sized: list[tuple[int, str, str]],
                           dropped: frozenset[str], layers_recomputed: bool) -> int:
    """What the combine's backward holds beyond the layer's kept tensors (one rank), 0 where the rule does not apply.

    The three gradients, and the layer's output gradient except under a layer-checkpointing policy (the recomputed
    layer's figure holds its input a second time, a residual-stream tensor of the gradient's size, as for every
    layer kind). Under sub-module checkpoints only a checkpoint of the whole MoE block (``sized``: (bytes, keep,
    site) of the layer's terms) has made its tensors again by then; the others recompute later in the backward.
    """
    routed = combine_gradient_bytes(rest, shape)
    if not routed or layers_recomputed:
        return routed
    again = sum(size for size, _, site in sized if site in dropped and site in _MOE_BLOCK_SITES) \
        if "moe" in dropped else 0
    return routed + output_gradient_bytes(shape, shape.hidden) + again
