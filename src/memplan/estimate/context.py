"""What every mechanic of the estimator reads, derived once: :class:`RunContext` per job and
:class:`StageContext` per pipeline stage (model, job, profile, precision, resolved activation policy,
activation shape, layout, trainable/frozen counts, recomputed layers).

A mechanic (:mod:`memplan.estimate.mechanics`) takes a :class:`StageContext` instead of the whole
:class:`~memplan.job.Job`, so the profile, the policy and the fine-tuning counts are resolved here once
and never again per layer.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from memplan.estimate.activations import KEPT_BY, ActivationShape
from memplan.estimate.finetune import base_in_compute_dtype, finetune_counts, frozen_bytes_per_element, is_finetune
from memplan.estimate.layout import StageLayout
from memplan.estimate.partial_freeze import LayerFlow, layer_flows
from memplan.estimate.precision import ResolvedPrecision, resolve_precision
from memplan.estimate.recompute_modules import dropped_sites
from memplan.estimate.states import padded_vocab
from memplan.frameworks.model_code import model_code, sdpa_attention
from memplan.frozen import frozen_dataclass
from memplan.job import Job
from memplan.model.spec import ModelSpec
from memplan.peft.params import FinetuneParams
from memplan.policies import ActivationPolicy, resolve_policy
from memplan.profiles.framework import FrameworkProfile, get_profile, vocab_split
from memplan.units import dtype_bytes

#: Of one layer: (kept bytes under the job's recompute, full bytes without recompute, backward
#: transient, bytes made again at the worst point of its backward under selective recompute).
LayerCosts = tuple[int, int, int, int]


#: The policy of a new job, resolved without the Job-keyed memo in front of :func:`resolve_policy`
#: (the run context is built once per estimate, and hashing the whole job for the lookup costs more).
_resolve_policy = getattr(resolve_policy, "__wrapped__", resolve_policy)


@frozen_dataclass(kw_only=True)
class Resolved:
    """What every mechanic reads of a job, resolved once: the model, the job, its framework profile,
    precision, activation policy and activation shape."""

    model: ModelSpec
    job: Job
    profile: FrameworkProfile
    prec: ResolvedPrecision
    policy: ActivationPolicy
    shape: ActivationShape


@frozen_dataclass(kw_only=True)
class RunContext(Resolved):
    """Everything derived once per job: resolved profile, precision, policy, shape and counts."""

    vocab_rows: int
    #: Recompute classes kept and sites dropped under the policy (:func:`kept_policy`).
    kept_classes: frozenset[str]
    dropped: frozenset[str]
    #: Fine-tuning counts of the whole model (None under full training).
    counts: FinetuneParams | None
    #: What of each decoder layer needs gradients under fine-tuning (None under full training), derived
    #: once per job: the layer walk reads it per layer (:mod:`~memplan.estimate.partial_freeze`).
    flows: tuple[LayerFlow, ...] | None
    fragmentation: float
    #: Per-layer costs memoised by the layer's kind (shared by the stages of one estimate).
    cache: dict[object, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def finetune(self) -> bool:
        return self.counts is not None


@frozen_dataclass(kw_only=True)
class StageContext(Resolved):
    """One pipeline stage of one job: the run's context plus the stage's layout and recomputed layers.

    The run's :class:`Resolved` fields are copied in when the context is built (:func:`stage_context`),
    so a mechanic reads ``ctx.job`` as an attribute, not through the run."""

    run: RunContext
    layout: StageLayout
    #: Layers of this stage that run under full recompute.
    recomputed: frozenset[int]
    #: Layers per checkpointed group (Megatron ``uniform`` with ``--recompute-num-layers N``; else 1).
    group: int


def run_context(model: ModelSpec, job: Job, fragmentation: float, profile: FrameworkProfile | None = None) -> RunContext:
    """The job's context (the job validated for the model already), under ``profile`` (None: its framework's)."""
    profile = profile or get_profile(job.framework)
    prec = resolve_precision(job, profile)
    policy = _resolve_policy(job)
    kept_classes, dropped = kept_policy(policy)
    divisible = job.vocab_divisible_by or profile.vocab_divisible_by
    finetune = is_finetune(job)
    return RunContext(
        model=model, job=job, profile=profile, prec=prec, policy=policy,
        shape=activation_shape(model, job, profile, prec),
        vocab_rows=padded_vocab(model, job.parallel.tp, divisible),
        kept_classes=kept_classes, dropped=dropped,
        counts=finetune_counts(model, job) if finetune else None,
        flows=layer_flows(model, job.finetune, policy.input_grads, own_layers=profile.kernels != "eager")
        if finetune else None,
        fragmentation=fragmentation,
    )


def stage_context(run: RunContext, layout: StageLayout) -> StageContext:
    rc = run.job.recompute
    group = (rc.num_layers or 1) if rc.method == "uniform" else 1
    return StageContext(run=run, layout=layout, recomputed=frozenset(recomputed_layers(layout, run)), group=group,
                        model=run.model, job=run.job, profile=run.profile, prec=run.prec, policy=run.policy,
                        shape=run.shape)


def kept_policy(policy: ActivationPolicy) -> tuple[frozenset[str], frozenset[str]]:
    """(recompute classes kept, sites dropped) under ``policy``: Megatron's selective recompute drops
    the sites of its ``--recompute-modules`` (:mod:`memplan.estimate.recompute_modules`)."""
    if not policy.kind.drops_modules:
        return KEPT_BY[policy.kept_classes_key], frozenset()
    return KEPT_BY["selective"] | {"core"}, dropped_sites(policy.modules)


def recomputed_layers(layout: StageLayout, run: RunContext) -> set[int]:
    """Layers of this stage that run under full recompute (Megatron's uniform/block methods)."""
    rc = run.job.recompute
    if not run.policy.kind.checkpoints_layers:
        return set()
    if rc.method == "uniform" or rc.num_layers is None:
        return set(layout.layer_indices)
    chosen: set[int] = set()
    for chunk in layout.chunks:
        chosen.update(chunk[: rc.num_layers])
    return chosen


def activation_shape(model: ModelSpec, job: Job, profile: FrameworkProfile, prec: ResolvedPrecision) -> ActivationShape:
    """The activation shape of one micro-batch on one rank of ``job``."""
    par = job.parallel
    seq_local = job.batch.seq_length // par.cp
    base16 = base_in_compute_dtype(model, job)
    code = model_code(job)
    return ActivationShape(
        seq=seq_local,
        kv_seq=seq_local,
        micro_batch=job.batch.micro_batch_size,
        hidden=model.hidden_size,
        tp=par.tp,
        vocab_tp=vocab_split(profile, par.tp),
        sequence_parallel=par.splits_sequence,
        act_bytes=prec.act_bytes,
        residual_bytes=dtype_bytes(prec.compute if base16 else prec.residual),
        attention=sdpa_attention(code, job.attention, prec.act_bytes),
        dropout=job.dropout > 0,
        attention_dropout=None if job.attention_dropout is None else job.attention_dropout > 0,
        hidden_dropout_sites="embedding-and-residual" if profile.own_hidden_dropout else model.hidden_dropout,
        kernels=profile.kernels,
        expert_tp=par.expert_tp,
        fp8=job.precision.fp8 is not None,
        routed_factor=rank_routed_factor(model, job),
        dispatcher=job.moe.dispatcher,
        ep=par.ep,
        norm=model.norm,
        autocast=prec.weight_copies == "autocast" and not base16,
        autocast_ops=prec.weight_copies == "autocast",
        expert_bytes=prec.act_bytes if base16 else _expert_bytes(profile, prec, job),
        norm_fp32_scale=model.norm_fp32_scale,
        rope=model.position_embedding == "rope",
        moe_probs_at=profile.moe_probs_at,
        grouped_experts_combine=profile.kernels == "eager" and code.stacked_gate_up,
        fused_rms_norm=code.fused_rms_norm,
        gathered_gemm_inputs=code.sp_saves_gathered_input,
        rope_buffer=code.rope_buffer,
    )


def _expert_bytes(profile: FrameworkProfile, prec: ResolvedPrecision, job: Job) -> int:
    """Bytes per element of routed-expert activations: HF's grouped experts (eager profiles) cast
    their input to the weights' dtype instead of following autocast (transformers
    ``integrations/moe.py`` ``_grouped_mm``; in fine-tuning the frozen weights' dtype, a trained layer's experts
    are priced in the trained dtype by :mod:`memplan.estimate.trained_dtypes`); fused kernels compute in the
    compute dtype."""
    if profile.kernels == "eager" and prec.weight_copies == "autocast":
        return frozen_bytes_per_element(job) if is_finetune(job) else dtype_bytes(prec.param)
    return dtype_bytes(prec.compute)


def rank_routed_factor(model: ModelSpec, job: Job) -> float:
    """Rows the busiest expert-parallel rank receives relative to balanced routing.

    ``--moe-imbalance F`` is per expert (the busiest expert gets F x the mean). A rank holding
    ``n = experts / ep`` experts gets at most the busiest one plus ``n - 1`` average ones:
    ``(F + n - 1) / n``. With ``ep = 1`` every routed token is local and the factor is 1. Capacity
    caps each expert, so also the rank (padding to capacity fills it exactly).
    """
    if not model.is_moe:
        return 1.0
    moe = next(layer.moe for layer in model.layers if layer.moe is not None)
    options = job.moe
    if options.pad_to_capacity and options.capacity_factor is not None:
        return float(options.capacity_factor)
    if job.parallel.ep == 1:
        return 1.0
    per_rank = max(1, moe.num_experts // job.parallel.ep)
    return (options.routed_token_factor + per_rank - 1) / per_rank
