"""memplan: how much GPU memory a training job needs, where it goes, and how to make it fit.

The public API mirrors the ``memplan`` command line::

    from memplan import estimate, load_model, Job, Parallelism, Batch

    model = load_model("llama-3.1-8b")
    job = Job(parallel=Parallelism(world_size=8, tp=2), batch=Batch(micro_batch_size=1, seq_length=8192))
    result = estimate(model, job, gpu=get_gpu("h100-80gb"))
    print(result.peak_allocated_bytes, result.fits)

    # any input dialect, as the command line reads it (flags, job file, Megatron args, DeepSpeed):
    loaded = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 8, "tp": 2}, job_file=None))
    result = estimate(loaded.model, loaded.job)

``memplan.trace(...)`` (fake-tensor tracing), ``memplan.fit(...)`` (layout search) and
``memplan.ckpt.auto_checkpoint(...)`` (input-aware checkpointing) mirror ``memplan trace``,
``memplan fit`` and ``memplan ckpt``; ``memplan.watch(...)`` writes a snapshot and a report when a
training run runs out of CUDA memory. ``memplan.trace`` and ``memplan.fit`` are their packages,
callable as the functions ``memplan.trace.trace`` and ``memplan.fit.fit``.

Importing memplan imports no torch, and only what ``memplan estimate`` needs: ``trace``, ``fit``
and ``ckpt`` are imported on first access (``ckpt`` needs torch; ``trace`` imports it on its
first call).
"""

import importlib
from typing import Any

from memplan.categories import MemoryCategory
from memplan.errors import ConfigError, JobConfigError, MemplanError, ModelConfigError, UnsupportedError
from memplan.estimate import DEFAULT_FRAGMENTATION, Estimate, StageEstimate, estimate
from memplan.profiles import FrameworkProfile, get_profile
from memplan.gpus import GPU, get_gpu, list_gpus
from memplan.inputs import JobRequest, LoadedJob, load_job
from memplan.job import (
    Batch,
    Job,
    MoEOptions,
    Offload,
    Optimizer,
    Parallelism,
    Precision,
    Recompute,
    Sharding,
)
from memplan.jobflags import build_job
from memplan.model import ModelSpec, list_presets, load_model, total_params
from memplan.settings import InputSetting

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_FRAGMENTATION",
    "GPU",
    "Batch",
    "ConfigError",
    "Estimate",
    "FitResult",
    "FrameworkProfile",
    "InputSetting",
    "Job",
    "JobConfigError",
    "JobRequest",
    "LoadedJob",
    "MemoryCategory",
    "MemplanError",
    "MoEOptions",
    "ModelConfigError",
    "ModelSpec",
    "Offload",
    "Optimizer",
    "Parallelism",
    "Precision",
    "Recompute",
    "Sharding",
    "StageEstimate",
    "Trace",
    "UnsupportedError",
    "__version__",
    "build_job",
    "estimate",
    "fit",
    "get_gpu",
    "get_profile",
    "list_gpus",
    "list_presets",
    "load_job",
    "load_model",
    "read_trace",
    "total_params",
    "trace",
    "watch",
    "write_trace",
]


_LAZY = {"fit": "memplan.fit", "trace": "memplan.trace", "ckpt": "memplan.ckpt", "watch": "memplan.watch"}
#: Names imported on first use from a module ``memplan estimate`` does not need (start-up time).
_LAZY_NAMES = {"Trace": "memplan.events", "read_trace": "memplan.events", "write_trace": "memplan.events"}


def __getattr__(name: str) -> Any:
    """Import ``fit``, ``trace``, ``ckpt`` and ``watch`` on first use; ``FitResult`` from ``memplan.fit``;
    the trace file format's names from ``memplan.events``."""
    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    if name == "FitResult":
        return importlib.import_module("memplan.fit").FitResult
    raise AttributeError(f"module 'memplan' has no attribute {name!r}")
