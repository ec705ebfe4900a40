"""A layer walked op by op under Megatron's sub-module checkpoints with a fused (SDPA) attention core, in the
reserved-memory schedule (:mod:`memplan.estimate.reserved_sim`).

The allocated peak prices such a layer's backward with the walk of
:mod:`~memplan.estimate.recomputed_backward` (each checkpointed sub-module's forward made again where its
block's backward starts, the gated MLP's backward and the fused core's op by op). Laid out as one block of the
walk's worst bytes beside all the saved tensors, the schedule's segments differed from a trace's (llama-3.2-1b
s2048 sdpa ``core_attn``: +4.72% against the trace's simulated reserved); the schedule therefore runs the walk's
own events on its replay, the layer's kept tensors being the schedule's blocks
(:func:`~memplan.estimate.recomputed_backward.walk_events`). Eager cores keep their own op-by-op plans
(:mod:`~memplan.estimate.reserved_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memplan.estimate.activations import UNFUSED_ATTENTION
from memplan.estimate.context import RunContext, StageContext
from memplan.estimate.layer_costs import recomputed_copies_bytes
from memplan.estimate.recomputed_backward import recomputed_backward, walk_events
from memplan.estimate.recomputed_tensors import saved_tensors
from memplan.estimate.reserved_replay import Block, Replay

Walked = tuple[list[tuple[int, int, int]], int]


def walked_fused(ctx: StageContext, index: int) -> Walked | None:
    """Layer ``index``'s walk (its tensors, :func:`~memplan.estimate.recomputed_tensors.saved_tensors`, and the
    bytes of autocast copies its checkpoints make again) where it is a fused-core layer under sub-module
    checkpoints whose backward was walked, else None."""
    run = ctx.run
    if not run.dropped or run.shape.attention in UNFUSED_ATTENTION:
        return None
    return _walked(ctx, index)


def walked_whole(ctx: StageContext, index: int) -> Walked | None:
    """:func:`walked_fused`'s for a layer recomputed whole, alone in its checkpoint, whose backward the allocated
    peak walks op by op (an eager core) where no op-by-op plan of the schedule lays it out
    (:func:`~memplan.estimate.reserved_recompute.recompute_tensors` None: autocast's weight copies), else None."""
    run = ctx.run
    if index not in ctx.recomputed or run.policy.partial or run.dropped or ctx.group != 1:
        return None
    return _walked(ctx, index)


def _walked(ctx: StageContext, index: int) -> Walked | None:
    """Layer ``index``'s tensors and recomputed copies where the allocated peak walks its backward, else None."""
    copies = recomputed_copies_bytes(ctx, index)
    if recomputed_backward(ctx, index, copies) is None:
        return None
    return saved_tensors(ctx.run, index), copies


def walked_backward(run: RunContext, layer: tuple[int, Walked],
                    saved: tuple[list[Block | None], list[Block | None], Sequence[Block | None]], replay: Replay,
                    hooks: tuple[Callable[[Sequence[int] | None], None], Callable[[], None]]) -> bool:
    """Layer ``layer[0]``'s backward as the walk's events (``layer[1]``: :func:`walked_fused`'s) on ``replay``,
    ``saved`` the schedule's blocks of its kept tensors (freed early, the others, the op-by-op slots:
    :func:`~memplan.estimate.reserved_backward.backward_layer`'s), ``hooks`` that function's (gradients made at
    positions, the ledger's moment); the gradients the walk does not make and the slots it does not free come
    after it. False where the walk's plans do not apply (nothing laid out)."""
    index, (tensors, copies) = layer
    early, rest, slots = saved
    start = replay.events
    if walk_events(run, (index, copies), tensors, replay, hooks, (list(slots), early, rest)) is None:
        return False
    hooks[0](None)
    gone = {~op for op in replay.ops[start:] if op < 0}
    replay.give(*(block for block in slots if block is not None and block not in gone))
    return True
