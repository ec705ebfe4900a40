"""Every step's peak by memplan's tracer instead of the estimator: ``--device cpu`` prices an eager CPU run.

The estimator prices a CUDA run (its caching allocator, its kernels' workspaces, SDPA's memory-efficient
attention). A fine-tune on the CPU runs other kernels: eager attention materialises each layer's
``(batch, heads, seq, seq)`` scores, and PyTorch's CPU allocator does not round. :func:`traced_step_peaks`
runs :func:`memplan.trace.trace_job` (the model's own forward, backward and optimizer step on fake
tensors) once per distinct step shape on the chosen device, and gives each step its shape's peak.
This imports torch; the estimator path (:mod:`memplan.dataset.peaks`) does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from memplan.dataset.batching import StepShapes
from memplan.dataset.peaks import shape_job

__all__ = ["TracedPeaks", "traced_step_peaks"]


@dataclass(frozen=True)
class TracedPeaks:
    """Per-step traced peaks (bytes) and the worst step."""

    peak_allocated_bytes: np.ndarray
    worst_index: int
    distinct_shapes: int
    device: str

    def to_dict(self) -> dict[str, Any]:
        index = self.worst_index
        return {"device": self.device, "steps": len(self.peak_allocated_bytes),
                "distinct_shapes": self.distinct_shapes, "worst_step": index,
                "worst_peak_allocated_bytes": int(self.peak_allocated_bytes[index]),
                "per_step_peak_allocated_bytes": [int(x) for x in self.peak_allocated_bytes.tolist()]}


def traced_step_peaks(model: str, job: Any, shapes: StepShapes, *, device: str = "cpu", iterations: int = 2,
                      progress: Callable[[str], None] | None = None) -> TracedPeaks:
    """Trace ``model`` (a preset, config.json or its folder) at every distinct ``(rows, seq)`` of ``shapes``:
    the peak over ``iterations`` training iterations (the steady state, optimizer state held); the first
    step is its shape's first iteration alone (the optimizer's state is created at its end)."""
    from memplan.trace.api import trace_job
    from memplan.trace.setup import trace_setup

    keys = shapes.batch_size * (1 << 32) + shapes.seq_length
    distinct, inverse = np.unique(keys, return_inverse=True)

    def peak(key: int, runs: int) -> int:
        shaped = shape_job(job, key >> 32, key & 0xFFFFFFFF, shapes.packed)
        return int(trace_job(model, trace_setup(shaped, device=device, iterations=runs)).summary.peak_allocated_bytes)

    peaks = []
    for number, key in enumerate(distinct.tolist(), start=1):
        if progress is not None:
            progress(f"tracing shape {number}/{len(distinct)}: {key >> 32} x {key & 0xFFFFFFFF}")
        peaks.append(peak(key, iterations))
    per_step = np.asarray(peaks, dtype=np.int64)[inverse.reshape(-1)]
    if len(per_step) and iterations > 1:  # the first step runs before the optimizer has any state
        per_step[0] = peak(int(keys[0]), 1)
    return TracedPeaks(per_step, int(np.argmax(per_step)), len(distinct), device)


def trace_dataset(model: str, setup: Any, flags: dict[str, Any], dialects: tuple[str | None, str | None, str | None],
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``memplan trace MODEL --dataset ...``: the dataset's steps (as ``estimate --dataset`` batches them)
    traced on ``setup``'s device; the JSON ``dataset`` section."""
    from dataclasses import replace as replace_job

    from memplan.dataset import dataset_lengths
    from memplan.dataset.batching import plan_steps
    from memplan.dataset.options import dataset_request, require_packages
    from memplan.inputs import JobRequest, load_job

    require_packages()
    loaded = load_job(JobRequest(model=model, flags={}, hf_args=dialects[0], peft_config=dialects[1],
                                 torchtitan_config=dialects[2]))
    loaded = replace_job(loaded, job=setup.job)
    request = dataset_request(flags, loaded)
    lengths, cached = dataset_lengths(loaded, request)
    shapes = plan_steps(lengths, request.batching)  # type: ignore[arg-type]
    traced = traced_step_peaks(model, setup.job, shapes, device=setup.device, iterations=setup.run.iterations,
                               progress=progress)
    worst = traced.worst_index
    return {"examples": int(len(lengths)), "batching": request.batching.rule,  # type: ignore[arg-type]
            "lengths_from_cache": cached, "worst_step_shape": {"batch_size": int(shapes.batch_size[worst]),
                                                               "seq_length": int(shapes.seq_length[worst])},
            **traced.to_dict()}
