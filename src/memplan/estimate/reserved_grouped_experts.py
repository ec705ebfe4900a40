"""A recomputed layer's backward with transformers' grouped experts, op by op, in the reserved-memory schedule
(session 14; :mod:`memplan.estimate.reserved_sim`).

A layer recomputed whole without another op-by-op plan made its forward again tensor by tensor
(:func:`~memplan.estimate.reserved_recompute.general_tensors`) and then its backward as one block of the ledger's
transient, all its gradients made at once in the parameters' order. Where the layer runs transformers' grouped
experts (``grouped_mm_experts_forward``), a trace of its backward (deepseek-v2-lite cut to 4 layers, torchtitan,
``save_on_cpu``, full recompute, s4096 b2: ``model.layers.N.mlp.experts``) runs them op by op after the shared
experts' backward: the combine's ``clone`` and ``new_zeros``, the product's two routed-rows gradients, the down GEMM's
input gradient and its 704 MiB weight gradient, ``act(gate) * up``'s and the activation's gradients, ``cat``, the
gate-up GEMM's rows gradient and its 1,408 MiB weight gradient, each saved tensor freed once its op is done; then the
router's, the post-attention norm's and the attention's backward, their gradients in the reverse of the forward's
use. Laid out as one block, the experts' weight gradients were made beside it, after the block's tensors were freed,
and landed in the holes the experts' temporaries hold in the trace: +6.2% against the trace's simulated reserved.

The schedule now runs the ledger's own walk (:func:`~memplan.estimate.grouped_experts_backward.experts_walk`) on the
recomputed experts' blocks, the shared experts' gradients before it, the experts' two where it makes them, the
others after it in reverse order, the layer's output gradient beside all (the walk's figure counts it). The ledger's
moment is at the walk's worst op (of its two candidates, the one holding more on a scratch tally). The plan applies to
a layer recomputed whole, alone in its checkpoint, with a fused attention core (an eager core's softmax backward is
the general path's own plan, :func:`~memplan.estimate.reserved_backward.recomputed_softmax`), whose experts the
ledger walks whole (:func:`~memplan.estimate.grouped_experts_backward.walks_experts`), in a job that trains the whole
model and makes the layer's gradients in the backward (their positions known); elsewhere the general path stands.
The same model under Hugging Face without offload (SDPA, mbs 2): +13.98% before, +7.44% after (the second step's
loss still makes one 3,200 MiB segment the trace does not: not examined).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memplan.alloc.schedule import STREAM_BITS
from memplan.estimate.activations import UNFUSED_ATTENTION, output_gradient_bytes
from memplan.estimate.context import RunContext, StageContext
from memplan.estimate.grouped_experts_backward import experts_walk, walks_experts
from memplan.estimate.reserved_attention_backward import masked_fp32
from memplan.estimate.reserved_forward import forward_layer, recomputed_blocks
from memplan.estimate.reserved_mlp_backward import GROUPED_SLOT, GROUPED_TERMS, grad_positions, whole_weights
from memplan.estimate.reserved_replay import Block, Replay

#: The experts' weights (names relative to the layer) in the order the walk makes their gradients, then the shared
#: experts' (made before the walk, in this order).
_EXPERT_WEIGHTS = ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
_SHARED_WEIGHTS = ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.up_proj.weight",
                   "mlp.shared_experts.gate_proj.weight")

Tensors = list[tuple[int, int, bool]]


def grouped_tensors(ctx: StageContext, index: int, count: int | None) -> tuple[Tensors, list[int]] | None:
    """The tensors layer ``index``'s backward makes again (the grouped experts' tagged with their slots) and the
    positions of the experts' two weight gradients in its list of ``count`` (None: not made in the backward), or None
    where the plan does not apply (see the module)."""
    run = ctx.run
    layer = run.model.layers[index]
    # an eager core's softmax backward is laid out by the general path's plan (reserved_backward), not here
    if (index not in ctx.recomputed or run.policy.partial or ctx.group != 1 or not whole_weights(run)
            or run.shape.attention in UNFUSED_ATTENTION or not walks_experts(layer, run.shape)):
        return None
    positions = grad_positions(run.model, index, count, _EXPERT_WEIGHTS)
    if positions is None:
        return None
    tensors = recomputed_blocks(ctx, index, grouped=True)
    if not set(range(GROUPED_SLOT, GROUPED_SLOT + len(GROUPED_TERMS))) <= {slot - 2 for _, _, slot in tensors}:
        return None
    return tensors, positions


def grouped_backward(ctx: StageContext, index: int,
                     saved: tuple[list[Block | None], list[Block | None], Sequence[Block | None]], replay: Replay,
                     hooks: tuple[Callable[[Sequence[int] | None], None], Callable[[], None]],
                     count: int | None) -> bool:
    """Layer ``index``'s backward laid out as the module says, where :func:`grouped_tensors` applies (else False,
    nothing laid out): its output gradient, its forward made again, the shared experts' gradients, the experts' walk,
    the other gradients, then everything freed (``saved``: the blocks its checkpointed forward left, freed early,
    the others, the op-by-op slots; ``hooks``: gradients made at positions of its list of ``count``, the ledger's
    moment)."""
    found = grouped_tensors(ctx, index, count)
    if found is None:
        return False
    run, (tensors, positions) = ctx.run, found
    made, peak = hooks
    model = run.model
    incoming = replay.take(output_gradient_bytes(run.shape, model.hidden_size))
    held = forward_layer(replay, tensors, [], [], masked_fp32(run))
    shared = grad_positions(model, index, count, _SHARED_WEIGHTS)
    if shared is not None:
        made(shared)
    experts = held[3][GROUPED_SLOT:GROUPED_SLOT + len(GROUPED_TERMS)]
    worst = _worst(run, index, [0 if block is None else replay.ops[block] >> STREAM_BITS for block in experts])
    tokens = experts_walk(replay, model.layers[index], run.shape, dict(zip(GROUPED_TERMS, experts)),
                          lambda which: made([positions[which]]), lambda step: peak() if step == worst else None)
    done = {*positions, *(shared or ())}
    made([i for i in reversed(range(count or 0)) if i not in done])
    replay.give(tokens, incoming, *saved[0], *saved[1], *saved[2], *held[0], *held[1], *held[2], *held[3][:GROUPED_SLOT])
    return True


def _worst(run: RunContext, index: int, sizes: list[int]) -> str:
    """The walk's worst op of its two candidates (``"combine"``, ``"gate_up"``), on a scratch tally over the experts'
    saved tensors of ``sizes`` with the two weight gradients made."""
    from memplan.estimate.grouped_experts_backward import weight_gradient_bytes

    grads = weight_gradient_bytes(run.model.layers[index], run.model.hidden_size, run.prec.grad_bytes)
    scratch = Replay(repeat=False)
    held: dict[str, int] = {}

    def mark(step: str) -> None:
        held[step] = scratch.requested

    experts_walk(scratch, run.model.layers[index], run.shape, dict(zip(GROUPED_TERMS, scratch.take_all(sizes))),
                 lambda which: scratch.take(grads[which]), mark)
    return max(held, key=lambda step: held[step])
