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

Known limitations: the units' shards are priced without FSDP2's per-parameter padding; the buffers a head unit
apart from the embedding would hold during the blocks' backward are not priced (the profile that has one,
torchtitan, reduces in the gradients' dtype); fine-tuning (trainable adapters or modules) is said, not priced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import COMMUNICATION, Contribution
from memplan.estimate.states import sharded_numel
from memplan.units import dtype_bytes

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
    if job.sharding.fsdp != "hybrid" or replicas < 2 or prec.reduce in (None, prec.grad):
        return []
    if st.ft is not None:
        return [Contribution(COMMUNICATION, 0, _END, note=(
            f"FSDP hybrid sharding: each unit keeps its sharded gradients in {prec.reduce} (the all-reduce's buffer) "
            "to the end of the backward; not priced under fine-tuning"))]
    numel = sharded_numel(job, max(st.params.dense - last_unit, 0), st.params.expert)
    return [Contribution(COMMUNICATION, numel * dtype_bytes(prec.reduce), _END, note=(
        f"FSDP hybrid sharding ({replicas} replicas): each unit's sharded gradients in {prec.reduce}, the buffer "
        "all-reduced across the replicas, stay held (FSDPParamGroup._all_reduce_state) beside the "
        f"{prec.grad} ones until the backward ends: {numel:,} elements of the units before the last"))]
