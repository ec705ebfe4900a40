"""The sentences that describe the job as the estimator read it (profile, precision, layout, batch,
vocabulary, model code, attention, activation policy, dropout, MoE routing, kernels): the setting of
every stage's mechanics, whose own sentences come with their contributions (:mod:`memplan.estimate.ledger`)."""

from __future__ import annotations

from dataclasses import fields

from memplan.estimate.activations import layer_terms
from memplan.estimate.compiled import compile_note
from memplan.estimate.context import RunContext
from memplan.estimate.gpt_oss_terms import gpt_oss_notes
from memplan.estimate.recompute_modules import describe as describe_recompute
from memplan.estimate.recompute_modules import term_site
from memplan.frameworks.model_code import model_code, model_code_notes, sdpa_attention
from memplan.frozen import frozen_dataclass
from memplan.job import MoEOptions
from memplan.model.attention_kinds import attention_kind
from memplan.units import dtype_bytes

#: Checkpoint formats (``quantization_config.quant_method``) that training loads dequantized: the
#: sentence the estimate carries for each (the weights are priced in the job's own dtypes).
DEQUANTIZED_AT_LOAD = {
    "mxfp4": ("the checkpoint stores its experts in MXFP4 (config.json quantization_config.quant_method: mxfp4); "
              "priced as loaded dequantized, every weight in the job's parameter dtype, as Hugging Face "
              "fine-tuning loads it (Mxfp4Config(dequantize=True) in the TRL/PEFT recipes); training on the MXFP4 "
              "weights themselves is not modelled"),
}


def checkpoint_quantization_note(method: str) -> str:
    """What the estimate assumes of a checkpoint stored quantized (``quantization_config.quant_method``)."""
    if method in DEQUANTIZED_AT_LOAD:
        return DEQUANTIZED_AT_LOAD[method]
    return (f"the checkpoint is stored quantized (config.json quantization_config.quant_method: {method}); the "
            "weights are priced as the job says (its parameter dtype, or its --quant format), not in the stored "
            "format: Megatron-LM and torchtitan train from 16-bit or fp32 weights converted from it; keeping the stored quantized weights on the GPU while "
            f"training (e.g. transformers' {method} loader without dequantizing) is not modelled")


def run_notes(run: RunContext) -> list[str]:
    """The job's setting, one sentence each."""
    model, job, profile, prec = run.model, run.job, run.profile, run.prec
    par, b = job.parallel, job.batch
    out = [f"framework profile '{profile.name}': {profile.description}", *prec.notes]
    if model.checkpoint_quantization:
        out.append(checkpoint_quantization_note(model.checkpoint_quantization))
    out.append(
        f"layout: {par.world_size} GPU{'' if par.world_size == 1 else 's'} = dp {par.data_parallel} x tp {par.tp} "
        f"x pp {par.pp} x cp {par.cp}"
        + (f", vpp {par.vpp} (interleaved 1F1B)" if par.vpp > 1
           else (", 1F1B pipeline schedule" if par.pp > 1 else ""))
        + (", sequence parallel" if par.splits_sequence else "")
        + (f", ep {par.ep}, etp {par.expert_tp}, expert-dp {par.expert_dp}" if model.is_moe else ""))
    out.append(f"batch: micro-batch {b.micro_batch_size} x sequence {b.seq_length}, "
               f"{job.num_microbatches} micro-batch(es) per step per DP rank")
    if par.sequence_parallel and not par.splits_sequence:
        out.append("--sequence-parallel: no effect at --tp 1, there is nothing to split (Megatron warns and turns it off)")
    if run.vocab_rows != model.vocab_size:
        divisible = job.vocab_divisible_by or profile.vocab_divisible_by
        out.append(f"vocabulary {model.vocab_size} padded to {run.vocab_rows} rows (multiple of {divisible} x tp)")
    out += _attention_notes(run)
    out.append(policy_note(run))
    out += compile_note(run)
    out.append(_dropout_note(run))
    if model.is_moe:
        moe = job.moe
        routing = "balanced routing" if moe.routed_token_factor == 1.0 else (
            f"the busiest expert gets {moe.routed_token_factor:g}x its mean share of tokens"
            + (f" (capacity factor {moe.capacity_factor:g})" if moe.capacity_factor else ""))
        out.append(
            f"MoE: {routing}; {moe.dispatcher} dispatcher; experts on each rank run on tokens x top-k x etp rows "
            f"at f/etp width; shared experts "
            f"{'split by TP' if moe.shared_expert_parallel == 'tp' else 'placed with the routed experts'}")
    else:
        out += _dense_moe_settings(run)
    out.append(f"activations kept as saved by {profile.kernels} kernels")
    if model.is_moe and profile.kernels == "eager" and prec.weight_copies == "autocast":
        out.append("MoE experts (transformers grouped_mm) are not autocast ops: they run in the fp32 weights' dtype "
                   "with no 16-bit weight copies; the router's linear is cast")
    return out


