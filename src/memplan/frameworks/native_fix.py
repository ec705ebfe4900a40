"""A job change in the framework's own settings: what a memplan fix means in the run the user launches.

``memplan doctor`` and ``memplan estimate --gpu`` propose changes as memplan flags (``--mbs 1 --zero 3``). A
Megatron-LM user launches with Megatron's arguments, a DeepSpeed user edits a JSON config, a Hugging Face user
passes TrainingArguments and a torchtitan user edits a TOML. :func:`native_change` says the same change in the
job's framework: each setting is the one memplan's own reader of that dialect maps to the changed field
(:mod:`memplan.frameworks.megatron_args`, :mod:`~memplan.frameworks.deepspeed_config`,
:mod:`~memplan.frameworks.hf_args`, :mod:`~memplan.frameworks.torchtitan_config`), so the settings read back
give the job the fix priced (tests/frameworks/test_native_fix.py reads every fix back).

What a framework has no setting for, or runs differently from what was priced, is said in ``notes``, never
dropped: Megatron-LM has no LoRA, DeepSpeed's config does not turn recompute on (the model code does),
Hugging Face's FSDP offload moves the parameters with the optimizer states.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from memplan.frozen import frozen_dataclass
from memplan.job import Job
from memplan.profiles.partial_recompute import every_nth_counts

__all__ = ["NativeChange", "NativeSetting", "native_change", "native_lines"]


@frozen_dataclass
class NativeSetting:
    """One setting of the framework's dialect: a Megatron flag (``True``: a bare switch), a DeepSpeed config
    key or torchtitan TOML key (dotted: ``zero_optimization.stage``), a TrainingArguments field."""

    key: str
    value: Any


@frozen_dataclass
class NativeChange:
    """A job change said in its framework's settings."""

    #: Where the settings go: ``Megatron-LM arguments``, ``DeepSpeed config``, ``TrainingArguments``,
    #: ``torchtitan TOML``.
    dialect: str
    settings: tuple[NativeSetting, ...]
    #: What the settings do not carry: a change the framework has no setting for, or runs otherwise.
    notes: tuple[str, ...] = ()
    #: How the settings are written: ``flags`` (``--key value``), ``keys`` (``key = value``).
    style: str = "flags"

    def text(self) -> str:
        """The settings as the user types them, e.g. ``--micro-batch-size 1 --use-distributed-optimizer``."""
        if self.style == "keys":
            return ", ".join(f"{s.key} = {json.dumps(s.value)}" for s in self.settings)
        words = []
        for s in self.settings:
            words.append(s.key)
            if s.value is not True:
                words.append(shlex.quote(str(s.value)))
        return " ".join(words)

    def to_dict(self) -> dict[str, Any]:
        return {"dialect": self.dialect, "text": self.text(),
                "settings": [{"key": s.key, "value": s.value} for s in self.settings], "notes": list(self.notes)}


def native_change(before: Job, after: Job, *, rank_layers: Sequence[int] | None = None) -> NativeChange | None:
    """``after`` (a change of ``before``) in ``before``'s framework's settings; None for a framework without a
    dialect here. ``rank_layers`` (the decoder layers each pipeline rank of ``after`` holds) lets a partial
    recompute be said as torchtitan's every-N-th-layer checkpointing."""
    render = _DIALECTS.get(before.framework)
    return None if render is None else render(before, after, rank_layers)


def native_lines(native: dict[str, Any] | None) -> list[str]:
    """A change in its framework's settings (``NativeChange.to_dict()``, as ``--json`` carries it), for people:
    ``Megatron-LM arguments: --micro-batch-size 1``, then what those settings do not carry, in parentheses."""
    if not native:
        return []
    lines = [f"{native['dialect']}: {native['text']}"] if native["text"] else []
    return lines + [f"({note})" for note in native["notes"]]


# --- what changed, in the terms every dialect shares ---

