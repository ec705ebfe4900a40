"""The walk over a stage's decoder layers: what each keeps and adds in its backward, per chunk.

One pass in forward order gives the figures the stage's mechanics share: per virtual chunk the
bytes kept on the GPU and in CPU memory (DeepSpeed checkpointing), the worst layer backward, the
per-layer record the backward walk replays, the CUDA-graph captured figures and the combined-1F1B
nodes (:mod:`memplan.estimate.ep_overlap`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat

from memplan.estimate.activations import output_gradient_bytes
from memplan.estimate.context import StageContext
from memplan.estimate.cuda_graphs import LayerCapture, layer_capture
from memplan.estimate.ds_checkpointing import ds_checkpointing_applies, place_checkpoint
from memplan.estimate.ep_overlap import LayerParts
from memplan.estimate.finetune import dequantizing_op_bytes
from memplan.estimate.layer_costs import (
    cp_backward_extra,
    dora_recompute_head,
    ep_parts,
    experts_wgrad_extra,
    layer_costs,
    per_tensor_offload,
    recomputed_copies_bytes,
    with_shared_expert_overlap,
)
from memplan.estimate.made_gradients import early_gradients
from memplan.estimate.offloaded_backward import offloaded_backward
from memplan.estimate.recomputed_backward import (
    brought_back_input,
    checkpointed_sink_forward,
    recomputed_backward,
    recomputed_dora_forward,
    unwalked_backward,
)
from memplan.estimate.states import layer_kinds
from memplan.frozen import frozen_dataclass
from memplan.units import dtype_bytes


@dataclass
class LayerWalk:
    """What the stage's layers keep and add, gathered in forward order."""

    #: Per chunk: bytes kept on the GPU, and in CPU memory (DeepSpeed checkpointing).
    chunk_kept: list[int] = field(default_factory=list)
    chunk_cpu: list[int] = field(default_factory=list)
    #: The largest checkpointed input (DeepSpeed checkpointing).
    largest_ckpt: int = 0
    worst_backward: int = 0
    #: Per layer, in forward order: (index, bytes it keeps, bytes its backward adds at its worst).
    per_layer: list[tuple[int, int, int]] = field(default_factory=list)
    #: CUDA graphs: per chunk the captured regions' saved bytes and captured layers; the worst captured backward.
    chunk_graph: list[int] = field(default_factory=list)
    chunk_graph_layers: list[int] = field(default_factory=list)
    graph_worst_backward: int = 0
    #: Combined 1F1B: each layer split into the schedule's nodes.
    ep_parts: list[LayerParts] = field(default_factory=list)
    #: Autocast weight copies the checkpointed regions make (:func:`recomputed_copies_bytes`), summed
    #: over the layers: also what autocast's cache holds at the loss.
    recomputed_copies: int = 0
    #: Per recomputed layer walked op by op (:mod:`~memplan.estimate.recomputed_backward`): its weight
    #: gradients made before its backward's worst op, where the backward makes gradients.
    early_gradients: dict[int, int] = field(default_factory=dict)
    #: Whether some recomputed layer's backward was walked op by op (for the --explain sentence).
    walked: bool = False


def walk_layers(ctx: StageContext, forward_extra: int) -> LayerWalk:
    """Walk the stage's layers; ``forward_extra``: what the last layer's forward holds beyond its saved tensors
    (DoRA's weight temporaries, gpt-oss's eager sink attention), which a recomputed forward makes again.

    Under full training a layer's figures depend only on its kind, on whether it is recomputed (and
    first of its checkpointed group) and on its context-parallel comm type, so they are computed once
    per such key and shared by the stages of one estimate (the run's cache)."""
    run = ctx.run
    graphed = None
    if run.job.cuda_graphs.impl in ("local", "transformer_engine"):
        graphed = layer_capture(run.model, run.job.cuda_graphs, run.shape, kept_classes=run.kept_classes,
                                dropped=run.dropped)
    per_layer_cp = len(run.job.overlap.cp_comm_types) == len(run.model.layers)
    # the common case (full training, no recompute groups, one CP comm type) keys a layer by its kind
    # alone: each kind's visit is built once and entered once per chunk for all its layers
    simple = run.counts is None and ctx.group == 1 and not per_layer_cp and not ctx.recomputed
    walk = LayerWalk()
    for chunk in ctx.layout.chunks:
        walk.chunk_kept.append(0)
        walk.chunk_cpu.append(0)
        walk.chunk_graph.append(0)
        walk.chunk_graph_layers.append(0)
        if simple and _walk_by_kind(walk, ctx, chunk, forward_extra, graphed):
            continue
        for position, index in enumerate(chunk):
            _add(walk, index, _visit(ctx, position, index, forward_extra, graphed, per_layer_cp))
    return walk


