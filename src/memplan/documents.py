"""The JSON documents of ``memplan estimate``, ``models`` and ``gpus``: what ``--json`` prints and what
``memplan serve`` answers (``POST /v1/estimate``, ``GET /v1/models``, ``GET /v1/gpus``).

One function each, so that the command line and the HTTP API cannot drift apart: the same job gets
the same document from both. ``memplan fit``'s document is :func:`memplan.fit.question.answer`'s;
``memplan doctor``'s is :meth:`memplan.doctor.DoctorReport.to_json`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memplan.estimate.engine import DEFAULT_FRAGMENTATION, Estimate, estimate
from memplan.gpus import get_gpu, list_gpus
from memplan.inputs import LoadedJob

__all__ = ["estimate_document", "estimate_loaded", "gpus_document", "models_document"]


def estimate_document(loaded: LoadedJob) -> tuple[Estimate, dict[str, Any]]:
    """Estimate the loaded job: the result and its JSON document (``Estimate.to_dict()``, which carries
    the input settings the dialect files gave)."""
    result = estimate_loaded(loaded)
    return result, result.to_dict()


def estimate_loaded(loaded: LoadedJob) -> Estimate:
    """The estimate of a loaded job (its GPU, fragmentation and input settings applied): the result
    :func:`estimate_document` documents, for a caller that prints tables instead."""
    fragmentation = DEFAULT_FRAGMENTATION if loaded.fragmentation is None else loaded.fragmentation
    return estimate(loaded.model, loaded.job, gpu=loaded.gpu and get_gpu(loaded.gpu), fragmentation=fragmentation,
                    settings=loaded.settings)


def models_document() -> list[dict[str, Any]]:
    """The shipped presets (name, type, parameters, layers, hidden size, MoE), one object each."""
    from memplan.model import list_presets

    return [dataclasses.asdict(p) for p in list_presets()]


def gpus_document() -> list[dict[str, Any]]:
    """The GPU catalogue, one object each, with the memory PyTorch's allocator can use."""
    return [{**dataclasses.asdict(g), "usable_bytes": g.usable_bytes} for g in list_gpus()]
