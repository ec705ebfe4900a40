"""A recomputed layer's backward in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`): its forward made again, then its backward op by op.

Under full activation checkpointing a layer's forward keeps only its input; its backward first runs the
forward again (a trace shows the layer's whole forward, saved tensors and temporaries, under the
backward phase), then the backward proper frees those tensors op by op as a kept layer's does, the
weight gradients made between the frees (:mod:`~memplan.estimate.reserved_mlp_backward`,
:mod:`~memplan.estimate.reserved_attention_backward`). The gradients and the states the first optimizer
step creates then land in the holes these tensors leave, as in the trace, rather than in one block.

The plan applies to a layer the policy recomputes whole (not per module or op) in a job without
autocast's weight copies (the recomputed forward's copies are not laid out), when both op-by-op plans
apply to the layer's tensors; otherwise the layer's backward is its transient, as before. A gpt-oss layer
with eager sink attention, recomputed whole, makes its forward again too (its autocast weight copies not laid
out: gpt-oss-20b's attention projections, 50 MiB, beside 32 GiB ``s + 1``-column tensors at s8192 b2), then its
gradients and the sink softmax backward as autograd runs them (:mod:`~memplan.estimate.reserved_sinks`).
"""

from __future__ import annotations

from collections.abc import Sequence

from memplan.estimate.activations import UNFUSED_ATTENTION
from memplan.estimate.context import StageContext
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.reserved_attention_backward import TANH_SLOT
from memplan.estimate.reserved_forward import layer_blocks, recomputed_blocks
from memplan.estimate.reserved_mlp_backward import SINK_SLOT, grad_positions, mlp_weights, op_by_op
from memplan.estimate.reserved_sinks import applies
from memplan.estimate.reserved_terms import KEPT

_ATTENTION_WEIGHTS = ("self_attn.o_proj.weight",)
#: The slots (+ 2, as :func:`~memplan.estimate.reserved_forward.layer_blocks` tags them) both plans need.
_REQUIRED = {2 + s for s in range(SINK_SLOT) if s != TANH_SLOT}


def recompute_tensors(ctx: StageContext, index: int, count: int | None) -> list[tuple[int, int, bool]] | None:
    """The tensors layer ``index``'s backward makes again before its gradients (``count`` of them made there;
    None: not made there, or under FSDP2), or None when the plan does not apply (see the module)."""
    if sink_recomputed(ctx, index):
        return recomputed_blocks(ctx, index)  # gpt-oss's sink attention (reserved_sinks)
    return _dense_tensors(ctx, index, count)


def sink_recomputed(ctx: StageContext, index: int) -> bool:
    """Whether layer ``index`` runs gpt-oss's eager sink attention (:mod:`~memplan.estimate.reserved_sinks`),
    recomputed whole in a job laid out op by op (:func:`~memplan.estimate.reserved_mlp_backward.op_by_op`)."""
    run = ctx.run
    return (index in ctx.recomputed and not run.policy.partial and op_by_op(run)
            and applies(run.model.layers[index], run))


def moment_position(ctx: StageContext, walk: LayerWalk) -> int:
    """The position in ``walk`` of the layer whose backward holds the ledger's backward moment: the last
    layer's (its backward runs first, beside the most activations), but the first one's where that is a
    recomputed sink layer. The ledger's backward walk (:mod:`~memplan.estimate.stage_peak`) takes the first
    layer where layers keep less than their gradients weigh, every later layer's gradient made; in the last
    layer the schedule was that far (23 layers' fp32 gradients, 68 GiB for gpt-oss-20b s8192 b2 bf16-mixed)
    below the ledger and topped it up as one block there. Elsewhere :func:`moment_choice` may move it."""
    last = len(walk.per_layer) - 1
    return 0 if last > 0 and sink_recomputed(ctx, walk.per_layer[0][0]) else last