#: The MoE settings of a job that gives none.
_NO_MOE_SETTINGS = MoEOptions()



#: What the model code lacks of the hidden-state dropout sites (:attr:`memplan.model.spec.ModelSpec.hidden_dropout`).
_MISSING_SITES = {"residual": "no embedding dropout", "none": "no embedding or residual dropout"}


def _dropout_note(run: RunContext) -> str:
    job, sites = run.job, run.shape.hidden_dropout_sites
    missing = (f"; {run.model.model_type}'s transformers code has {_MISSING_SITES[sites]}, so --dropout keeps no "
               "mask there" if job.dropout > 0 and sites in _MISSING_SITES else "")
    if job.attention_dropout is None:
        return ("dropout masks kept (1 byte per element)" + missing) if job.dropout > 0 else "no dropout: no masks kept"
    return (f"hidden-state dropout {job.dropout:g}, attention-probability dropout {job.attention_dropout:g}: a "
            "1-byte mask kept for each above 0 (the attention's by an unfused kernel only)" + missing)

def _dense_moe_settings(run: RunContext) -> list[str]:
    """The MoE settings a job gives that a dense model has no use for: said, not dropped silently."""
    job = run.job
    if job.moe == _NO_MOE_SETTINGS and job.parallel.expert_tp == 1:
        return []
    given = [f.metadata["flag"] if value is True else f"{f.metadata['flag']} {value}" for f in fields(MoEOptions)
             if (value := getattr(job.moe, f.name)) != getattr(_NO_MOE_SETTINGS, f.name)]
    if job.parallel.expert_tp > 1:
        given.append(f"--etp {job.parallel.expert_tp}")
    return [f"{', '.join(given)}: no effect, {run.model.name} has no MoE layers (the settings of routed experts)"]


def _attention_notes(run: RunContext) -> list[str]:
    job, prec = run.job, run.prec
    code = model_code(job)
    out = list(model_code_notes(code, job.attention, dtype_bytes(prec.compute), job.parallel.splits_sequence))
    if job.attention == "eager" and run.profile.kernels == "eager":
        dropout = ("(with attention dropout its 1-byte mask, and the dropout output in place of the cast, or beside "
                   "the softmax output where no cast runs)"
                   if run.shape.drops_attention else "(no attention dropout: no mask)")
        uncast = run.model.layers[0].attention.softmax_in_scores_dtype and not run.shape.autocast_ops
        softmax = ("the s x s softmax output in the compute dtype (this model's softmax runs in the scores' dtype, "
                   "fp32 under autocast only) is" if uncast else
                   "the fp32 s x s softmax output and its cast to the compute dtype are")
        out.append(f"eager attention (transformers eager_attention_forward): per head {softmax} "
                   f"kept {dropout}, GQA keys/values copied per query "
                   "head (repeat_kv), soft-capped scores' tanh output where the model caps them")
    elif job.attention == "eager":
        dropout = ("with attention dropout its 1-byte mask and the dropout output beside it"
                   if run.shape.drops_attention else "no attention dropout: no mask")
        out.append(f"eager attention: the s x s softmax output is kept per head ({dropout})")
    elif sdpa_attention(code, job.attention, dtype_bytes(prec.compute)) != "math":  # (math: the model code's note)
        out.append(f"{job.attention} attention: no s x s score matrix is kept, only the fp32 log-sum-exp per head "
                   "and token")
    return out + gpt_oss_notes(run.model, job.attention, run.profile.kernels)


def policy_note(run: RunContext) -> str:
    """The assumption line of the job's activation policy: its registry entry's sentence
    (:mod:`memplan.policies.kinds`), read against this estimate."""
    return run.policy.kind.sentence(run.policy, _Setting(run))


@frozen_dataclass
class _Setting:
    """What a policy's sentence reads of the estimate (:class:`memplan.policies.kinds.PolicySetting`)."""

    run: RunContext

    @property
    def autocast_weight_copies(self) -> bool:
        return self.run.prec.weight_copies == "autocast"

    def modules_sentence(self, modules: tuple[str, ...]) -> str:
        layers = {id(x): x for x in self.run.model.layers}.values()
        return describe_recompute(modules, {term_site(t) for layer in layers
                                            for t in layer_terms(layer, self.run.shape)})

    def layers_not_per_op(self) -> bool:
        return any(layer.moe is not None or not attention_kind(layer.attention).per_op_sac
                   for layer in self.run.model.layers)
