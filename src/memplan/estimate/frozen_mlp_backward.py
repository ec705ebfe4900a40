"""A frozen gated MLP's backward, op by op: what a fine-tuned layer's MLP block holds above its saved tensors.

A layer whose MLP linears are frozen and carry no adapter (LoRA on the attention projections, a quantized
base) makes no weight gradient in its MLP's backward. The general transient
(:func:`~memplan.estimate.activations.backward_transient_bytes`: what the layer's worst saved term's first
backward node holds) takes the product's three intermediate-sized tensors there, without the layer's output
gradient beside them or a quantized base's dequantized weight. This module replays the block's backward instead (:func:`~memplan.estimate.reserved_mlp_backward.mlp_backward`, the reserved schedule's own
op order, on a tally of requested bytes) from its saved tensors:

1. the layer's output gradient arrives (residual dtype);
2. ``down_proj``: the gradient of its input (one intermediate-sized tensor); on a bitsandbytes base beside
   the weight it dequantizes for it (``MatMul8bitLt``/``MatMul4Bit`` backward: dequantize, multiply, free),
   then its saved input freed (the 8-bit matmul's ``ctx.tensors``; a frozen 16-bit or 4-bit linear saves none);
3. the product's backward (two intermediate-sized gradients), then the up output and ``act(gate)`` freed;
4. ``up_proj``'s input gradient (a hidden-sized tensor, beside its dequantized weight), the activation's
   backward, ``gate_proj``'s input gradient, the two summed.

The 4-bit matmul saves no tensor, so under full recompute (non-reentrant ``torch.utils.checkpoint`` recomputes
at the first saved tensor unpacked) ``down_proj``'s backward runs before the recompute, and the recomputed
``up_proj``'s forward holds its dequantized weight beside that gradient and the block's forward locals: its
residual input and the norm's output, which no frozen linear saves (``recomputed_first``). A layer of the
stack that is not recomputed is priced the same (at most those two hidden-sized tensors too high).

The walk applies to a dense gated MLP with separate gate and up projections whose fc1 term is its three
tensors (eager ``act(gate)``), on one tensor-parallel rank; elsewhere the general rule stays (None).
"""

from __future__ import annotations

from memplan.estimate.activations import ActivationShape, Term, divided, output_gradient_bytes
from memplan.estimate.terms import TermRole
from memplan.estimate.partial_freeze import LayerFlow
from memplan.model.spec import LayerSpec

__all__ = ["FC1", "FC2", "WALKED", "frozen_mlp_backward"]

#: The MLP's saved terms the walk frees (their :class:`~memplan.estimate.terms.TermRole`).
FC1, FC2 = TermRole.MLP_FC1, TermRole.MLP_FC2
#: The MLP norm's output and its autocast copies: one of them kept means the recompute's norm output is not new.
_NORM_OUTPUTS = frozenset({TermRole.NORM_OUTPUT, TermRole.NORM_COPIES, TermRole.SHARED_EXPERT_NORM_COPIES})
#: Those terms: the general rule's "largest saved term" leaves them to the walk.
WALKED = frozenset({FC1, FC2})


def frozen_mlp_backward(layer: LayerSpec, shape: ActivationShape, rest: list[Term], flow: LayerFlow | None,
                        dequantized_bytes: int, recomputed_first: bool = False) -> int | None:
    """The most layer ``layer``'s frozen MLP block holds above its saved tensors during its backward (one
    rank), or None where the walk does not apply (see the module). ``rest``: the layer's MLP-block terms for
    its role; ``flow``: its fine-tuning flow (None: full training); ``dequantized_bytes``: bytes per element of
    a dequantized base weight (0: the base is not quantized); ``recomputed_first``: the block's forward is
    recomputed after ``down_proj``'s backward (a recomputed layer on a base whose matmul saves no tensor)."""
    mlp = layer.mlp
    if (flow is None or flow.mlp.linears_train or flow.mlp.adapted or layer.moe is not None or mlp is None
            or not mlp.gated or mlp.fused_gate_up or shape.kernels == "fused" or shape.tp > 1):
        return None
    sizes: dict[TermRole, int] = {}
    for t in rest:
        sizes[t.role] = sizes.get(t.role, 0) + divided(t, shape)
    tokens = shape.seq * shape.micro_batch
    one = tokens * mlp.intermediate_size * shape.act_bytes
    if not one or sizes.get(FC1, 0) != 3 * one or TermRole.GELU_NEW in sizes:
        return None
    from memplan.estimate.reserved_mlp_backward import MlpPlan, mlp_backward
    from memplan.estimate.reserved_replay import Replay

    replay = Replay(repeat=False)
    slots = [*replay.take_all([one] * 3), replay.take(sizes.get(FC2, 0))]  # gate, up, act(gate), the product
    saved = replay.requested
    residual = output_gradient_bytes(shape, shape.hidden)
    hidden = tokens * shape.hidden * shape.act_bytes
    replay.take(residual)  # the layer's output gradient
    weight = mlp.intermediate_size * shape.hidden * dequantized_bytes
    if recomputed_first and weight:
        # down_proj's input gradient, then the recomputed up_proj: its weight, the residual input, the norm's
        # output
        norm_output = 0 if sizes.keys() & _NORM_OUTPUTS else hidden
        replay.give(*replay.take_all([one, weight, residual, norm_output]))
    plan = MlpPlan(intermediate=one, hidden=hidden, grads=(0, 1, 2), dequantized=weight)
    mlp_backward(replay, plan, slots, lambda positions: None)
    return replay.peak_requested - saved
