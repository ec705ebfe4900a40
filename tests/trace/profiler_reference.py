"""The independent measurement: the same step on real CPU tensors, measured by ``torch.profiler``.

Used by the accuracy test and ``benchmarks/trace_accuracy.py``. The model is built from the same
config with real (random) weights, runs the same loop (:func:`memplan.trace.run.run_iterations`),
and its peak is read from PyTorch's memory timeline
(``torch.profiler._memory_profiler.MemoryProfileTimeline``, the data behind
``export_memory_timeline``): pre-existing tensors plus every allocation and free the profiler saw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memplan.trace.build import build_hf_model
from memplan.trace.run import StepJob, apply_recompute, hf_step_job, run_iterations
from memplan.trace.setup import TraceSetup

__all__ = ["measure_hf_reference", "profiler_peak_bytes", "real_hf_step"]


def real_hf_step(model: str, options: TraceSetup, *, seed: int = 0) -> StepJob:
    """The step job of ``model`` with real CPU tensors (small models only: weights are allocated)."""
    torch.manual_seed(seed)
    built = build_hf_model(model, options)
    apply_recompute(built.model, options.policy)
    return hf_step_job(built.model, options)


def profiler_peak_bytes(run: Callable[[], Any], device: str = "cpu") -> int:
    """Peak bytes of ``device`` memory in ``torch.profiler``'s memory timeline while ``run()`` runs."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    # torch requires with_stack=True for _memory_profile() (it reads Python frames to find module
    # parameters and optimizer states).
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        run()
    timeline = MemoryProfileTimeline(prof._memory_profile())
    _times, sizes = timeline._coalesce_timeline(device)
    return max((sum(row) for row in sizes), default=0)


def measure_hf_reference(model: str, options: TraceSetup) -> int:
    """Peak of ``options.iterations`` real CPU iterations of ``model`` per the profiler timeline."""
    job = real_hf_step(model, options)
    return profiler_peak_bytes(lambda: run_iterations(job, options.iterations))