def moment_choice(position: int, probe: dict[int, int]) -> int:
    """The layer whose backward holds the ledger's backward moment, of ``position``'s (:func:`moment_position`) and
    the layer the ledger's walk stops at (:func:`~memplan.estimate.backward_walk.walked_backward`), ``probe`` holding
    each one's requested bytes at its worst step in the first step of the schedule: the one where the schedule holds
    more (``position`` on a tie), so the ledger's top-up, one block the allocator must find in one piece, is the
    least. The walk's layer has the gradients of every later layer made, as in the schedule; checked in the last
    layer instead, a backward that keeps little per layer (``save_on_cpu``, recompute) left the other layers'
    gradients to the top-up (deepseek-v2-lite cut to 4 layers, torchtitan, ``save_on_cpu``, full recompute, s4096:
    a 6 GiB block, +19% against the trace's simulated reserved). Where the ledger's walk holds bounds the schedule
    does not (every layer's autocast weight copies to the end of the backward; FSDP2's two largest units unsharded
    beside a small layer) the last layer stays closer to it."""
    return max(probe, key=lambda p: (probe[p], p == position))


def _dense_tensors(ctx: StageContext, index: int, count: int | None) -> list[tuple[int, int, bool]] | None:
    """:func:`recompute_tensors` of a dense layer whose gated MLP and eager core both run op by op."""
    run = ctx.run
    if (count is None or index not in ctx.recomputed or run.policy.partial or run.prec.weight_copies == "autocast"
            or not op_by_op(run)):
        return None
    if grad_positions(run.model, index, count, mlp_weights() + _ATTENTION_WEIGHTS) is None:
        return None
    tensors = recomputed_blocks(ctx, index)
    if {slot for _, _, slot in tensors if slot > 1} - {2 + TANH_SLOT} != _REQUIRED:
        return None
    return tensors


def general_tensors(ctx: StageContext, index: int, transient: int) -> tuple[list[tuple[int, int, bool]], int, int] | None:
    """The tensors a layer recomputed whole makes again in its backward where no op-by-op plan lays it out
    (:func:`recompute_tensors` None: a fused core, autocast's weight copies), and what is left of its
    ``transient`` beside them: (one layer's tensors, the layers of its checkpointed group, the rest). The ledger prices the layer's backward as its checkpointed group's forward made
    again (``group`` layers' saved tensors) plus the general transient (:mod:`~memplan.estimate.layer_walk`), and
    autograd makes those saved tensors one by one, each its own allocation. Laid out as one block, the allocator
    had to find the whole in one piece (qwen2.5-7b s4096: 2.2 GiB for one layer, 4.1 GiB for a group of 4), where
    the real recompute's tensors (148 MiB at most there) fit the segments the forward and the loss left: whether
    the block fitted a free segment or made its own swung the reserved figure by up to 22% when the transient
    moved by a few MiB. None where the layer is not recomputed whole or its tensors outweigh the transient (the
    layer keeps its one block)."""
    run = ctx.run
    if index not in ctx.recomputed or run.policy.partial:
        return None
    tensors = recomputed_blocks(ctx, index)
    kept = ctx.group * sum(size for size, kind, _ in tensors if kind == KEPT)
    if not kept or kept > transient:
        return None
    return tensors, ctx.group, transient - kept


def op_plans(ctx: StageContext, walk: LayerWalk, counts: Sequence[int | None]) -> tuple[bool, bool]:
    """Whether the schedule lays out some kept layer's backward op by op, and some recomputed layer's forward
    again (``counts``: per layer of ``walk`` the gradients its backward makes; for the --explain sentence)."""
    run = ctx.run
    if not op_by_op(run) or run.shape.kernels != "eager" or run.shape.attention not in UNFUSED_ATTENTION:
        return False, False
    kept = recomputed = False
    seen: set[tuple[int, bool]] = set()
    for (index, size, _), count in zip(walk.per_layer, counts):
        key = (id(run.model.layers[index]), index in ctx.recomputed)
        if key in seen or count is None:
            continue
        seen.add(key)
        if index in ctx.recomputed:
            recomputed = recomputed or _dense_tensors(ctx, index, count) is not None
        elif grad_positions(run.model, index, count, mlp_weights() + _ATTENTION_WEIGHTS) is not None:
            slots = {slot for _, _, slot in layer_blocks(ctx, index, size) if slot > 1} - {2 + TANH_SLOT}
            kept = kept or slots == _REQUIRED
    return kept, recomputed