def _walk_by_kind(walk: LayerWalk, ctx: StageContext, chunk: tuple[int, ...], forward_extra: int,
                  graphed: LayerCapture | None) -> bool:
    """Enter a chunk whose layers give plain visits (kept and worst only) kind by kind: each kind's
    visit once, its kept bytes times its count; False (nothing entered) when a visit is not plain."""
    if not chunk:
        return True
    layers = ctx.run.model.layers
    kinds = layer_kinds(ctx.run.model, chunk)
    visits = [(_visit(ctx, 0, index, forward_extra, graphed, False), count) for index, count in kinds]
    if not all(visit.plain for visit, _ in visits):
        return False
    walk.chunk_kept[-1] += sum(visit.keep * count for visit, count in visits)
    walk.recomputed_copies += sum(visit.copies * count for visit, count in visits)
    walk.worst_backward = max(walk.worst_backward, *(visit.worst for visit, _ in visits))
    if len(visits) == 1:
        walk.per_layer.extend(zip(chunk, repeat(visits[0][0].keep), repeat(visits[0][0].worst)))
        return True
    by_kind = {id(layers[index]): visit for (index, _), (visit, _) in zip(kinds, visits)}
    for index in chunk:
        visit = by_kind[id(layers[index])]
        walk.per_layer.append((index, visit.keep, visit.worst))
    return True


def _visit(ctx: StageContext, position: int, index: int, forward_extra: int, graphed: LayerCapture | None,
           per_layer_cp: bool) -> _Visit:
    """Layer ``index``'s visit, memoised in the run (shared by the stages of one estimate) under full
    training by its kind, recompute, place in its checkpointed group and context-parallel comm type."""
    run = ctx.run
    if run.counts is not None:
        return _layer_visit(ctx, position, index, forward_extra, graphed)
    key = ("visit", id(run.model.layers[index]), index in ctx.recomputed, position % ctx.group == 0,
           run.job.overlap.cp_comm_types[index] if per_layer_cp else None)
    visit = run.cache.get(key)
    if visit is None:
        visit = run.cache[key] = _layer_visit(ctx, position, index, forward_extra, graphed)
    return visit


@frozen_dataclass
class _Visit:
    """One layer's figures in the walk."""

    keep: int
    worst: int
    cpu_keep: int = 0
    #: The checkpointed input DeepSpeed placed (for the largest one), 0 otherwise.
    checkpoint: int = 0
    ep: LayerParts | None = None
    graph: tuple[int, int] | None = None
    #: The layer's :func:`recomputed_copies_bytes` (already in ``worst``).
    copies: int = 0
    #: A recomputed layer walked op by op: None, else its weight gradients made before its worst op.
    early_grads: int | None = None
    #: A layer not walked as recomputed: its weight gradients made before its worst op (under ``save_on_cpu`` a
    #: layer not recomputed, its worst node; transformers' grouped experts walked op by op).
    made_grads: int = 0

    #: Only kept and worst figures (no CPU checkpoint, combined-1F1B part, captured graph or walked backward).
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        plain = (not (self.cpu_keep or self.checkpoint) and self.ep is None and self.graph is None
                 and not self.early_grads and not self.made_grads)
        object.__setattr__(self, "plain", plain)


def _add(walk: LayerWalk, index: int, visit: _Visit) -> None:
    """Add layer ``index``'s figures to the walk."""
    walk.chunk_kept[-1] += visit.keep
    walk.recomputed_copies += visit.copies
    if visit.cpu_keep or visit.checkpoint:
        walk.chunk_cpu[-1] += visit.cpu_keep
        walk.largest_ckpt = max(walk.largest_ckpt, visit.checkpoint)
    if visit.worst > walk.worst_backward:
        walk.worst_backward = visit.worst
    walk.per_layer.append((index, visit.keep, visit.worst))
    if visit.early_grads is not None:
        walk.walked = True
        if visit.early_grads:
            walk.early_gradients[index] = visit.early_grads
    if visit.made_grads:
        walk.early_gradients[index] = visit.made_grads
    if visit.ep is not None:
        walk.ep_parts.append(visit.ep)
    if visit.graph is not None:
        graph_keep, graph_worst = visit.graph
        walk.chunk_graph[-1] += graph_keep
        walk.chunk_graph_layers[-1] += graph_keep > 0 or graph_worst > 0
        walk.graph_worst_backward = max(walk.graph_worst_backward, graph_worst)