def _batch(before: Job, after: Job, micro: str, total: str = "", steps: str = "") -> list[NativeSetting]:
    """The micro-batch under the dialect's key, and the global batch (``total``) or the accumulation steps."""
    if before.batch == after.batch:
        return []
    out = [NativeSetting(micro, after.batch.micro_batch_size)]
    if total and after.batch.global_batch_size is not None:
        out.append(NativeSetting(total, after.batch.global_batch_size))
    if steps:
        out.append(NativeSetting(steps, after.num_microbatches))
    return out


def _recompute_changed(before: Job, after: Job) -> bool:
    """What a dialect writes of recompute changed: its mode, method or layer count."""
    r0, r1 = before.recompute, after.recompute
    return (r0.mode, r0.method, r0.num_layers) != (r1.mode, r1.method, r1.num_layers)


def _layout(job: Job) -> tuple[Any, ...]:
    """The parallel layout but its size: the GPUs (and so the data-parallel size) are the launcher's."""
    p = job.parallel
    return (p.tp, p.pp, p.vpp, p.cp, p.ep, p.etp, p.sequence_parallel, p.first_stage_layers, p.last_stage_layers,
            p.chunk_layers, p.microbatch_group_size)


def _unrendered(before: Job, after: Job, rendered: tuple[str, ...]) -> list[str]:
    """The job's top-level settings that changed but no rule of the dialect rendered: named, never dropped (the
    GPU count is the launcher's, not a setting)."""
    from dataclasses import fields

    changed = [f.name for f in fields(Job) if f.name not in rendered and getattr(before, f.name) != getattr(after, f.name)]
    if "parallel" in changed and _layout(before) == _layout(after):
        changed.remove("parallel")
    return [f"memplan's {name} changed, which this dialect's settings do not say" for name in changed]


_RENDERED = ("batch", "recompute", "sharding", "offload", "finetune", "loss")


def _finetune_notes(before: Job, after: Job, framework_words: str) -> list[str]:
    if before.finetune == after.finetune:
        return []
    ft = after.finetune
    quant = f" on a base quantized by bitsandbytes ({ft.quant_kind.name})" if ft.quant_kind.quantizes else ""
    return [f"{ft.peft_kind.description} (rank {ft.lora_rank}){quant}: {framework_words}"]


def _loss_notes(before: Job, after: Job, framework: str) -> list[str]:
    if before.loss == after.loss:
        return []
    return [(f"a {after.loss} cross-entropy loss: {framework} has no setting for it; it is a change to the training "
             "code (a loss computed over chunks of the sequence, never holding the whole logits)")]


# --- Megatron-LM (read back by memplan.frameworks.megatron_args) ---

#: ``--data-parallel-sharding-strategy`` of Megatron-FSDP for a ZeRO stage (megatron_args._sharding reads it back).
_MEGATRON_STRATEGY = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def _megatron_parallel(before: Job, after: Job) -> tuple[list[NativeSetting], list[str]]:
    """The layout in Megatron's arguments (megatron_args.megatron_job reads them back); the data-parallel size is
    the launcher's GPUs over the rest, so no flag says it."""
    p0, p1 = before.parallel, after.parallel
    if p0 == p1:
        return [], []
    out = [NativeSetting(flag, new) for flag, old, new in (
        ("--tensor-model-parallel-size", p0.tp, p1.tp), ("--pipeline-model-parallel-size", p0.pp, p1.pp),
        ("--num-virtual-stages-per-pipeline-rank", p0.vpp, p1.vpp), ("--context-parallel-size", p0.cp, p1.cp),
        ("--expert-model-parallel-size", p0.ep, p1.ep),
        ("--decoder-first-pipeline-num-layers", p0.first_stage_layers, p1.first_stage_layers),
        ("--decoder-last-pipeline-num-layers", p0.last_stage_layers, p1.last_stage_layers)) if old != new and new]
    if p1.expert_tp != p1.tp and (p1.ep > 1 or p1.etp is not None):  # Megatron's expert TP defaults to TP
        out.append(NativeSetting("--expert-tensor-parallel-size", p1.expert_tp))
    if p1.sequence_parallel and not p0.sequence_parallel:
        out.append(NativeSetting("--sequence-parallel", True))
    notes = []
    if p1.chunk_layers != p0.chunk_layers and p1.chunk_layers:
        notes.append("the per-chunk layer counts go in --pipeline-model-parallel-layout, which this does not write")
    return out, notes


