"""``memplan fit --dataset``: the fastest trainer setting whose worst step fits, on the user's data.

Searched, with the global batch kept (rows per optimizer step = micro-batch x accumulation x DP):
the micro-batch (every divisor of the global batch, accumulation making up the rest), the batching
rule within the trainer's family (HF Trainer: pad to the longest, or ``group_by_length``; TRL: padding,
padding-free, ``bfd`` packing; torchtune: padding or packing), the recompute policy (none, full) and
``max_length``. Changes to the training itself come second, only when nothing fits without them, and
each is listed in the setting's ``changes``: truncation to the length percentiles p99 / p95 (rounded up
to 64 tokens; the tokens dropped are reported), 8-bit AdamW instead of AdamW/Adam, an NF4-quantized
base under LoRA/DoRA (QLoRA). Fitting settings rank by fewest changes, then predicted epoch time.

A setting fits when its worst step's predicted peak is at most the GPU's usable memory less
``margin``. The worst step is found among each setting's Pareto-largest shapes (the peak grows with rows
and tokens). The epoch time is the sum over micro-batches of :func:`memplan.fit.steptime.step_time`'s
compute at each micro-batch's shape (rounded up to 64 tokens, memoised), plus the optimizer and
gradient-reduction time of every optimizer step. Packed settings hold several examples per row, so
their steps are fewer; settings are compared by predicted epoch time.

Not searched: the LoRA rank (it changes the model trained).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from memplan.dataset.batching import Batching, StepShapes, plan_steps
from memplan.dataset.peaks import shape_job
from memplan.dataset.rules import family
from memplan.estimate.engine import estimate
from memplan.errors import UnsupportedError
from memplan.gpus import GPU
from memplan.job import Job
from memplan.model.spec import ModelSpec
from memplan.tuning.quant_formats import NF4
from memplan.optimizers import optimizer_kind

__all__ = ["Setting", "search_settings"]

_TIME_BUCKET = 64
_FAMILIES = {"hf": ("hf", "hf-grouped"), "trl": ("trl", "trl-padding-free", "trl-packing"),
             "torchtune": ("torchtune", "torchtune-packing"), "axolotl": ("axolotl",)}


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One searched setting and what it predicts."""

    batching: Batching
    recompute: str
    gradient_accumulation_steps: int
    worst_peak_bytes: int
    worst_shape: tuple[int, int]
    fits: bool
    epoch_s: float
    steps: int
    tokens_lost: int
    optimizer: str = "adamw"
    quantize_base: str = "none"
    #: What this setting changes in the training itself (truncation, optimizer, quantized base).
    changes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        b = self.batching
        return {"batching": b.rule, "group_by_length": b.group_by_length, "micro_batch_size": b.micro_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps, "max_length": b.effective_max_length,
                "recompute": self.recompute, "fits": self.fits, "worst_peak_allocated_bytes": self.worst_peak_bytes,
                "worst_step_shape": list(self.worst_shape), "steps_per_epoch": self.steps,
                "predicted_epoch_s": round(self.epoch_s, 3), "tokens_truncated": self.tokens_lost,
                "optimizer": self.optimizer, "quantize_base": self.quantize_base, "changes": list(self.changes)}


def search_settings(model: ModelSpec, job: Job, lengths: np.ndarray, base: Batching, gpu: GPU, *,
                    margin: float) -> list[Setting]:
    """Every searched setting, the fitting ones first, fastest first (see the module docstring)."""
    from memplan.fit.hardware import hardware_for

    hw = hardware_for(gpu.name)
    limit = int(gpu.usable_bytes * (1.0 - margin))
    rows = base.micro_batch_size * base.gradient_accumulation_steps
    settings = [_evaluate(model, job, lengths, batching, recompute, hw, limit)
                for batching in _batchings(base, rows, lengths) for recompute in ("none", "full")]
    if not any(s.fits for s in settings):
        trials = [(job, b) for b in _truncations(base, rows, lengths)]
        trials += [(variant, b) for variant in _variants(model, job) for b in _batchings(base, rows, lengths)]
        settings += [_evaluate(model, variant, lengths, batching, recompute, hw, limit, original=job)
                     for variant, batching in trials for recompute in ("none", "full")]
    return sorted(settings, key=lambda s: (not s.fits, len(s.changes), s.epoch_s))


