"""A fused-core layer recomputed whole: its MLP block's backward op by op in the reserved-memory schedule
(:mod:`memplan.estimate.reserved_sim`).

A layer recomputed whole, alone in its checkpoint, whose attention core is fused (SDPA) has no op-by-op plan for
the whole layer (:func:`~memplan.estimate.reserved_recompute.recompute_tensors`); the schedule made its forward
again tensor by tensor (:func:`~memplan.estimate.reserved_recompute.general_tensors`), held the rest of the
ledger's transient beside it, then made every gradient at once. Autograd runs the MLP block's backward first, op by
op, as in a kept layer. A trace of llama-3.2-1b at TP 2 (Hugging Face's plan: gate and up split column-wise, down
row-wise; each rank holds its share of the intermediate-sized tensors and full-width input gradients of gate and up)
under SDPA, bf16 autocast and full recompute shows, for each projection (down, up, gate): the recomputed forward's
16-bit copy of its weight, then in its backward the 16-bit weight gradient, the input's gradient, the saved input and
the weight copy freed, the fp32 weight gradient made (``_to_copy``), the 16-bit one freed. Made at once after the
whole transient, the last layers' gradients of the second step found no room in the segments the trace puts them in
(+7.97% against its simulated reserved).

The rest of the transient is still held at the ledger's moment beside the recomputed tensors (the general rule's
figure), then freed; the MLP's walk follows, then the layer's other gradients at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memplan.alloc.schedule import STREAM_BITS
from memplan.estimate.activations import UNFUSED_ATTENTION
from memplan.estimate.context import RunContext
from memplan.estimate.reserved_mlp_backward import MlpPlan, gated_walk, layer_gradient_sizes, mlp_plan
from memplan.estimate.reserved_replay import Block, Replay
from memplan.estimate.reserved_sinks import applies

Hooks = tuple[Callable[[Sequence[int] | None], None], Callable[[], None]]


def mlp_first(run: RunContext, layer: tuple[int, int | None, int], slots: list[Block | None], replay: Replay,
              hooks: Hooks) -> bool:
    """Layer ``layer[0]``'s backward as the module says, right after its forward was made again (``slots``: its
    op-by-op tensors, those freed set to None; ``layer``: the index, the gradients its backward makes, the rest of
    its transient; ``hooks``: :func:`~memplan.estimate.reserved_backward.backward_layer`'s). False (nothing laid
    out) where the layer's core is not fused, it runs gpt-oss's sinks, or its MLP plan does not apply."""
    index, count, rest = layer
    if run.shape.attention in UNFUSED_ATTENTION or applies(run.model.layers[index], run):
        return False
    plan = mlp_plan(run, index, slots, count, lambda block: replay.ops[block] >> STREAM_BITS)
    if plan is None:
        return False
    made, peak = hooks
    copies = [replay.take(size) for size in _weight_copies(run, index, plan)]
    temp = replay.take(rest)
    peak()
    replay.give(temp)
    _mlp_backward(replay, (plan, copies), slots, made)
    slots[:4] = [None] * 4
    made(None)
    return True


def _weight_copies(run: RunContext, index: int, plan: MlpPlan) -> list[int]:
    """Bytes of the 16-bit copies autocast makes of the MLP's down, up and gate weights on one rank (TP splits every
    decoder-layer linear: :mod:`~memplan.estimate.reserved_tp`), 0 each without autocast's weight copies."""
    if run.prec.weight_copies != "autocast":
        return [0, 0, 0]
    sizes = layer_gradient_sizes(run.model, index, run.shape.act_bytes)
    return [sizes[position] // max(run.job.parallel.tp, 1) for position in plan.grads]


def _mlp_backward(replay: Replay, walk: tuple[MlpPlan, list[Block | None]], slots: Sequence[Block | None],
                  made: Callable[[Sequence[int]], None]) -> None:
    """The gated MLP's backward as the trace runs it (see the module): ``walk`` the plan and the weight copies (down,
    up, gate), ``slots`` the recomputed gate, up, ``act(gate)`` and product. Each projection: its weight's 16-bit
    gradient, the input's gradient, the saved tensors and the copy freed, the fp32 gradient made, the 16-bit freed."""
    plan, copies = walk

    def step(index: int, width: int, freed: Sequence[Block | None], position: int) -> Block | None:
        copy = copies[index]
        half = replay.take(replay.ops[copy] >> STREAM_BITS if copy is not None else 0)
        grad_input = replay.take(width)
        replay.give(*freed, copy)
        made((position,))
        replay.give(half)
        return grad_input

    gated_walk(replay, plan, slots, step)