def _megatron(before: Job, after: Job, rank_layers: Sequence[int] | None = None) -> NativeChange:
    out, notes = _megatron_parallel(before, after)
    out += _batch(before, after, "--micro-batch-size", total="--global-batch-size")
    if _recompute_changed(before, after):
        r = after.recompute
        out.append(NativeSetting("--recompute-granularity", r.mode))
        if r.mode == "full":
            out += [NativeSetting("--recompute-method", r.method), NativeSetting("--recompute-num-layers",
                                                                                r.num_layers or 1)]
    s0, s1 = before.sharding, after.sharding
    if s0 != s1:
        if s1.zero or s1.fsdp != "none":
            stage = s1.zero if s1.zero else 3
            out += [NativeSetting("--use-megatron-fsdp", True),
                    NativeSetting("--data-parallel-sharding-strategy", _MEGATRON_STRATEGY[stage])]
            if s1.fsdp != "none":
                notes.append("Megatron-LM shards everything through Megatron-FSDP (optim_grads_params), which memplan "
                             "prices as ZeRO stage 3; PyTorch FSDP's own buffers were priced for this fix")
        if s1.distributed_optimizer and not s0.distributed_optimizer:
            out.append(NativeSetting("--use-distributed-optimizer", True))
    if after.offload.optimizer and not before.offload.optimizer:
        out.append(NativeSetting("--optimizer-cpu-offload", True))
    if after.offload.params and not before.offload.params:
        notes.append("Megatron-LM has no setting that keeps the sharded parameters in CPU memory")
    notes += _finetune_notes(before, after, "Megatron-LM has no adapter setting (NeMo / Megatron-Bridge PEFT trains "
                                            "adapters on Megatron models)")
    notes += _loss_notes(before, after, "Megatron-LM")
    notes += _unrendered(before, after, (*_RENDERED, "parallel"))
    return NativeChange("Megatron-LM arguments", tuple(out), tuple(notes))


# --- DeepSpeed config (read back by memplan.frameworks.deepspeed_config) ---

_DS_RECOMPUTE = ("recompute ({mode}) is turned on in the model code, not in the DeepSpeed config (Hugging Face: "
                 "model.gradient_checkpointing_enable(); Megatron-DeepSpeed: --checkpoint-activations)")


def _deepspeed(before: Job, after: Job, rank_layers: Sequence[int] | None = None) -> NativeChange:
    out: list[NativeSetting] = []
    notes: list[str] = []
    out += _batch(before, after, "train_micro_batch_size_per_gpu", steps="gradient_accumulation_steps")
    if _recompute_changed(before, after):
        notes.append(_DS_RECOMPUTE.format(mode=after.recompute.mode))
    if before.sharding.zero != after.sharding.zero:
        out.append(NativeSetting("zero_optimization.stage", after.sharding.zero))
    if before.offload.optimizer != after.offload.optimizer:
        out.append(NativeSetting("zero_optimization.offload_optimizer.device", "cpu" if after.offload.optimizer
                                 else "none"))
    if before.offload.params != after.offload.params:
        out.append(NativeSetting("zero_optimization.offload_param.device", "cpu" if after.offload.params else "none"))
    notes += _finetune_notes(before, after, "peft's LoraConfig in the training script (DeepSpeed's config has no "
                                            "adapter setting)")
    notes += _loss_notes(before, after, "DeepSpeed")
    notes += _unrendered(before, after, _RENDERED)
    return NativeChange("DeepSpeed config", tuple(out), tuple(notes), style="keys")


# --- Hugging Face TrainingArguments (read back by memplan.frameworks.hf_args) ---

