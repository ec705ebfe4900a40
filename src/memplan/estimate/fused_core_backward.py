"""A fused attention core's backward (SDPA's flash, memory-efficient or cuDNN kernel), op by op, for the walk of a
layer's backward under Megatron's sub-module checkpoints (:mod:`~memplan.estimate.recomputed_backward`).

A trace of a Hugging Face layer with ``attn_implementation="sdpa"`` shows its attention block's backward, once
the MLP block's is done, as: the output projection's weight gradient and the gradient of its input, its saved
input freed; then one kernel (``_scaled_dot_product_*_attention_backward``) that makes the gradients of q, k and v
at once, each shaped as the kernel's input (grouped keys and values are not repeated: transformers passes
``enable_gqa``), freed as RoPE's and the projections' backward consume them. No scores-sized tensor is made,
unlike the eager core's softmax backward (:mod:`~memplan.estimate.reserved_attention_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memplan.estimate.activations import divided, layer_terms
from memplan.estimate.terms import TermRole
from memplan.estimate.context import RunContext
from memplan.estimate.reserved_mlp_backward import grad_positions

if TYPE_CHECKING:
    from memplan.estimate.reserved_replay import Block, Replay

#: The output projection's input among the op-by-op plans' slots (the kernel's output, which it also saves).
OUTPUT_INPUT_SLOT = 4


@dataclass(frozen=True)
class FusedCorePlan:
    """Sizes (bytes) of the fused core's backward temporaries and the output projection's gradient position."""

    hidden: int
    qkv: int
    output_grad: int


def fused_core_plan(run: RunContext, index: int, slots: Sequence[object], count: int | None) -> FusedCorePlan | None:
    """The plan for layer ``index`` (``slots``: the layer's op-by-op tensors, the output projection's input at
    :data:`OUTPUT_INPUT_SLOT`), or None when the layer has no such input or its gradients are not listed."""
    layer = run.model.layers[index]
    if layer.attention is None or slots[OUTPUT_INPUT_SLOT] is None:
        return None
    positions = grad_positions(run.model, index, count, ("self_attn.o_proj.weight",))
    if positions is None:
        return None
    shape = run.shape
    qkv = sum(divided(t, shape) for t in layer_terms(layer, shape) if t.role == TermRole.QKV)
    return FusedCorePlan(hidden=shape.seq * shape.micro_batch * run.model.hidden_size * shape.act_bytes,
                         qkv=qkv, output_grad=positions[0])


def fused_core_backward(replay: Replay, plan: FusedCorePlan, slots: Sequence[Block | None],
                        made: Callable[[Sequence[int]], None]) -> None:
    """The fused core's backward op by op (see the module), the output projection's saved input freed."""
    made((plan.output_grad,))
    grad_output = replay.take(plan.hidden)
    replay.give(slots[OUTPUT_INPUT_SLOT])
    grads = replay.take(plan.qkv)
    replay.give(grad_output, grads)
