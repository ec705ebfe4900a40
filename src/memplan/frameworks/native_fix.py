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
from collections.abc import Callable
from typing import Any

from memplan.frozen import frozen_dataclass
from memplan.job import Job

__all__ = ["NativeChange", "NativeSetting", "native_change"]


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


def native_change(before: Job, after: Job) -> NativeChange | None:
    """``after`` (a change of ``before``) in ``before``'s framework's settings; None for a framework without a
    dialect here."""
    render = _DIALECTS.get(before.framework)
    return None if render is None else render(before, after)


# --- what changed, in the terms every dialect shares ---

def _accumulation(job: Job) -> int:
    b = job.batch
    gbs = b.global_batch_size or b.micro_batch_size * job.parallel.data_parallel
    return gbs // (b.micro_batch_size * job.parallel.data_parallel)


def _batch(before: Job, after: Job, micro: str, total: str = "", steps: str = "") -> list[NativeSetting]:
    """The micro-batch under the dialect's key, and the global batch (``total``) or the accumulation steps."""
    if before.batch == after.batch:
        return []
    out = [NativeSetting(micro, after.batch.micro_batch_size)]
    if total and after.batch.global_batch_size is not None:
        out.append(NativeSetting(total, after.batch.global_batch_size))
    if steps:
        out.append(NativeSetting(steps, _accumulation(after)))
    return out


def _unrendered(before: Job, after: Job, rendered: tuple[str, ...]) -> list[str]:
    """The job's top-level settings that changed but no rule of the dialect rendered: named, never dropped."""
    from dataclasses import fields

    return [f"memplan's {f.name} changed, which this dialect's settings do not say"
            for f in fields(Job) if f.name not in rendered and getattr(before, f.name) != getattr(after, f.name)]


_RENDERED = ("batch", "recompute", "sharding", "offload", "finetune", "loss")


def _finetune_notes(before: Job, after: Job, framework_words: str) -> list[str]:
    if before.finetune == after.finetune:
        return []
    ft = after.finetune
    quant = (f" on a base quantized by bitsandbytes (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="
             f"\"{ft.quantize_base}\"))" if ft.quantize_base != "none" else "")
    return [f"{ft.peft.upper()} adapters (rank {ft.lora_rank}){quant}: {framework_words}"]


def _loss_notes(before: Job, after: Job, framework: str) -> list[str]:
    if before.loss == after.loss:
        return []
    return [(f"a {after.loss} cross-entropy loss: {framework} has no setting for it; it is a change to the training "
             "code (a loss computed over chunks of the sequence, never holding the whole logits)")]


# --- Megatron-LM (read back by memplan.frameworks.megatron_args) ---

#: ``--data-parallel-sharding-strategy`` of Megatron-FSDP for a ZeRO stage (megatron_args._sharding reads it back).
_MEGATRON_STRATEGY = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def _megatron(before: Job, after: Job) -> NativeChange:
    out: list[NativeSetting] = []
    notes: list[str] = []
    out += _batch(before, after, "--micro-batch-size", total="--global-batch-size")
    if before.recompute != after.recompute:
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
    if before.offload.optimizer != after.offload.optimizer:
        out.append(NativeSetting("--optimizer-cpu-offload", True))
    notes += _finetune_notes(before, after, "Megatron-LM has no adapter setting (NeMo / Megatron-Bridge PEFT trains "
                                            "adapters on Megatron models)")
    notes += _loss_notes(before, after, "Megatron-LM")
    notes += _unrendered(before, after, _RENDERED)
    return NativeChange("Megatron-LM arguments", tuple(out), tuple(notes))


# --- DeepSpeed config (read back by memplan.frameworks.deepspeed_config) ---

_DS_RECOMPUTE = ("recompute ({mode}) is turned on in the model code, not in the DeepSpeed config (Hugging Face: "
                 "model.gradient_checkpointing_enable(); Megatron-DeepSpeed: --checkpoint-activations)")


def _deepspeed(before: Job, after: Job) -> NativeChange:
    out: list[NativeSetting] = []
    notes: list[str] = []
    out += _batch(before, after, "train_micro_batch_size_per_gpu", steps="gradient_accumulation_steps")
    if before.recompute != after.recompute:
        notes.append(_DS_RECOMPUTE.format(mode=after.recompute.mode))
    if before.sharding.zero != after.sharding.zero:
        out.append(NativeSetting("zero_optimization.stage", after.sharding.zero))
    if before.offload.optimizer != after.offload.optimizer:
        out.append(NativeSetting("zero_optimization.offload_optimizer.device", "cpu"))
    notes += _finetune_notes(before, after, "peft's LoraConfig in the training script (DeepSpeed's config has no "
                                            "adapter setting)")
    notes += _loss_notes(before, after, "DeepSpeed")
    notes += _unrendered(before, after, _RENDERED)
    return NativeChange("DeepSpeed config", tuple(out), tuple(notes), style="keys")


# --- Hugging Face TrainingArguments (read back by memplan.frameworks.hf_args) ---

def _hf(before: Job, after: Job) -> NativeChange:
    out: list[NativeSetting] = []
    notes: list[str] = []
    out += _batch(before, after, "--per_device_train_batch_size", steps="--gradient_accumulation_steps")
    if before.recompute != after.recompute:
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
    if ft.peft == "dora":
        out.append(NativeSetting("--use_dora", True))
    out += [NativeSetting("--lora_r", ft.lora_rank), NativeSetting("--lora_dropout", ft.lora_dropout)]
    if ft.quantize_base != "none":
        out += [NativeSetting("--load_in_4bit", True), NativeSetting("--bnb_4bit_quant_type", ft.quantize_base)]
        if ft.double_quant:
            out.append(NativeSetting("--use_bnb_nested_quant", True))
    return out


# --- torchtitan TOML (read back by memplan.frameworks.torchtitan_config) ---

def _torchtitan(before: Job, after: Job) -> NativeChange:
    out: list[NativeSetting] = []
    notes: list[str] = []
    out += _batch(before, after, "--training.local_batch_size", total="--training.global_batch_size")
    if before.recompute != after.recompute:
        out.append(NativeSetting("--activation_checkpoint.mode", after.recompute.mode))
        if after.recompute.mode == "selective":
            out.append(NativeSetting("--activation_checkpoint.selective_ac_option", "op"))
    s0, s1 = before.sharding, after.sharding
    if s0.fsdp != s1.fsdp:  # torchtitan's FSDP group is shard x cp; the replicas are the data-parallel rest
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
    notes += _unrendered(before, after, _RENDERED)
    return NativeChange("torchtitan TOML", tuple(out), tuple(notes))


#: The dialect of each framework profile (:mod:`memplan.profiles.framework`), by the profile's name.
_DIALECTS: dict[str, Callable[[Job, Job], NativeChange]] = {
    "megatron": _megatron, "deepspeed": _deepspeed, "hf": _hf, "torchtitan": _torchtitan}