def _hf(before: Job, after: Job, rank_layers: Sequence[int] | None = None) -> NativeChange:
    out: list[NativeSetting] = []
    notes: list[str] = []
    out += _batch(before, after, "--per_device_train_batch_size", steps="--gradient_accumulation_steps")
    if _recompute_changed(before, after):
        if after.recompute.mode == "full":
            out.append(NativeSetting("--gradient_checkpointing", True))
        else:
            notes.append(f"recompute ({after.recompute.mode}: each attention module checkpointed) has no "
                         "TrainingArguments field; wrap the attention modules in torch.utils.checkpoint in the model code")
    s0, s1 = before.sharding, after.sharding
    offload = before.offload.optimizer != after.offload.optimizer
    if s0 != s1 or offload:
        if s1.fsdp != "none":
            words = {"full": "full_shard", "hybrid": "hybrid_shard"}[s1.fsdp]
            shard_offload = offload and s1.fsdp != "none"
            out.append(NativeSetting("--fsdp", f"{words}{' offload' if shard_offload else ''} auto_wrap"))
            if shard_offload and not after.offload.params:
                notes.append("FSDP's CPU offload moves the sharded parameters with the optimizer states: the run "
                             "holds less GPU memory than this fix's figure, and its step is slower")
        if s1.zero:
            zero: dict[str, Any] = {"stage": s1.zero}
            if after.offload.optimizer:
                zero["offload_optimizer"] = {"device": "cpu"}
            # TrainingArguments reads a value starting with "{" as the config itself (else a file's path)
            out.append(NativeSetting("--deepspeed", json.dumps({"zero_optimization": zero})))
    if before.finetune != after.finetune:
        out += _trl_peft(after)
    notes += _loss_notes(before, after, "Hugging Face's Trainer")
    # --deepspeed makes the run DeepSpeed's (the reader's framework deepspeed)
    notes += _unrendered(before, after, (*_RENDERED, "framework") if s1.zero else _RENDERED)
    return NativeChange("TrainingArguments", tuple(out), tuple(notes))


def _trl_peft(job: Job) -> list[NativeSetting]:
    """TRL's ``ModelConfig`` flags (its ``sft`` script), which hf_args reads back; a plain Trainer script builds
    peft's ``LoraConfig`` with the same values. The dropout is written: TRL's own default is 0.05."""
    ft = job.finetune
    out = [NativeSetting("--use_peft", True)]
    if ft.peft_kind.config_flag:  # the TRL / peft flag that selects the method over plain LoRA (DoRA: use_dora)
        out.append(NativeSetting(f"--{ft.peft_kind.config_flag}", True))
    out += [NativeSetting("--lora_r", ft.lora_rank), NativeSetting("--lora_dropout", ft.lora_dropout)]
    kind = ft.quant_kind
    if kind.four_bit:
        out += [NativeSetting("--load_in_4bit", True), NativeSetting("--bnb_4bit_quant_type", kind.bnb_4bit_quant_type)]
        if ft.double_quant:
            out.append(NativeSetting("--use_bnb_nested_quant", True))
    elif kind.quantizes:
        out.append(NativeSetting("--load_in_8bit", True))
    return out


# --- torchtitan TOML (read back by memplan.frameworks.torchtitan_config) ---

def _torchtitan_parallel(before: Job, after: Job) -> tuple[list[NativeSetting], list[str]]:
    """The layout in ``[parallelism]`` (torchtitan_config._parallel reads it back; the FSDP shard degree follows
    the sharding below)."""
    p0, p1 = before.parallel, after.parallel
    if p0 == p1:
        return [], []
    key = "--parallelism."
    out = [NativeSetting(key + name, new) for name, old, new in (
        ("tensor_parallel_degree", p0.tp, p1.tp), ("pipeline_parallel_degree", p0.pp, p1.pp),
        ("context_parallel_degree", p0.cp, p1.cp), ("expert_parallel_degree", p0.ep, p1.ep),
        ("expert_tensor_parallel_degree", p0.expert_tp, p1.expert_tp)) if old != new]
    notes = []
    if (p1.vpp, p1.chunk_layers, p1.first_stage_layers, p1.last_stage_layers) != (
            p0.vpp, p0.chunk_layers, p0.first_stage_layers, p0.last_stage_layers):
        notes.append("the pipeline's stages per rank and layer split (pipeline_parallel_schedule, "
                     "pipeline_parallel_layers_per_stage) are not written here")
    return out, notes


