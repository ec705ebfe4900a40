"""Mechanic: the buffers and workspaces a stage keeps for the whole run, in PyTorch's allocator
(cuBLAS / Transformer Engine workspaces, FP8 scaling state, Megatron's global memory buffer) and
outside it (Transformer Engine userbuffers, DeepEP / HybridEP dispatch buffers)."""

from __future__ import annotations

from collections.abc import Iterator

from memplan.estimate.context import StageContext
from memplan.estimate.deepep import deepep_buffer_bytes
from memplan.estimate.global_buffer import local_impl_requests
from memplan.estimate.hybridep import hybridep_buffer_bytes
from memplan.estimate.ledger import OUTSIDE, WORKSPACE, Contribution
from memplan.estimate.tp_comm_overlap import describe as describe_tp_overlap
from memplan.estimate.tp_comm_overlap import ub_workspace_bytes, userbuffers_bytes
from memplan.profiles.framework import (
    TE_CUBLAS_WORKSPACE_BYTES,
    TE_GROUPED_GEMM_WORKSPACE_BYTES,
    TE_GROUPED_GEMM_WORKSPACES,
)

#: Transformer Engine's per-GEMM FP8 scaling state: amax history and scale for the input, the
#: weight and the output gradient, fp32 (history length 1024 by TE's default recipe).
FP8_AMAX_HISTORY = 1024

_LOCAL_NOTE = ("--transformer-impl local: Megatron's global memory buffer holds the largest of the layers' "
               "sequence-parallel input gathers, the unfused attention's raw scores and the all-gather MoE "
               "dispatcher's tokens (workspace); its layers run torch matmuls, so Transformer Engine's cuBLAS "
               "workspace is not made")


def stage_buffers(ctx: StageContext) -> Iterator[Contribution]:
    """The stage's workspaces (lifetime, in the allocator) and buffers outside the allocator."""
    job = ctx.job
    local = job.transformer_impl == "local"
    yield Contribution(WORKSPACE, _profile_workspace(ctx), note=_LOCAL_NOTE if local else "")
    yield Contribution(WORKSPACE, fp8_scaling_bytes(ctx))
    yield Contribution(WORKSPACE, grouped_gemm_workspace_bytes(ctx))
    yield Contribution(WORKSPACE, global_buffer_bytes(ctx))
    if ctx.layout.layer_indices and not local:
        # made by the first overlapped TE GEMM (local layers have none; the userbuffers exist anyway)
        yield Contribution(WORKSPACE, ub_workspace_bytes(job.overlap))
    shape, par = ctx.shape, job.parallel
    tokens = shape.seq * shape.micro_batch
    fp8 = job.precision.fp8 is not None
    yield Contribution(OUTSIDE, userbuffers_bytes(job.overlap, tokens=tokens, hidden=ctx.model.hidden_size,
                                                  tp=par.tp, fp8=fp8, world_size=par.world_size),
                       note=describe_tp_overlap(job.overlap, tokens=tokens, hidden=ctx.model.hidden_size, tp=par.tp,
                                                fp8=fp8, world_size=par.world_size) if job.overlap.tp else "")
    yield from _flex_dispatch(ctx)


