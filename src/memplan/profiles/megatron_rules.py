"""Megatron-LM's own assertions on a job, as its ``TransformerConfig.__post_init__`` and argument
checks make them (megatron/core/transformer/transformer_config.py, megatron/training/arguments.py).

They belong to the Megatron profile (``MEGATRON.job_rules`` / ``model_rules``), which
:class:`memplan.job.Job` and :func:`memplan.jobcheck.validate_job_for_model` run for ``--framework
megatron``; the options they constrain are Megatron's only, so another framework refuses them
first (:data:`memplan.profiles.rules.FEATURES`). Each rule receives the ``Job`` (and ``ModelSpec``).
"""

from __future__ import annotations

from typing import Any

from memplan.errors import JobConfigError

__all__ = ["JOB_RULES", "MODEL_RULES"]

_A2A = "--overlap-moe-expert-parallel-comm"
#: Megatron's selective recompute (``--recompute selective`` is it under Megatron).
_SELECTIVE = ("selective", "megatron-selective")


def _recomputes_module(job: Any, module: str) -> bool:
    return job.recompute.mode in _SELECTIVE and module in job.recompute.module_names


def ep_overlap_options(job: Any) -> None:
    """The expert-parallel overlap options that need, or exclude, the combined 1F1B schedule."""
    ov = job.overlap
    for flag, on in (("--delay-wgrad-compute", ov.delay_wgrad),
                     ("--ep-overlap-early-attn-memory-release", ov.early_attn_release)):
        if on and not ov.ep_a2a:
            raise JobConfigError(flag, f"needs {_A2A} (Megatron asserts it)", "combined 1F1B off")
    for flag, on in (("--overlap-dispatch-backward-with-experts-wgrad", ov.experts_wgrad_overlap),
                     ("--moe-shared-expert-overlap", ov.shared_expert_overlap)):
        if on and ov.ep_a2a:
            raise JobConfigError(flag, f"cannot be combined with {_A2A} (Megatron asserts it)", True)


def ep_overlap(job: Any) -> None:
    """``--overlap-moe-expert-parallel-comm`` (the combined 1F1B schedule)."""
    if not job.overlap.ep_a2a:
        return
    par = job.parallel
    if par.ep == 1:
        raise JobConfigError(_A2A, "needs expert parallelism > 1 (Megatron asserts it)", f"ep={par.ep}")
    if job.moe.dispatcher == "allgather":
        raise JobConfigError(_A2A, "needs the alltoall or flex dispatcher (Megatron asserts it)", "allgather")
    if job.recompute.mode == "full":
        raise JobConfigError(_A2A, "cannot be combined with full recompute (Megatron asserts it)", "full")
    if _recomputes_module(job, "moe"):
        raise JobConfigError(_A2A, "cannot be combined with --recompute-modules moe (Megatron asserts it)",
                             job.recompute.modules)
    if par.pp > 1 and par.vpp == 1:
        raise JobConfigError(_A2A, "needs a virtual pipeline with pipeline parallelism (Megatron asserts one "
                             "is set; memplan prices it with --num-virtual-stages-per-pipeline-rank > 1)",
                             f"pp={par.pp}, vpp=1")


def cuda_graphs(job: Any) -> None:
    """``--cuda-graph-impl`` and ``--cuda-graph-modules``."""
    graphs = job.cuda_graphs
    if graphs.impl == "none":
        return
    if job.offload.activations and graphs.impl != "full_iteration":
        raise JobConfigError("--cuda-graph-impl", "per-layer CUDA graphs cannot be combined with CPU activation "
                             "offloading (Megatron refuses it)", graphs.impl)
    names = graphs.module_names
    if "moe" in names and "moe_router" in names:
        raise JobConfigError("--cuda-graph-modules", "must not contain both moe and moe_router (Megatron asserts "
                             "it)", graphs.modules)
    if "moe" in names and not (job.moe.pad_to_capacity and job.moe.capacity_factor is not None):
        raise JobConfigError("--cuda-graph-modules", "moe needs drop-and-pad MoE (--capacity-factor with "
                             "--pad-to-capacity; Megatron asserts it)", graphs.modules)


def fine_offload(job: Any) -> None:
    """Fine-grained activation offloading (``--offload-modules``)."""
    names = job.offload.module_names
    if not names:
        return
    if job.transformer_impl != "transformer_engine":
        raise JobConfigError("--offload-modules", "needs --transformer-impl transformer_engine (Megatron asserts "
                             "it)", job.transformer_impl)
    inside_moe = {"moe_act", "expert_fc1", "fused_group_mlp"} & set(names)
    if inside_moe and _recomputes_module(job, "moe"):
        raise JobConfigError("--offload-modules", f"cannot offload {', '.join(sorted(inside_moe))} while "
                             "--recompute-modules moe recomputes the whole MoE layer (Megatron refuses it)",
                             job.offload.modules)


def tp_comm_overlap(job: Any) -> None:
    """``--tp-comm-overlap`` (Transformer Engine's userbuffers)."""
    par = job.parallel
    if job.overlap.tp and not (par.tp > 1 and par.sequence_parallel):
        raise JobConfigError("--tp-comm-overlap", "needs tensor parallelism > 1 with --sequence-parallel "
                             "(Megatron asserts it)", f"tp={par.tp}, sequence_parallel={par.sequence_parallel}")


def cuda_graph_modules(job: Any, model: Any) -> None:
    """``--cuda-graph-modules`` the model has no layers for."""
    names = job.cuda_graphs.module_names
    if ("moe" in names or "moe_router" in names) and not model.is_moe:
        raise JobConfigError("--cuda-graph-modules", "moe and moe_router need MoE layers, which this dense model does "
                             "not have (Megatron refuses it too)", job.cuda_graphs.modules)
    if "mlp" in names and all(layer.moe is not None for layer in model.layers):
        raise JobConfigError("--cuda-graph-modules", "mlp captures dense MLPs, and every layer of this model is MoE "
                             "(Megatron refuses it too)", job.cuda_graphs.modules)


def shared_expert_overlap(job: Any, model: Any) -> None:
    """``--moe-shared-expert-overlap`` on a model with shared experts (without them it does nothing)."""
    if not job.overlap.shared_expert_overlap or not any(
            layer.moe is not None and layer.moe.shared_expert is not None for layer in model.layers):
        return
    flag = "--moe-shared-expert-overlap"
    if job.moe.dispatcher not in ("alltoall", "flex"):
        raise JobConfigError(flag, "needs the alltoall or flex dispatcher (Megatron refuses it)", job.moe.dispatcher)
    if _recomputes_module(job, "shared_experts"):
        raise JobConfigError(flag, "cannot be combined with --recompute-modules shared_experts (Megatron refuses "
                             "it)", job.recompute.modules)


#: In the order Job validation runs them.
JOB_RULES = (ep_overlap_options, ep_overlap, cuda_graphs, fine_offload, tp_comm_overlap)
MODEL_RULES = (cuda_graph_modules, shared_expert_overlap)