def _torchtitan_batch(before: Job, after: Job) -> list[NativeSetting]:
    """Without a pipeline ``local_batch_size`` is the micro-batch; with one it is the data-parallel rank's whole
    batch, cut into micro-batches of ``pipeline_parallel_microbatch_size`` (torchtitan_config._batch)."""
    b, par = after.batch, after.parallel
    if before.batch == b and before.parallel.pp == par.pp:
        return []
    key = "--training."
    if par.pp == 1:
        out = [NativeSetting(key + "local_batch_size", b.micro_batch_size)]
        if b.global_batch_size is not None:
            out.append(NativeSetting(key + "global_batch_size", b.global_batch_size))
        return out
    gbs = b.global_batch_size or b.micro_batch_size * par.data_parallel
    return [NativeSetting(key + "local_batch_size", gbs // par.data_parallel),
            NativeSetting(key + "global_batch_size", gbs),
            NativeSetting("--parallelism.pipeline_parallel_microbatch_size", b.micro_batch_size)]


def _torchtitan_recompute(job: Job, per_rank: Sequence[int] | None) -> tuple[list[NativeSetting], list[str]]:
    """``[activation_checkpoint]``: ``full``, per-op ``selective``, or full recompute of k layers per stage as
    torchtitan's every-N-th-layer checkpointing (:mod:`memplan.profiles.partial_recompute`), which needs the
    layers of each rank (``per_rank``)."""
    r, key = job.recompute, "--activation_checkpoint."
    if r.mode == "selective":
        return [NativeSetting(key + "mode", "selective"), NativeSetting(key + "selective_ac_option", "op")], []
    if r.mode != "full" or r.method != "block" or r.num_layers is None:
        return [NativeSetting(key + "mode", r.mode)], []
    every = every_nth_counts(per_rank).get(r.num_layers) if per_rank else None
    if every is None:
        return [NativeSetting(key + "mode", "full")], [
            (f"torchtitan checkpoints every N-th layer of a rank; no N gives {r.num_layers} layers per stage"
             + ("" if per_rank else " (the ranks' layer counts were not given)") + ": every layer is written here")]
    return [NativeSetting(key + "mode", "selective"), NativeSetting(key + "selective_ac_option", str(every))], []


def _torchtitan(before: Job, after: Job, rank_layers: Sequence[int] | None = None) -> NativeChange:
    out, notes = _torchtitan_parallel(before, after)
    out += _torchtitan_batch(before, after)
    if _recompute_changed(before, after):
        recompute, note = _torchtitan_recompute(after, rank_layers)
        out += recompute
        notes += note
    s0, s1 = before.sharding, after.sharding
    if s0.fsdp != s1.fsdp or before.parallel.data_parallel != after.parallel.data_parallel:
        # torchtitan's FSDP group is shard x cp; the replicas are the data-parallel rest
        dp = after.parallel.data_parallel
        shard = dp if s1.fsdp == "full" else (s1.fsdp_shard_size or min(dp, 8)) if s1.fsdp == "hybrid" else 1
        out += [NativeSetting("--parallelism.data_parallel_replicate_degree", dp // shard),
                NativeSetting("--parallelism.data_parallel_shard_degree", -1)]
    if before.offload.optimizer != after.offload.optimizer:
        out.append(NativeSetting("--training.enable_cpu_offload", True))
    if before.offload.optimizer != after.offload.optimizer and not after.offload.params:
        notes.append("torchtitan's CPU offload (FSDP's CPUOffloadPolicy) moves the sharded parameters with the "
                     "optimizer states: the run holds less GPU memory than this fix's figure, and its step is slower")
    notes += _finetune_notes(before, after, "torchtitan has no adapter setting")
    notes += _loss_notes(before, after, "torchtitan")
    notes += _unrendered(before, after, (*_RENDERED, "parallel"))
    return NativeChange("torchtitan TOML", tuple(out), tuple(notes))


#: The dialect of each framework profile (:mod:`memplan.profiles.framework`), by the profile's name.
_DIALECTS: dict[str, Callable[[Job, Job, Sequence[int] | None], NativeChange]] = {
    "megatron": _megatron, "deepspeed": _deepspeed, "hf": _hf, "torchtitan": _torchtitan}
