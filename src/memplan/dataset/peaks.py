"""Every step's peak: the estimator run once per distinct micro-batch shape, read back per step.

A step here is one micro-batch on one GPU, in training order. Its job is the user's job with
``--mbs`` = the step's rows, ``--seq`` = its (padded) tokens per row and ``--gbs`` keeping the same
number of micro-batches per optimizer step; padding-free and packed rows are priced with the job's
``--packing`` (one row of all the step's tokens, attention per document). So the worst step's peak is
exactly what ``memplan estimate --mbs B --seq S [--packing]`` prints for that shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from memplan.dataset.batching import StepShapes
from memplan.estimate.engine import DEFAULT_FRAGMENTATION, estimate
from memplan.gpus import GPU
from memplan.job import Job
from memplan.model.spec import ModelSpec

__all__ = ["DatasetPeaks", "WorstStep", "pooled_peaks", "shape_job", "step_peaks"]

PERCENTILES = (50, 90, 99, 100)
#: At most this many points of the per-step peak are drawn (JSON ``step_peaks``, the report, the web page).
CHART_POINTS = 1500


@dataclass(frozen=True, kw_only=True)
class WorstStep:
    """The step with the highest peak (the first such step when several tie)."""

    index: int
    batch_size: int
    seq_length: int
    peak_allocated_bytes: int
    peak_phase: str


@dataclass(frozen=True, kw_only=True)
class DatasetPeaks:
    """Per-step peaks of one dataset under one batching rule."""

    examples: int
    #: Per-step arrays, in training order.
    shapes: StepShapes
    peak_allocated_bytes: np.ndarray
    worst: WorstStep
    #: Example token lengths (after truncation), for the histogram and the percentiles.
    lengths: np.ndarray
    #: Usable bytes of ``--gpu`` (None without one).
    gpu_usable_bytes: int | None
    distinct_shapes: int
    #: How the steps were priced, one sentence.
    pricing: str
    rule: str
    from_cache: bool = False

    @property
    def steps_over_gpu(self) -> int | None:
        if self.gpu_usable_bytes is None:
            return None
        return int((self.peak_allocated_bytes > self.gpu_usable_bytes).sum())

    def to_dict(self) -> dict[str, Any]:
        """The JSON ``dataset`` section."""
        peaks = self.peak_allocated_bytes
        return {
            "examples": self.examples,
            "steps": len(self.shapes),
            "batching": self.rule,
            "pricing": self.pricing,
            "distinct_shapes": self.distinct_shapes,
            "lengths_from_cache": self.from_cache,
            "length_percentiles": _percentiles(self.lengths),
            "length_histogram": length_histogram(self.lengths),
            "step_peak_percentiles_bytes": _percentiles(peaks),
            "steps_over_gpu": self.steps_over_gpu,
            "step_peaks": pooled_peaks(peaks),
            "gpu_usable_bytes": self.gpu_usable_bytes,
            "worst_step": {"index": self.worst.index, "batch_size": self.worst.batch_size,
                           "seq_length": self.worst.seq_length,
                           "peak_allocated_bytes": self.worst.peak_allocated_bytes,
                           "peak_phase": self.worst.peak_phase},
        }


def pooled_peaks(peaks: np.ndarray, points: int = CHART_POINTS) -> dict[str, Any]:
    """The per-step peak for a chart: ``max_bytes`` holds, for each run of ``steps_per_point`` consecutive
    steps (the last run may be shorter), its highest peak; at most ``points`` values."""
    size = max(1, -(-len(peaks) // points))
    padded = np.full(-(-len(peaks) // size) * size, np.iinfo(np.int64).min, dtype=np.int64)
    padded[:len(peaks)] = peaks
    return {"steps_per_point": size, "max_bytes": padded.reshape(-1, size).max(axis=1).tolist()}


def shape_job(job: Job, batch_size: int, seq_length: int, packed: bool, *, accumulation: int | None = None) -> Job:
    """``job`` at one step's shape, with ``accumulation`` micro-batches per optimizer step (default: the
    job's own), so the global batch is ``batch_size`` x data parallel x ``accumulation``."""
    accumulation = job.num_microbatches if accumulation is None else accumulation
    gbs = batch_size * job.parallel.data_parallel * accumulation
    batch = replace(job.batch, micro_batch_size=batch_size, seq_length=seq_length, global_batch_size=gbs,
                    packing=packed)
    return replace(job, batch=batch)


def step_peaks(model: ModelSpec, job: Job, shapes: StepShapes, lengths: np.ndarray, *, rule: str,
               gpu: GPU | None = None, fragmentation: float = DEFAULT_FRAGMENTATION,
               from_cache: bool = False, accumulation: int | None = None) -> DatasetPeaks:
    """The peak of every step of ``shapes`` (see the module docstring); ``accumulation``: micro-batches
    per optimizer step (default: the job's)."""
    if len(shapes) == 0:
        from memplan.errors import ConfigError

        raise ConfigError("--dataset", f"gives no training step with --batching {rule} (fewer examples than "
                          "one micro-batch and drop_last?)", len(lengths))
    keys = shapes.batch_size * (1 << 32) + shapes.seq_length
    distinct, inverse = np.unique(keys, return_inverse=True)
    results = [estimate(model, shape_job(job, int(k >> 32), int(k & 0xFFFFFFFF), shapes.packed,
                                          accumulation=accumulation), gpu=gpu,
                        fragmentation=fragmentation) for k in distinct.tolist()]
    per_shape = np.asarray([r.peak_allocated_bytes for r in results], dtype=np.int64)
    peaks = per_shape[inverse.reshape(-1)]
    index = int(np.argmax(peaks))
    worst = results[int(inverse.reshape(-1)[index])]
    stage = next(s for s in worst.stages if s.stage == worst.peak_stage)
    return DatasetPeaks(
        examples=len(lengths), shapes=shapes, peak_allocated_bytes=peaks,
        worst=WorstStep(index=index, batch_size=int(shapes.batch_size[index]),
                        seq_length=int(shapes.seq_length[index]), peak_allocated_bytes=int(peaks[index]),
                        peak_phase=stage.peak_phase),
        lengths=lengths, gpu_usable_bytes=gpu.usable_bytes if gpu is not None else None,
        distinct_shapes=len(distinct), pricing=_pricing(shapes.packed), rule=rule, from_cache=from_cache)


def _pricing(packed: bool) -> str:
    if packed:
        return ("each step priced as --mbs rows of --seq tokens with --packing (one flattened row of the step's "
                "tokens, attention per document)")
    return "each step priced as --mbs rows padded to --seq tokens (the longest row of the step)"


def _percentiles(values: np.ndarray) -> dict[str, int]:
    return {f"p{p}": int(np.percentile(values, p, method="higher")) for p in PERCENTILES}


def length_histogram(lengths: np.ndarray, bins: int = 16) -> list[dict[str, int]]:
    """Example counts in ``bins`` equal-width token-length bins: ``[{"from", "to", "count"}]``."""
    top = int(lengths.max()) if len(lengths) else 0
    edges = np.linspace(0, max(top, 1), bins + 1).round().astype(np.int64)
    counts, _ = np.histogram(lengths, bins=edges)
    return [{"from": int(edges[i]), "to": int(edges[i + 1]), "count": int(counts[i])} for i in range(bins)]