def _layer_visit(ctx: StageContext, position: int, index: int, forward_extra: int, graphed: LayerCapture | None) -> _Visit:
    """The figures of layer ``index`` at ``position`` in its chunk."""
    run = ctx.run
    layer = run.model.layers[index]
    keep, full, transient, rebuilt = layer_costs(run, layer, index)
    keep, full = with_shared_expert_overlap(run, layer, keep, full)
    copies = recomputed_copies_bytes(ctx, index)
    walked = recomputed_backward(ctx, index, copies)
    # save_on_cpu: a layer not recomputed has its saved tensors brought back node by node
    offloaded = offloaded_backward(run, index) if (per_tensor_offload(run) and index not in ctx.recomputed
                                                   and not run.policy.partial) else None
    if offloaded is not None:
        offloaded = offloaded.within(full + transient)
        transient = offloaded.transient
    # a recomputed layer's backward op by op (its copies freed as it goes), else the layer kind's general rule
    transient = (walked.transient if walked is not None else transient + copies) + cp_backward_extra(run, index)
    if run.counts is not None:  # a quantized linear's backward: an op of its own beside the saved tensors
        transient = max(transient, dequantizing_op_bytes(run.counts, run.job, index, run.shape,
                                                         dtype_bytes(run.prec.compute)))
    recomputed = index in ctx.recomputed
    cpu_keep = checkpoint = again = 0
    sink = (0, 0)
    if recomputed:
        # the residual gradient waits beside the softmax backward, and the recomputed forward reads the checkpointed
        # input (DeepSpeed's gathered or fetched copy is the checkpoint's backward extra), except under save_on_cpu;
        # a walked backward has both already
        if walked is None:
            transient, again = unwalked_backward(run, index, transient, not run.job.offload.activations)
            forward_extra = recomputed_dora_forward(run, index, forward_extra)
        # the forward's temporaries (DoRA's weights, gpt-oss's sink attention) are made again once the layer's
        # output gradient has arrived: beside it (and under save_on_cpu the checkpointed input brought back)
        beside = forward_extra and (output_gradient_bytes(run.shape, run.model.hidden_size)
                                    + dora_recompute_head(run, index) + brought_back_input(run, index))
        layer_keep, layer_worst, cpu_keep, checkpoint = _recomputed(ctx, position, keep, full,
                                                                    max(transient, forward_extra + beside))
    elif run.policy.partial:
        # The recomputed modules (the attention core, the attention module, or under per-op
        # SAC the rest of the layer) are made again during this layer's backward (a walk of
        # sub-module checkpoints makes them where their blocks' backward starts: in its figure).
        walked_modules = walked is not None and bool(run.dropped)
        layer_keep, layer_worst = keep, (0 if walked_modules else rebuilt) + transient
        sink = checkpointed_sink_forward(run, index, copies)  # gpt-oss's checkpointed sink attention
    else:
        layer_keep, layer_worst = full, transient
    layer_worst += experts_wgrad_extra(run, layer, full, transient)
    made = early_gradients(run, layer, index, transient + again, copies) if walked is None and offloaded is None else 0
    if sink[0]:
        made, layer_worst = max(layer_worst + made, sum(sink)) - max(layer_worst, sink[0]), max(layer_worst, sink[0])
    return _Visit(keep=layer_keep, worst=layer_worst, cpu_keep=cpu_keep, checkpoint=checkpoint, copies=copies,
                  early_grads=walked.with_gradients if walked is not None else None,
                  made_grads=offloaded.early_gradients if offloaded is not None else made,
                  ep=ep_parts(run, layer, layer_keep, layer_worst) if run.job.overlap.ep_a2a else None,
                  graph=graphed(index, layer_keep, layer_worst, recomputed) if graphed is not None else None)


def _recomputed(ctx: StageContext, position: int, keep: int, full: int,
                transient: int) -> tuple[int, int, int, int]:
    """(kept, worst backward, kept in CPU memory, checkpointed input placed) of a layer under full
    recompute: its input, then its whole forward again in its backward (the recomputed forward
    rebuilds DoRA's weights too)."""
    layer_worst = ctx.group * full + transient
    if position % ctx.group:
        # uniform groups: one checkpoint per group of layers keeps only the group's input
        # (megatron/core/transformer/transformer_block.py ``_checkpointed_forward``)
        return 0, layer_worst, 0, 0
    if not ds_checkpointing_applies(ctx.job, ctx.policy):
        return keep, layer_worst, 0, 0
    rc = ctx.job.recompute
    placed = place_checkpoint(keep, partition=rc.partition_activations, cpu=rc.cpu_checkpointing,
                              tp=ctx.job.parallel.tp)
    return placed.gpu_keep, layer_worst + placed.backward_extra, placed.cpu_keep, keep
