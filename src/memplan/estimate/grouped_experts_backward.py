"""The backward of transformers' grouped experts, op by op (helpers moegrad11, session 11; mixtral12, session 12).

``grouped_mm_experts_forward`` (transformers ``integrations/moe.py``) gathers the routed rows (``dispatched``),
runs the stacked gate-up grouped GEMM (``fc1``: gate and up halves), ``act(gate) * up`` (``_default_apply_gate``),
the down grouped GEMM, weights each row by its routing weight (``proj_out * sample_weights``), puts the rows back
in token order and sums the ``k`` picks, cast to the block input's dtype. A trace of its backward
(``model.layers.N.mlp.experts``) makes one tensor per op and frees each saved tensor once its op is done:

1. the combine: the incoming gradient cast to the product's dtype where the block's output was cast from it, the
   sum's gradient expanded to routed rows (``reshape``'s ``clone``), ``index_backward``'s zeros it accumulates
   into in place (the copy freed), then the product's two gradients (``grad * weights``, ``grad * proj_out``, the
   second summed to the weights' gradient) and, where the expert outputs are 16-bit but the routing weights fp32
   (Mixtral's router keeps its fp32 softmax), the first cast back to the experts' dtype
   (``mul_tensor_backward``). The product's dtype is the wider of the two: the three routed-rows gradients are fp32
   there. The expert outputs, the first gradient made and the zeros are then freed, the second one living on (a
   trace of deepseek-v2-lite cut to 4 layers, Hugging Face, SDPA, full recompute, s4096 x 2: the first ``mul`` freed
   before the down GEMM's backward, the second after it; which of the two equal-sized blocks lives on decides where
   the down weight's gradient lands);
2. the down GEMM: its input's gradient (and the weight's gradient), the surviving gradient and fc2's input freed;
3. ``act(gate) * up``: two gradients, the down GEMM's input gradient and ``act(gate)`` freed;
4. the activation's backward (one), the first product gradient and fc1's output freed;
5. ``chunk``'s backward: the two halves' gradients joined (``cat``, fc1-sized), the two freed;
6. the gate-up GEMM: the dispatched rows' gradient (and the weight's gradient), the joined one and the dispatched
   rows freed; the gather's backward: the tokens' zeros (the block input's size), the rows' gradient freed.

This replaces the layer's general rule (two of its largest saved tensor) for the experts' tensors: fc1's output is
freed before its gradient is made. Step 1 alone applies where the experts' tensors are not all kept (a sub-module
checkpoint recomputes them later in the backward) or their activation is not a one-op gated one (gpt-oss's clamped
SwiGLU: :mod:`~memplan.estimate.reserved_experts_backward`). Torchtitan's ``GroupedExperts`` and Megatron's
experts combine otherwise (scatter-add, fused unpermute): only transformers' code under eager kernels
(:attr:`~memplan.estimate.activations.ActivationShape.grouped_experts_combine`), on one rank's whole experts.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from memplan.estimate.activations import ActivationShape, Term, divided, output_gradient_bytes
from memplan.estimate.recompute_modules import SITES_DROPPED_BY, term_site
from memplan.estimate.terms import TermRole
from memplan.frozen import frozen_dataclass
from memplan.model.spec import CLAMPED_SWIGLU, LayerSpec, MoESpec
from memplan.units import dtype_bytes

if TYPE_CHECKING:
    from memplan.estimate.reserved_replay import Block, Replay

__all__ = ["WALKED", "ExpertsBackward", "experts_backward", "experts_figures", "experts_walk", "product_bytes",
           "recompute_head_bytes", "walks_experts", "weight_gradient_bytes"]

#: The experts' saved tensors the whole walk frees (the general rule's "largest saved term" leaves them to it).
WALKED = frozenset({TermRole.DISPATCHED_TOKENS, TermRole.EXPERT_FC1, TermRole.EXPERT_OTHER, TermRole.EXPERT_FC2,
                    TermRole.EXPERT_OUTPUTS})
_FP32 = dtype_bytes("fp32")
#: The sites a checkpoint of the whole MoE block makes again before the combine's backward runs.
_MOE_BLOCK_SITES = SITES_DROPPED_BY["moe"]


@frozen_dataclass
class ExpertsBackward:
    """Bytes the experts' backward holds above the layer's saved tensors (one rank), at its worst op."""

    #: Without the experts' weight gradients.
    transient: int
    #: With the weight gradients made where the backward makes them (steps 2 and 6), at its worst op.
    with_gradients: int
    #: The saved terms' roles the walk frees (the general rule leaves them to it): none for step 1 alone.
    walked: frozenset[TermRole] = frozenset()


def walks_experts(layer: LayerSpec, shape: ActivationShape) -> bool:
    """Whether the whole walk applies to the layer's experts: transformers' grouped experts on one rank's whole
    experts, gated with a one-op activation (SiLU, GELU); elsewhere only the combine's step (or nothing)."""
    moe = layer.moe
    return (moe is not None and shape.grouped_experts_combine and shape.ep == 1 and shape.expert_tp == 1
            and moe.expert.gated and moe.expert.activation not in (CLAMPED_SWIGLU, "gelu_new"))


