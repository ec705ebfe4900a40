"""HSDP's all-reduce buffers (``--fsdp hybrid``: FSDP2 ``fully_shard`` on a 2-D (replicate, shard) mesh).

Under hybrid sharding each unit's gradients are reduce-scattered within its shard group and the output, in the
reduce dtype, is then all-reduced in place across the replicas (torch 2.13
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`` ``foreach_reduce``). The unit keeps that output
(``FSDPParamGroup._all_reduce_state``, ``_fsdp_param_group.py``: so that the next unit's reduce-scatter cannot
reuse its block while the all-reduce runs) until ``finalize_backward``, after the whole backward. Where the
reduce dtype is the sharded gradients' own (torchtitan: fp32 both; no mixed precision) that buffer *is* the
gradient and costs nothing more; where it is not (accelerate's FSDP2 reduces in the compute dtype, the sharded
gradients fp32), every unit's sharded gradients stay in the reduce dtype beside the fp32 ones to the end of the
backward. At the end of the backward (the last unit's cast) that is every unit's but the last one's, whose
output is the cast's input as under full sharding. Measured (helper hsdp17, docs/benchmarks.md): the toy llama
under hf, 2 replicas x 2 shards, full recompute, seq 32, where the end of the backward sets the peak: 2,557,440 B
of bf16 shards held there (the blocks' 1,508,352 B and the root's), the peak 26,164,224 B (estimated -2.26%
without this term, -0.01% with it).

Under fine-tuning a unit reduce-scatters (and all-reduces, and holds) only its parameters with a gradient
(``FSDPParamGroup.post_backward`` collects ``fsdp_params_with_grad`` and returns before ``foreach_reduce`` where
there are none): the trainable tensors in the reduce dtype, where it is not their own dtype (peft's fp32 adapters
under accelerate's bf16 reduce). A unit with nothing trainable (a frozen embedding or head) reduces nothing, so at the
end of the backward, when the embedding's unit runs last, every decoder layer's buffer is held, the first layer's
too. Measured (helper hybridft18, docs/benchmarks.md): the toy under hf, LoRA r 8 on q,v, 2 replicas x 2 shards,
full recompute: 13,312 B more than full sharding over 2 where the embedding's unit is gathered at the end of the
backward (the two layers' 3,328 sharded adapter elements each, in bf16).

Known limitations: the units' shards are priced without FSDP2's per-parameter padding; the buffers a head unit
apart from the embedding would hold during the blocks' backward are not priced (the profile that has one,
torchtitan, reduces in the gradients' dtype), nor the held buffers of the units already reduced at a moment inside
the backward (priced at its end only); under fine-tuning the root's own trainable tensors (a trained embedding or
head, an adapter on the head) are not counted, and a stage that trains tensors of two dtypes (adapters beside
trained base weights or ``modules_to_save`` copies) is said, not priced. Without recompute the trace gathers no
unit after the first layer's reduce (the frozen embedding has no backward), so its end of the backward holds one
layer's buffer more than full sharding at its most (the first layer's own is then the cast's input, as there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import COMMUNICATION, Contribution
from memplan.estimate.states import sharded_numel
from memplan.job import resolved_adapter_dtype
from memplan.units import dtype_bytes, normalize_dtype

if TYPE_CHECKING:
    from memplan.estimate.stage_states import StageStates

__all__ = ["contributions"]

_END = ("end of backward",)


def contributions(ctx: StageContext, st: StageStates, last_unit: int) -> list[Contribution]:
    """The all-reduce buffers the units before the backward's last one (``last_unit``: its numel on this GPU
    before sharding) hold at the end of the backward, under hybrid sharding in a reduce dtype not the
    gradients'; nothing otherwise."""
    run = ctx.run
    job, prec = run.job, run.prec
    dp = job.parallel.data_parallel * job.parallel.cp
    replicas = dp // min(job.sharding.hybrid_shard_size(dp), dp)
    if job.sharding.fsdp != "hybrid" or replicas < 2 or prec.reduce is None:
        return []
    if st.ft is not None:
        return _finetune(ctx, st, replicas)
    if prec.reduce == prec.grad:
        return []
    numel = sharded_numel(job, max(st.params.dense - last_unit, 0), st.params.expert)
    return [Contribution(COMMUNICATION, numel * dtype_bytes(prec.reduce), _END, note=(
        f"FSDP hybrid sharding ({replicas} replicas): each unit's sharded gradients in {prec.reduce}, the buffer "
        "all-reduced across the replicas, stay held (FSDPParamGroup._all_reduce_state) beside the "
        f"{prec.grad} ones until the backward ends: {numel:,} elements of the units before the last"))]


def _finetune(ctx: StageContext, st: StageStates, replicas: int) -> list[Contribution]:
    """Under fine-tuning: every decoder layer's trainable tensors, sharded, in the reduce dtype where the trained
    tensors' own dtype differs (the embedding's unit, last in the backward, reduces nothing where it is frozen);
    said, not priced, where a stage trains tensors of two dtypes."""
    job, prec, ft, counts = ctx.run.job, ctx.run.prec, st.ft, ctx.run.counts
    if ft is None or counts is None or prec.reduce is None:
        return []
    if ft.copies or (ft.full and ft.adapter):
        return [Contribution(COMMUNICATION, 0, _END, note=(
            f"FSDP hybrid sharding: each unit keeps its trainable tensors' sharded gradients in {prec.reduce} (the "
            "all-reduce's buffer) to the end of the backward; not priced where a stage trains adapters beside base "
            "weights or modules_to_save copies"))]
    trained = resolved_adapter_dtype(job) if ft.adapter else prec.grad
    if normalize_dtype(trained) == normalize_dtype(prec.reduce):
        return []
    layout = ctx.layout
    blocks = sum(counts.layers[i].trainable for i in layout.layer_indices)
    whole = blocks + (counts.root.trainable if layout.has_embedding or layout.has_head else 0)
    numel = sharded_numel(job, int(blocks * ft.trainable / whole) if whole else 0, 0)
    return [Contribution(COMMUNICATION, numel * dtype_bytes(prec.reduce), _END, note=(
        f"FSDP hybrid sharding ({replicas} replicas): each unit's trainable tensors' sharded gradients in "
        f"{prec.reduce}, the buffer all-reduced across the replicas, stay held (FSDPParamGroup._all_reduce_state) "
        f"beside the {trained} ones until the backward ends: {numel:,} elements, every decoder layer's (the "
        "root's own are not counted)"))]
