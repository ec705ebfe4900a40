"""Which fine-tuning method fits one GPU: full, full with 8-bit AdamW, LoRA, QLoRA, each with and
without gradient checkpointing, at the user's sequence length and micro-batch.

Example::

    >>> from memplan.fit import compare_methods
    >>> result = compare_methods("llama-3.2-1b", gpu="h100-80gb", seq=2048)
    >>> len(result.methods), result.best is not None
    (8, True)

Every method starts from one base job (the user's flags: sequence, micro-batch, precision,
attention, LoRA rank and targets, loss...) and replaces only what defines the method: what trains
(``finetune``), the optimizer of full fine-tuning, and the recompute setting. Fitting methods are
ranked by the step-time model (:mod:`memplan.fit.steptime`: a recompute costs a forward, QLoRA's
dequantization is priced explicitly), the others follow by predicted memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memplan.errors import ConfigError
from memplan.estimate.engine import DEFAULT_FRAGMENTATION, estimate
from memplan.fit.hardware import hardware_for
from memplan.fit.results import FIT_MARGIN, FitError, memory_limit
from memplan.fit.steptime import StepTime, step_time
from memplan.gpus import GPU, get_gpu
from memplan.job import Batch, FineTuning, Job, Optimizer, Precision, Recompute
from memplan.model.spec import ModelSpec
from memplan.profiles import FINE_TUNING_FRAMEWORK
from memplan.tuning.peft_methods import LORA
from memplan.tuning.quant_formats import NF4
from memplan.tuning.quant_formats import NONE as NO_QUANT

__all__ = ["METHODS", "MethodResult", "MethodsResult", "compare_methods", "methods_base_job"]

#: The methods compared: name -> (what trains, full fine-tuning's optimizer or None to keep the base's).
METHODS: dict[str, tuple[str, str | None]] = {
    "full": ("full", None),
    "full-adamw8bit": ("full", "adamw8bit"),
    "lora": ("lora", None),
    "qlora": ("qlora", None),
}
#: Recompute settings tried for every method: none, and Hugging Face gradient checkpointing (every
#: decoder layer, memplan's full recompute under the ``hf`` profile).
CHECKPOINTING = {False: Recompute(), True: Recompute(mode="full")}


@dataclass(frozen=True, kw_only=True)
class MethodResult:
    """One method x checkpointing setting on the GPU."""

    #: ``full``, ``full-adamw8bit``, ``lora`` or ``qlora``.
    name: str
    checkpointing: bool
    job: Job
    reserved_bytes: int
    allocated_bytes: int
    #: bitsandbytes paged optimizer states, outside the allocator (0 unless paged).
    paged_optimizer_bytes: int
    fits: bool
    #: Bytes left under the limit (negative: short by that much).
    headroom_bytes: int
    step: StepTime
    #: Trainable / frozen parameters of the method's job.
    trainable_params: int = 0
    frozen_params: int = 0

    @property
    def label(self) -> str:
        return self.name + (" + checkpointing" if self.checkpointing else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.name, "checkpointing": self.checkpointing, "label": self.label, "fits": self.fits,
            "reserved_bytes": self.reserved_bytes, "allocated_bytes": self.allocated_bytes,
            "paged_optimizer_bytes": self.paged_optimizer_bytes, "headroom_bytes": self.headroom_bytes,
            "trainable_params": self.trainable_params, "frozen_params": self.frozen_params,
            "optimizer": self.job.optimizer.name, "peft": self.job.finetune.peft,
            "quantize_base": self.job.finetune.quantize_base, "step": self.step.to_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class MethodsResult:
    """Every method on each of ``gpus`` data-parallel GPUs: fitting ones fastest first, then the others by memory."""

    model: str
    gpu: str
    #: The data-parallel GPUs the methods run on (each holds the figures: per-GPU memory).
    gpus: int
    usable_bytes: int
    limit_bytes: int
    margin: float
    seq_length: int
    micro_batch_size: int
    methods: tuple[MethodResult, ...]
    #: What the comparison assumes, beside the estimator's assumptions.
    notes: tuple[str, ...]

    @property
    def fitting(self) -> tuple[MethodResult, ...]:
        return tuple(m for m in self.methods if m.fits)

    @property
    def best(self) -> MethodResult | None:
        """The fastest fitting method, or None."""
        return self.fitting[0] if self.fitting else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "gpu": self.gpu, "gpus": self.gpus, "usable_bytes": self.usable_bytes,
            "limit_bytes": self.limit_bytes,
            "margin": self.margin, "seq_length": self.seq_length, "micro_batch_size": self.micro_batch_size,
            "best": self.best.label if self.best else None, "methods": [m.to_dict() for m in self.methods],
            "notes": list(self.notes),
        }


def methods_base_job(gpu: GPU, *, seq: int = 4096, mbs: int = 1) -> Job:
    """The default base job of a comparison: the ``hf`` profile, one GPU, bf16 mixed precision (fp16
    mixed on GPUs without BF16: V100, T4)."""
    precision = "bf16-mixed" if gpu.half_dtype == "bf16" else "fp16-mixed"
    return Job(framework=FINE_TUNING_FRAMEWORK, precision=Precision(name=precision),
               batch=Batch(seq_length=seq, micro_batch_size=mbs))


def _method_job(base: Job, name: str, checkpointing: bool) -> Job:
    trains, optimizer = METHODS[name]
    ft = base.finetune
    if trains == "full":
        finetune = FineTuning()
        opt = replace(base.optimizer, name=optimizer) if optimizer else base.optimizer
    else:
        # LoRA settings (rank, targets, dropout, DoRA...) come from the base when it has them.
        peft = ft.peft if ft.peft_kind.adapters else LORA.name
        finetune = replace(ft, peft=peft, trainable="auto",
                           quantize_base=(NF4 if trains == "qlora" else NO_QUANT).name,
                           quant_compute_dtype=ft.quant_compute_dtype if trains == "qlora" else None)
        opt = base.optimizer
    return replace(base, finetune=finetune, optimizer=Optimizer(name=opt.name, momentum=opt.momentum,
                                                                implementation=opt.implementation,
                                                                in_backward=opt.in_backward,
                                                                muon_tp_mode=opt.muon_tp_mode,
                                                                muon_nesterov=opt.muon_nesterov),
                   recompute=CHECKPOINTING[checkpointing])


def compare_methods(
    model: ModelSpec | str, *, gpu: GPU | str, base: Job | None = None, seq: int | None = None,
    mbs: int | None = None, margin: float = FIT_MARGIN, fragmentation: float = DEFAULT_FRAGMENTATION,
) -> MethodsResult:
    """Full fine-tuning, full with 8-bit AdamW, LoRA and QLoRA (nf4), each with and without gradient
    checkpointing, on one ``gpu``: which fit, fastest first.

    ``base``: the job every method starts from (default :func:`methods_base_job`); ``seq``/``mbs``
    override its batch. Its data-parallel size is kept (per-GPU memory); its ``finetune`` and recompute
    settings are replaced by each method's. Known limitations: the estimator's and the step-time
    model's; the methods use peft's defaults beside what the base job sets.
    """
    if isinstance(model, str):
        from memplan.model import load_model

        model = load_model(model)
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not 0.0 <= margin < 1.0:
        raise FitError("--margin", "must be in [0, 1)", margin)
    try:
        hw = hardware_for(gpu_spec.name)
    except KeyError:
        raise FitError("--gpu", "has no step-time data (see memplan.fit.hardware.HARDWARE)", gpu_spec.name) from None
    base = base or methods_base_job(gpu_spec)
    batch = replace(base.batch, seq_length=base.batch.seq_length if seq is None else seq,
                    micro_batch_size=base.batch.micro_batch_size if mbs is None else mbs)
    base = replace(base, batch=batch)
    par = base.parallel
    if par.tp * par.pp * par.cp * par.ep > 1:
        raise ConfigError("--methods", "compares methods on data-parallel GPUs only (no --tp/--pp/--cp/--ep)",
                          f"tp={base.parallel.tp}, pp={base.parallel.pp}, cp={base.parallel.cp}, ep={base.parallel.ep}")
    limit = memory_limit(gpu_spec.usable_bytes, margin)
    rows = []
    for name in METHODS:
        for checkpointing in (False, True):
            job = _method_job(base, name, checkpointing)
            est = estimate(model, job, fragmentation=fragmentation)
            rows.append(MethodResult(
                name=name, checkpointing=checkpointing, job=job, reserved_bytes=est.peak_reserved_bytes,
                allocated_bytes=est.peak_allocated_bytes, paged_optimizer_bytes=est.paged_optimizer_bytes,
                fits=est.peak_reserved_bytes <= limit, headroom_bytes=limit - est.peak_reserved_bytes,
                step=step_time(model, job, hw), trainable_params=est.trainable_params,
                frozen_params=est.frozen_params))
    rows.sort(key=lambda m: (not m.fits, m.step.total_s if m.fits else m.reserved_bytes))
    notes = (
        (f"framework profile '{base.framework}', precision {base.precision.name}, optimizer {base.optimizer.name} "
        "(full-adamw8bit: bitsandbytes AdamW8bit)"),
        "checkpointing: Hugging Face gradient checkpointing of every decoder layer (one extra forward per step)",
        ("LoRA/QLoRA: peft settings from the job (default rank 8 on peft's default target modules for the model "
        "type); QLoRA: nf4 base with double quantization, dequantized in every forward, backward and recompute "
        "(priced as an HBM pass)"),
        "fitting methods ranked by the predicted step time; the others by predicted reserved memory",
    )
    return MethodsResult(model=model.name, gpu=gpu_spec.name, gpus=par.world_size, usable_bytes=gpu_spec.usable_bytes,
                         limit_bytes=limit,
                         margin=margin, seq_length=batch.seq_length, micro_batch_size=batch.micro_batch_size,
                         methods=tuple(rows), notes=notes)