def product_bytes(moe: MoESpec, shape: ActivationShape) -> int:
    """Bytes per element of the combine's product ``proj_out * sample_weights``: the wider of the experts' dtype and
    the routing weights' (fp32 where the router hands them on in fp32: Mixtral's softmax of ``logits.float()``,
    DeepSeek-V2's ``softmax(dtype=float32)``, an fp32 router outside autocast; else the logits' dtype, never wider
    than the experts' own)."""
    experts = shape.expert_bytes or shape.act_bytes
    fp32_weights = moe.routing_weights_fp32 or (moe.router_fp32 and not shape.autocast_ops)
    return max(experts, _FP32) if fp32_weights else experts


def experts_figures(layer: LayerSpec, shape: ActivationShape, rest: list[Term], dropped: frozenset[str],
                    layers_recomputed: bool, gradients: tuple[int, int] = (0, 0)) -> ExpertsBackward | None:
    """:func:`experts_backward` beside what the layer holds through it (one rank), None where it does not apply.

    The layer's output gradient, under a layer-checkpointing policy too (a recomputed layer's figure is net of its
    checkpointed input since session 13, :func:`~memplan.estimate.recomputed_backward.unwalked_backward`: that input
    no longer stands in for the gradient). Under
    sub-module checkpoints (``dropped`` sites) the walk is step 1 alone, and only a checkpoint of the whole MoE
    block has made its tensors again by then (beside it); the others recompute later in the backward."""
    whole = walks_experts(layer, shape) and not any(term_site(t) in dropped for t in rest if t.role in WALKED)
    walk = experts_backward(layer, shape, rest, whole, gradients)
    if walk is None:
        return None
    beside = output_gradient_bytes(shape, shape.hidden)
    if "moe" in dropped and not layers_recomputed:
        beside += sum(divided(t, shape) for t in rest if term_site(t) in dropped and term_site(t) in _MOE_BLOCK_SITES)
    return ExpertsBackward(transient=walk.transient + beside, with_gradients=walk.with_gradients + beside,
                           walked=WALKED if whole else frozenset())


def weight_gradient_bytes(layer: LayerSpec, hidden: int, grad_bytes: int) -> tuple[int, int]:
    """Bytes of the routed experts' down and stacked gate-up weights' gradients (one rank's whole experts)."""
    moe = layer.moe
    if moe is None:
        return 0, 0
    down = moe.num_experts * moe.expert.intermediate_size * hidden * grad_bytes
    return down, 2 * down


def experts_backward(layer: LayerSpec, shape: ActivationShape, rest: list[Term], whole: bool,
                     gradients: tuple[int, int] = (0, 0)) -> ExpertsBackward | None:
    """The walk of the module over the layer's MLP-block terms ``rest`` (those of its role: a frozen GEMM saves no
    input), or None where transformers' grouped experts do not run or the product keeps no expert outputs (a
    frozen router without an input gradient). ``whole``: all the experts' tensors are kept and
    :func:`walks_experts` (else the combine's step only); ``gradients``: bytes of the down and gate-up weights'
    gradients, made in steps 2 and 6 (0: not made there)."""
    moe = layer.moe
    sizes: dict[TermRole, int] = {}
    for t in rest:
        if t.role in WALKED:
            sizes[t.role] = sizes.get(t.role, 0) + divided(t, shape)
    if moe is None or not shape.grouped_experts_combine or not sizes.get(TermRole.EXPERT_OUTPUTS):
        return None
    from memplan.estimate.reserved_replay import Replay

    widths = _widths(moe, shape)
    peaks = []
    for made in ((0, 0), gradients) if any(gradients) else ((0, 0),):  # without gradients made, one walk serves both
        replay = Replay(repeat=False)
        saved = dict(zip(sizes, replay.take_all(list(sizes.values()))))
        start = replay.requested
        survivor = _combine(replay, widths, saved)
        if whole:
            _experts(replay, widths, saved, survivor, partial(_take_gradient, replay, made))
        peaks.append(replay.peak_requested - start)
    return ExpertsBackward(transient=peaks[0], with_gradients=peaks[-1])


def recompute_head_bytes(layer: LayerSpec, shape: ActivationShape) -> int:
    """What the combine's backward has made when a checkpointed layer's recompute starts (0 where transformers'
    grouped experts do not run): non-reentrant ``torch.utils.checkpoint`` recomputes when the backward first unpacks
    a saved tensor, and the nodes before that save none: the cast's and the sum's gradient (a view), then
    ``view``'s backward, whose ``reshape`` of that expanded gradient copies it to routed rows; ``index_backward``
    unpacks the inverse permutation. The copy (the product's dtype) waits beside the recomputed forward."""
    if layer.moe is None or not shape.grouped_experts_combine:
        return 0
    return _widths(layer.moe, shape)["routed"]