def _variants(model: ModelSpec, job: Job) -> list[Job]:
    """The job with 8-bit AdamW, and with an NF4 base under LoRA/DoRA, where the estimator accepts them."""
    from memplan.errors import ConfigError

    out = []
    variant = optimizer_kind(job.optimizer.name).eight_bit_variant
    if variant:
        out.append(replace(job, optimizer=replace(job.optimizer, name=variant)))
    if job.finetune.peft_kind.adapters and not job.finetune.quant_kind.quantizes:
        out.append(replace(job, finetune=replace(job.finetune, quantize_base=NF4.name)))
    valid = []
    for variant in out:
        try:
            estimate(model, variant)  # the estimator's own checks decide what it accepts
        except ConfigError:
            continue
        valid.append(variant)
    return valid


def _batchings(base: Batching, rows: int, lengths: np.ndarray) -> list[Batching]:
    out = []
    for name in _FAMILIES[family(base.rule)]:
        rule = "hf" if name == "hf-grouped" else name
        if rule.endswith(("packing", "axolotl")) and base.effective_max_length is None:
            continue
        for mbs in (d for d in range(1, rows + 1) if rows % d == 0):
            out.append(replace(base, rule=rule, group_by_length=name == "hf-grouped", micro_batch_size=mbs,
                               gradient_accumulation_steps=rows // mbs))  # type: ignore[arg-type]
    return out


def _truncations(base: Batching, rows: int, lengths: np.ndarray) -> list[Batching]:
    cuts = sorted({int(-(-np.percentile(lengths, p) // 64) * 64) for p in (99, 95)})
    current = base.effective_max_length
    return [replace(b, max_length=cut) for cut in cuts if current is None or cut < current
            for b in _batchings(replace(base, max_length=cut), rows, lengths)]


def _evaluate(model: ModelSpec, job: Job, lengths: np.ndarray, batching: Batching, recompute: str, hw: Any,
              limit: int, *, original: Job | None = None) -> Setting:
    shapes = plan_steps(lengths, batching)
    if len(shapes) == 0:
        raise UnsupportedError("the dataset gives no training step for the searched settings")
    ga = batching.gradient_accumulation_steps
    base = replace(job, recompute=replace(job.recompute, mode=recompute))
    peak, worst = _worst(model, base, shapes, ga)
    epoch = _epoch_seconds(model, base, shapes, ga, hw)
    cap = batching.effective_max_length
    lost = int(np.maximum(lengths - cap, 0).sum()) if cap is not None and not batching.rule.endswith("packing") else 0
    given = original or job
    changes = tuple(name for name, changed in (
        (f"truncation to {cap} tokens", lost > 0),
        (f"optimizer {job.optimizer.name}", job.optimizer.name != given.optimizer.name),
        (f"{job.finetune.quantize_base} base", job.finetune.quantize_base != given.finetune.quantize_base))
        if changed)
    return Setting(batching=batching, recompute=recompute, gradient_accumulation_steps=ga, worst_peak_bytes=peak,
                   worst_shape=worst, fits=peak <= limit, epoch_s=epoch, steps=len(shapes), tokens_lost=lost,
                   optimizer=job.optimizer.name, quantize_base=job.finetune.quantize_base, changes=changes)



def _worst(model: ModelSpec, job: Job, shapes: StepShapes, ga: int) -> tuple[int, tuple[int, int]]:
    """The highest peak among the Pareto-largest (rows, tokens) shapes, and that shape."""
    best: dict[int, int] = {}
    for rows, seq in zip(shapes.batch_size.tolist(), shapes.seq_length.tolist(), strict=True):
        best[rows] = max(best.get(rows, 0), seq)
    front = [(r, s) for r, s in best.items() if not any(r2 >= r and s2 >= s and (r2, s2) != (r, s)
                                                        for r2, s2 in best.items())]
    peaks = [(estimate(model, shape_job(job, r, s, shapes.packed, accumulation=ga)).peak_allocated_bytes, (r, s))
             for r, s in front]
    return max(peaks)


def _epoch_seconds(model: ModelSpec, job: Job, shapes: StepShapes, ga: int, hw: Any) -> float:
    from memplan.fit.steptime import step_time

    seq = -(-shapes.seq_length // _TIME_BUCKET) * _TIME_BUCKET
    keys, counts = np.unique(shapes.batch_size * (1 << 32) + seq, return_counts=True)
    total, update = 0.0, 0.0
    for key, count in zip(keys.tolist(), counts.tolist(), strict=True):
        timed = step_time(model, shape_job(job, key >> 32, key & 0xFFFFFFFF, shapes.packed, accumulation=1), hw)
        total += count * (timed.total_s - timed.optimizer_s - timed.dp_comm_s)
        update = max(update, timed.optimizer_s + timed.dp_comm_s)
    return total + update * -(-len(shapes) // ga)
