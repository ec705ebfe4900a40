"""Checks of a job against its model: TP dividing the heads, PP dividing the layers, EP dividing the
experts, fine-tuning names that exist, and the framework's own model rules (its profile's
``model_rules``). Each failure is one :class:`~memplan.errors.JobConfigError` naming the flag, the rule
and the value.
"""

from __future__ import annotations

from memplan.errors import JobConfigError
from memplan.job import Job, default_uneven_split
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import ModelSpec
from memplan.peft.checks import check_finetune_names
from memplan.profiles import get_profile
from memplan.profiles.pipeline_split import rule_chunk_layers

__all__ = ["check_recompute_modules", "check_seq_positions", "validate_job_for_model"]


def _check_attention_sinks(job: Job, model: ModelSpec) -> None:
    """PyTorch's ``scaled_dot_product_attention`` has no sink logits (gpt-oss): transformers refuses it
    for such a model (``_supports_sdpa = False``), so an estimate of it would price another model."""
    if job.attention == "sdpa" and model.has_attention_sinks:
        raise JobConfigError(
            "--attention", "sdpa cannot compute this model's attention sinks (gpt-oss; transformers has no SDPA "
            "path for them): use eager, or flash (a flash-attention kernel that takes the sinks)", job.attention)


def validate_job_for_model(job: Job, model: ModelSpec) -> None:
    """Checks that need both the job and the model; raise :class:`JobConfigError`."""
    par = job.parallel
    attn = model.layers[0].attention
    if attn.num_heads % par.tp:
        raise JobConfigError(
            "--tp", f"must divide the number of attention heads ({attn.num_heads})", par.tp
        )
    if not attention_kind(attn).tp_divides_kv_heads(attn, par.tp):
        raise JobConfigError(
            "--tp",
            f"must divide the number of key/value heads ({attn.num_kv_heads}) or be a multiple of it",
            par.tp,
        )
    check_recompute_modules(job, model)
    _check_attention_sinks(job, model)
    profile = get_profile(job.framework)
    for rule in profile.model_rules:
        rule(job, model)
    chunks = par.pp * par.vpp
    uneven = par.first_stage_layers is not None or par.last_stage_layers is not None
    if par.chunk_layers is not None:
        if sum(par.chunk_layers) != model.num_layers:
            raise JobConfigError(
                "--stage-layers",
                f"the chunks' layer counts must add up to the model's {model.num_layers} layers",
                "+".join(map(str, par.chunk_layers)),
            )
    elif uneven:
        fixed = (par.first_stage_layers or 0) + (par.last_stage_layers or 0)
        inner = par.pp - (par.first_stage_layers is not None) - (par.last_stage_layers is not None)
        rest = model.num_layers - fixed
        if rest < 0 or (inner and rest % (inner * par.vpp)) or (not inner and rest):
            raise JobConfigError(
                "--first-stage-layers/--last-stage-layers",
                f"the remaining {rest} of {model.num_layers} layers must divide evenly over the "
                f"{inner} other pipeline stages x vpp={par.vpp}",
                (par.first_stage_layers, par.last_stage_layers),
            )
    elif rule_chunk_layers(profile.pipeline_split, model.num_layers, par.pp, par.vpp):
        pass  # the framework's own split (it raises where that is impossible)
    elif model.num_layers % chunks and (par.vpp > 1 or default_uneven_split(model.num_layers, par.pp) is None):
        raise JobConfigError(
            "--pp",
            f"pp*vpp = {chunks} must divide the number of layers ({model.num_layers}); "
            "or give --first-stage-layers/--last-stage-layers or --stage-layers for an uneven split",
            par.pp,
        )
    if par.ep > 1 and not model.is_moe:
        raise JobConfigError("--ep", "needs a mixture-of-experts model (expert parallelism splits routed experts; "
                             f"{model.name} is dense); drop --ep", par.ep)
    _check_recompute_layers(job, model)
    for layer in model.layers if model.is_moe else ():
        if layer.moe is not None:
            if layer.moe.num_experts % par.ep:
                raise JobConfigError(
                    "--ep", f"must divide the number of experts ({layer.moe.num_experts})", par.ep
                )
            break
    check_finetune_names(model, job.finetune)
    if par.ep * par.expert_tp * par.pp > par.world_size or par.world_size % (par.ep * par.expert_tp * par.pp):
        raise JobConfigError(
            "--ep",
            f"ep*etp*pp = {par.ep}*{par.expert_tp}*{par.pp} must divide --gpus={par.world_size}",
            par.ep,
        )


def check_seq_positions(job: Job, model: ModelSpec) -> None:
    """A model with learned absolute positions (GPT-2) has one table row per position: --seq cannot pass it
    (Megatron asserts max_position_embeddings >= seq_length). Rotary models may extend their context.
    Checked on the user's inputs (:func:`memplan.inputs.load_job`, ``memplan fit``), not by the estimator."""
    if model.position_embedding == "learned" and job.batch.seq_length > model.max_position_embeddings:
        raise JobConfigError("--seq", f"must be at most {model.model_type}'s {model.max_position_embeddings:,} learned "
                             "positions (its position table has one row per position; a longer sequence indexes past "
                             "it). Rotary-position models may extend their context; this one cannot",
                             job.batch.seq_length)


def _check_recompute_layers(job: Job, model: ModelSpec) -> None:
    """``--recompute-layers`` within the layers a pipeline chunk holds (uniform groups of 0 layers mean nothing)."""
    rc, par = job.recompute, job.parallel
    if rc.mode != "full" or rc.num_layers is None:
        return
    per_chunk = -(-model.num_layers // (par.pp * par.vpp))
    if rc.method == "uniform" and rc.num_layers == 0:
        raise JobConfigError("--recompute-layers", "must be at least 1 with --recompute-method uniform (layers per "
                             "checkpointed group)", 0)
    if rc.num_layers > per_chunk:
        raise JobConfigError("--recompute-layers", f"must be at most the {per_chunk} layers of a pipeline chunk "
                             f"({model.num_layers} layers over pp*vpp = {par.pp * par.vpp}); give {per_chunk} to "
                             "recompute them all", rc.num_layers)


def check_recompute_modules(job: Job, model: ModelSpec) -> None:
    """Megatron's own refusals of ``--recompute-modules`` for a model without the module
    (transformer_config.py); moe and shared_experts without such layers are no-ops there too."""
    if job.recompute.mode not in ("selective", "megatron-selective") or job.recompute.modules is None:
        return
    names = job.recompute.module_names
    if "mla_up_proj" in names and not any(attention_kind(layer.attention).latent for layer in model.layers):
        raise JobConfigError("--recompute-modules", "mla_up_proj needs multi-latent attention, which this model "
                             "does not have (Megatron refuses it too)", job.recompute.modules)
    if "moe_act" in names and not model.is_moe:
        raise JobConfigError("--recompute-modules", "moe_act needs MoE layers with grouped-GEMM experts, which "
                             "this dense model does not have (Megatron refuses it without --moe-grouped-gemm)",
                             job.recompute.modules)