def _widths(moe: MoESpec, shape: ActivationShape) -> dict[str, int]:
    """The walk's temporaries' bytes on one rank: routed rows at the hidden size in the product's dtype
    (``routed``), in the experts' (``rows``), at the intermediate size (``intermediate``); the incoming gradient in
    the product's dtype where the block's output was cast from it (``upcast``, else 0); the gather's zeros
    (``tokens``, the block input's dtype)."""
    experts, product = shape.expert_bytes or shape.act_bytes, product_bytes(moe, shape)
    tokens = shape.seq * shape.micro_batch
    routed, received = tokens * moe.top_k, int(tokens * moe.top_k * shape.routed_factor)

    def sized(elements: int, nbytes: int) -> int:
        return divided(Term("", elements * nbytes, "sp", "body"), shape)

    return {"routed": sized(routed * shape.hidden, product), "back": sized(routed * shape.hidden, experts),
            "upcast": sized(tokens * shape.hidden, product) if product != shape.residual_bytes else 0,
            "rows": sized(received * shape.hidden, experts),
            "intermediate": sized(received * moe.expert.intermediate_size, experts),
            "tokens": sized(tokens * shape.hidden, shape.residual_bytes)}


def experts_walk(replay: Replay, layer: LayerSpec, shape: ActivationShape, saved: dict[TermRole, Block | None],
                 gradient: Callable[[int], None], mark: Callable[[str], None]) -> Block | None:
    """The whole walk (steps 1 to 6) on ``replay`` over the experts' ``saved`` tensors (:data:`WALKED`' roles; each
    freed where its op is done), for the reserved schedule (:mod:`~memplan.estimate.reserved_grouped_experts`):
    ``gradient(k)`` makes the down (0) and gate-up (1) weights' gradients where the walk makes them, ``mark(step)``
    is called at the two candidates for the walk's worst op (``"combine"``: the product's two gradients made;
    ``"gate_up"``: the gate-up weight's gradient made). Returns the tokens' gradient (the block input's size),
    alive after the walk."""
    assert layer.moe is not None
    widths = _widths(layer.moe, shape)
    survivor = _combine(replay, widths, saved, mark)
    return _experts(replay, widths, saved, survivor, gradient, mark)


def _take_gradient(replay: Replay, made: tuple[int, int], which: int) -> None:
    """The ledger's walk's gradient ``which`` (0: down, 1: gate-up) of ``made``'s bytes, never freed."""
    replay.take(made[which])


def _no_mark(step: str) -> None:
    """No worst-op marker (the ledger's own walk)."""


def _combine(replay: Replay, widths: dict[str, int], saved: dict[TermRole, Block | None],
             mark: Callable[[str], None] = _no_mark) -> Block | None:
    """Step 1; returns the gradient of the expert outputs, alive until the down GEMM's backward."""
    routed = widths["routed"]
    gradient = replay.take(widths["upcast"])
    expanded = replay.take(routed)
    replay.give(gradient)
    zeros = replay.take(routed)
    replay.give(expanded)
    first, second = replay.take(routed), replay.take(routed)
    back = replay.take(widths["back"]) if widths["back"] != routed else None
    mark("combine")
    replay.give(saved.pop(TermRole.EXPERT_OUTPUTS, None), first, zeros)
    if back is None:
        return second
    replay.give(second)
    return back


def _experts(replay: Replay, widths: dict[str, int], saved: dict[TermRole, Block | None], survivor: Block | None,
             gradient: Callable[[int], None], mark: Callable[[str], None] = _no_mark) -> Block | None:
    """Steps 2 to 6; ``gradient(k)`` makes the down (0) and gate-up (1) weights' gradients (never freed here).
    Returns the tokens' gradient."""
    intermediate = widths["intermediate"]
    grad_input = replay.take(intermediate)
    gradient(0)
    replay.give(survivor, saved.pop(TermRole.EXPERT_FC2, None))
    grad_act, grad_up = replay.take(intermediate), replay.take(intermediate)
    replay.give(grad_input, saved.pop(TermRole.EXPERT_OTHER, None))
    grad_gate = replay.take(intermediate)
    replay.give(grad_act, saved.pop(TermRole.EXPERT_FC1, None))
    joined = replay.take(2 * intermediate)
    replay.give(grad_gate, grad_up)
    grad_rows = replay.take(widths["rows"])
    gradient(1)
    mark("gate_up")
    replay.give(joined, saved.pop(TermRole.DISPATCHED_TOKENS, None))
    tokens = replay.take(widths["tokens"])
    replay.give(grad_rows)
    return tokens
