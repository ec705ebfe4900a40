"""``memplan fit``: which layouts fit, the largest micro-batch / sequence, GPU sharing.

Public API::

    from memplan.fit import fit, max_micro_batch, max_seq_length, colocate

    result = fit("llama-3.1-70b", gpus=64, gpu="h100-80gb", seq=8192, gbs=512, top=10)
    best = result.best            # Candidate: layout, job, reserved bytes, headroom, StepTime
    methods = compare_methods("llama-3.1-8b", gpu="rtx-4090", seq=2048)  # full / LoRA / QLoRA on one GPU

Everything here is pure Python and imports no torch.
"""

import sys
import types
from typing import Any

from memplan.fit.colocate import Colocation, ProcessMemory, SharedJob, colocate
from memplan.gpus import MIG_PROFILES, resolve_device
from memplan.fit.context import DEFAULT_TOKENS_PER_STEP, default_global_batch
from memplan.fit.hardware import HARDWARE, Hardware
from memplan.fit.limits import CurvePoint, Limit, max_micro_batch, max_seq_length
from memplan.fit.methods import MethodResult, MethodsResult, compare_methods
from memplan.fit.results import (
    FIT_MARGIN,
    Candidate,
    FitError,
    FitResult,
    NoFitError,
    RejectedFamily,
    fits_memory,
    memory_limit,
)
from memplan.fit.search import fit
from memplan.fit.space import Layout, SearchSpace, enumerate_layouts
from memplan.fit.steptime import StepTime, step_time

__all__ = [
    "DEFAULT_TOKENS_PER_STEP",
    "FIT_MARGIN",
    "HARDWARE",
    "MIG_PROFILES",
    "Candidate",
    "Colocation",
    "CurvePoint",
    "FitError",
    "FitResult",
    "Hardware",
    "Layout",
    "Limit",
    "MethodResult",
    "MethodsResult",
    "NoFitError",
    "ProcessMemory",
    "RejectedFamily",
    "SearchSpace",
    "SharedJob",
    "StepTime",
    "colocate",
    "compare_methods",
    "default_global_batch",
    "enumerate_layouts",
    "fit",
    "fits_memory",
    "max_micro_batch",
    "max_seq_length",
    "memory_limit",
    "resolve_device",
    "step_time",
]


class _CallablePackage(types.ModuleType):
    """This package, callable as its main function: ``memplan.fit(...)`` is ``memplan.fit.fit(...)``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return fit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
