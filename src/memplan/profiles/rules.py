"""The shapes of a framework's validity rules, and the framework-specific options a profile may run.

A profile (:mod:`memplan.profiles.framework`) lists the options of :data:`FEATURES` it runs and the
rules of its own it applies to every job; :mod:`memplan.profiles.checks` refuses the rest. This
layer sits below :mod:`memplan.job` and imports nothing from it, so a rule receives the job without
naming its type (``Any``; it is always a :class:`memplan.job.Job`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.errors import JobConfigError
from memplan.frozen import frozen_dataclass

__all__ = ["FEATURES", "Feature", "JobRule", "ModelRule"]

#: A framework's rule on a job (a :class:`memplan.job.Job`): raises ``JobConfigError`` naming the flag.
JobRule = Callable[[Any], None]
#: A framework's rule on a job and its model (``Job``, ``ModelSpec``).
ModelRule = Callable[[Any, Any], None]


def _framework(job: Any) -> str:
    return f"--framework {job.framework}"


def _one_activation_mover(job: Any) -> None:
    if job.offload.activations:
        raise JobConfigError("--offload-activations", "cannot be combined with DeepSpeed's --partition-activations "
                             "/ --cpu-checkpointing (both move the saved activations); choose one", True)


@frozen_dataclass(kw_only=True)
class Feature:
    """An option only some frameworks run; a profile names the ones it has in ``features``."""

    name: str
    #: The flag a refusal names.
    flag: str
    #: What the option is, as the refusal says it (``is Megatron-LM's CUDA graphs``).
    what: str
    #: The job turns the option on.
    on: Callable[[Any], bool]
    #: The value a refusal shows (default: the job's ``--framework``).
    value: Callable[[Any], object] = _framework
    #: What the option needs of the rest of the job wherever it runs (checked right after it is allowed).
    rule: JobRule | None = None


#: Every framework-specific option, in the order a job is checked for them.
FEATURES: tuple[Feature, ...] = (
    Feature(name="partition-activations", flag="--partition-activations", what="is DeepSpeed activation "
            "checkpointing", on=lambda job: job.recompute.partition_activations, rule=_one_activation_mover),
    Feature(name="cpu-checkpointing", flag="--cpu-checkpointing", what="is DeepSpeed activation checkpointing",
            on=lambda job: job.recompute.cpu_checkpointing, rule=_one_activation_mover),
    Feature(name="tp-comm-overlap", flag="--tp-comm-overlap", what="is Megatron-LM with Transformer Engine",
            on=lambda job: job.overlap.tp),
    Feature(name="delay-wgrad", flag="--delay-wgrad-compute", what="is a Megatron-LM option",
            on=lambda job: job.overlap.delay_wgrad),
    Feature(name="early-attn-release", flag="--ep-overlap-early-attn-memory-release",
            what="is a Megatron-LM option", on=lambda job: job.overlap.early_attn_release),
    Feature(name="experts-wgrad-overlap", flag="--overlap-dispatch-backward-with-experts-wgrad",
            what="is a Megatron-LM option", on=lambda job: job.overlap.experts_wgrad_overlap),
    Feature(name="shared-expert-overlap", flag="--moe-shared-expert-overlap", what="is a Megatron-LM option",
            on=lambda job: job.overlap.shared_expert_overlap),
    Feature(name="ep-a2a-overlap", flag="--overlap-moe-expert-parallel-comm", what="is Megatron-LM's combined "
            "1F1B schedule", on=lambda job: job.overlap.ep_a2a),
    Feature(name="cuda-graphs", flag="--cuda-graph-impl", what="is Megatron-LM's CUDA graphs",
            on=lambda job: job.cuda_graphs.impl != "none"),
    Feature(name="fine-offload", flag="--offload-modules", what="is Megatron-LM's fine-grained activation "
            "offloading", on=lambda job: bool(job.offload.module_names)),
    Feature(name="distributed-optimizer", flag="--distributed-optimizer", what="is Megatron-LM's distributed "
            "optimizer (DeepSpeed shards optimizer states with --zero 1, PyTorch with --fsdp)",
            on=lambda job: job.sharding.distributed_optimizer),
    Feature(name="zero-stages", flag="--zero", what="is DeepSpeed's ZeRO (Hugging Face runs it through DeepSpeed, "
            "Megatron through Megatron-FSDP's sharding strategies); torchtitan shards with FSDP2 (--fsdp)",
            on=lambda job: job.sharding.zero > 0),
    Feature(name="local-transformer-impl", flag="--transformer-impl", what="local is Megatron-LM's own layer "
            "implementation", on=lambda job: job.transformer_impl == "local"),
)
