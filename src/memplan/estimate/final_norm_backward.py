"""Mechanic: the final norm's backward, a candidate moment of the last stage's backward (helper backmom12,
session 12; ported onto main beside :mod:`~memplan.estimate.made_gradients` by helper fnorm12).

The output head's backward has run: the logits, the loss's tensors and the head's saved input are released,
the head's gradient made. Before any layer's backward, the final norm's runs, beside every layer's saved
activations. transformers' eager RMSNorm (``LlamaRMSNorm``: ``x = input.to(float32)``, ``x * rsqrt(mean(x^2) +
eps)``, then ``weight * x_normed.to(input dtype)``; Gemma's ``(x_normed * (1 + weight)).type_as(input)``) runs
it as separate ops, all in fp32 (a trace shows them one by one): the incoming gradient times the weight and
times the normalized input (summed into the weight's gradient), the normalized input and the incoming
gradient then freed; the gradient through ``x * rsqrt`` (two products, one summed over the hidden dimension,
the other the first part of the input's gradient); then the mean's backward (``div``: the gradient spread
over the hidden dimension) and the square's (``pow(x, 1)``, ``* 2``, ``* grad``): its worst op, five fp32
tensors of the norm's input size alive, beside the fp32 input ``pow`` saved (the norm's input itself when
fp32, else its fp32 copy), freed after it. The two parts of the input's gradient are summed next, the
layer's output gradient.

The moment is priced as the ledger's backward moment, whose collective buffers are a block's backward's.
Under PyTorch FSDP2 (:func:`~memplan.estimate.extras.communication_by_phase`) those differ from what is
unsharded during the final norm's backward (the root unit, the last block prefetched): not priced there. A
LayerNorm (``native_layer_norm_backward``: one op) and fused RMSNorm kernels make only the input's gradient: the
rule of a layer's backward covers them (nothing priced here).
"""

from __future__ import annotations

from memplan.estimate.activations import NORM_COMPUTE_BYTES
from memplan.estimate.context import StageContext
from memplan.estimate.partial_freeze import root_flow

#: Tensors of the norm's input size (fp32) alive at the worst op: the input ``pow`` saved, the input's
#: gradient through ``rsqrt``, the mean's spread gradient, ``pow(x, 1)``, its doubling and its product.
_FP32_TENSORS = 6

#: The --explain sentence, where the final norm's backward is the backward's worst moment.
NOTE = ("the final norm's backward (eager RMSNorm, fp32): its input, the input's gradient through rsqrt and "
        "the square's backward (four more tensors of the hidden states' size) beside every layer's saved "
        "activations and the head's gradient: the backward's worst moment")


def final_norm_backward_bytes(ctx: StageContext) -> int:
    """What the final norm's backward holds at its worst op beyond the layers' saved tensors (one rank), on
    the stage with the head; 0 where its backward is not an eager RMSNorm's or its input needs no gradient."""
    run = ctx.run
    shape = run.shape
    if not ctx.layout.has_head or shape.kernels != "eager" or shape.norm != "rmsnorm" or shape.fused_rms_norm:
        return 0
    if run.job.sharding.fsdp != "none" and run.profile.torch_optimizer:
        return 0  # FSDP2: the collectives alive then are not a block's backward's (see the module)
    if run.counts is not None and not root_flow(run.model, run.job.finetune, run.policy.input_grads).norm_input_grad:
        return 0
    return _FP32_TENSORS * NORM_COMPUTE_BYTES * shape.local_tokens * shape.hidden