def _flex_dispatch(ctx: StageContext) -> Iterator[Contribution]:
    """DeepEP's or HybridEP's buffer, made by the first flex dispatch of a stage with MoE layers
    (outside the allocator)."""
    job, model = ctx.job, ctx.model
    if not (ctx.profile.flex_dispatch_buffers and job.moe.dispatcher == "flex" and model.is_moe):
        return
    ov, par = job.overlap, job.parallel
    group = par.expert_tp * par.ep
    moe_layers = [moe for i in ctx.layout.layer_indices if (moe := model.layers[i].moe) is not None]
    if ov.flex_backend == "deepep":
        note = (f"DeepEP's buffer on the etp x ep group of {group} ranks ({ov.flex_num_sms or 20} SMs; NVLink "
                "receive slots, 32 MiB workspace, RDMA slots past 8 ranks) allocated outside PyTorch's allocator "
                "(outside_allocator_bytes)")
        size = deepep_buffer_bytes(hidden=model.hidden_size, act_bytes=ctx.shape.act_bytes, group=group,
                                   num_sms=ov.flex_num_sms) if moe_layers else 0
    elif ov.flex_backend == "hybridep":
        note = (f"HybridEP's shared dispatch/combine buffer on the etp x ep group of {group} ranks (every token of "
                "the group able to land on one rank: 16-bit tokens, fp32 probabilities per local expert and domain "
                "rank, FP8 scales, flags), 8 ranks per NVLink domain, allocated outside PyTorch's allocator "
                "(outside_allocator_bytes); RDMA staging across domains not priced")
        size = hybridep_buffer_bytes(
            hidden=model.hidden_size, tokens=ctx.shape.local_tokens, group=group,
            local_experts=max(m.num_experts for m in moe_layers) // par.ep) if moe_layers else 0
    else:
        note, size = f"{ov.flex_backend}'s buffers are not priced", 0
    yield Contribution(OUTSIDE, size, note="flex dispatcher: " + note + "; tokens priced as the all-to-all "
                                                                         "dispatcher's")


def fp8_scaling_bytes(ctx: StageContext) -> int:
    """FP8 scaling state of the stage's linear layers (delayed scaling): small but real."""
    if ctx.job.precision.fp8 is None:
        return 0
    gemms_per_layer = 4  # qkv (or q/kv down/up), output projection, fc1, fc2
    tensors = 3
    return ctx.layout.num_layers * gemms_per_layer * tensors * (FP8_AMAX_HISTORY + 2) * 4


def grouped_gemm_workspace_bytes(ctx: StageContext) -> int:
    """Transformer Engine's per-stream cuBLAS workspaces of its grouped GEMM (``--moe-grouped-gemm``),
    allocated once a stage runs its experts (:data:`TE_GROUPED_GEMM_WORKSPACES`)."""
    if not ctx.job.moe.grouped_gemm or not ctx.profile.te_grouped_gemm_workspaces:
        return 0
    if not any(ctx.model.layers[i].moe is not None for i in ctx.layout.layer_indices):
        return 0
    return TE_GROUPED_GEMM_WORKSPACES * TE_GROUPED_GEMM_WORKSPACE_BYTES


def _profile_workspace(ctx: StageContext) -> int:
    """The profile's library workspaces; Megatron's local layers run torch matmuls only, so Transformer
    Engine's cuBLAS workspace (``get_workspace``) is never made under ``--transformer-impl local``."""
    if ctx.profile.local_transformer_impl and ctx.job.transformer_impl == "local":
        return ctx.profile.workspace_bytes - TE_CUBLAS_WORKSPACE_BYTES
    return ctx.profile.workspace_bytes


def global_buffer_bytes(ctx: StageContext) -> int:
    """Megatron's ``"mpu"`` global memory buffer: the largest request of the all-gather MoE dispatcher
    and, under ``--transformer-impl local``, of the layers' sequence-parallel gathers and unfused
    attention scores (:mod:`memplan.estimate.global_buffer`)."""
    moe = moe_allgather_buffer_bytes(ctx)
    if not ctx.profile.local_transformer_impl or ctx.job.transformer_impl != "local":
        return moe
    return max(moe, local_impl_requests(ctx.model, ctx.layout.layer_indices, ctx.shape,
                                        eager_attention=ctx.job.attention == "eager"))


def moe_allgather_buffer_bytes(ctx: StageContext) -> int:
    """Megatron's all-gather token dispatcher gathers every token of its expert-TP x EP group into the
    global memory buffer, which is kept for the rest of the run.

    ``MoEAllGatherTokenDispatcher.token_dispatch`` calls ``gather_from_sequence_parallel_region(...,
    use_global_buffer=True)`` (megatron/core/transformer/moe/token_dispatcher.py): the output is a view
    of ``GlobalMemoryBuffer.get_tensor(..., "mpu")`` (megatron/core/utils.py), a tensor the buffer
    allocates at the largest size asked for and never frees. Its size: the MoE layer's tokens on one
    rank (``s/cp * b``, divided by TP under sequence parallelism) times ``etp * ep`` rows of the hidden
    size in the activation dtype; no gather (and no buffer) when ``etp * ep == 1``. With
    ``--transformer-impl local`` the same buffer also serves the unfused attention scores and the
    sequence-parallel all-gathers of the linear layers (the largest wins: :func:`global_buffer_bytes`).
    """
    job, shape = ctx.job, ctx.shape
    if not ctx.profile.global_memory_buffer or job.moe.dispatcher != "allgather":
        return 0
    group = job.parallel.expert_tp * job.parallel.ep
    if group == 1 or not any(ctx.model.layers[i].moe is not None for i in ctx.layout.layer_indices):
        return 0
    return shape.local_tokens * group * shape.hidden * shape.act_bytes
