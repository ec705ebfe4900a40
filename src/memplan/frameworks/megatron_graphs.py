"""Megatron-LM's CUDA-graph flags as a :class:`~memplan.job.CudaGraphs`.

``--cuda-graph-impl`` picks the implementation; the deprecated ``--enable-cuda-graph`` means ``local``
and ``--external-cuda-graph`` ``transformer_engine`` (megatron/training/arguments.py ``validate_args``).
``--cuda-graph-modules`` (formerly ``--cuda-graph-scope``, nargs='+') restricts per-layer capture; its
deprecated values migrate as Megatron migrates them (docs/user-guide/features/cuda_graph.md): ``full``
is the whole layer (an empty list), ``full_iteration`` with ``local`` becomes
``--cuda-graph-impl full_iteration``, and ``full_iteration_inference`` only concerns inference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memplan.errors import ModelConfigError
from memplan.frameworks.megatron_model import flag_is_set
from memplan.job import CudaGraphs

__all__ = ["cuda_graphs"]

_IMPLS = ("none", "local", "transformer_engine", "full_iteration")


def cuda_graphs(args: Mapping[str, Any]) -> CudaGraphs:
    """The CUDA graphs a Megatron launch captures."""
    impl = _impl(args)
    given = [flag for flag in ("--cuda-graph-modules", "--cuda-graph-scope") if args.get(flag) not in (None, True)]
    if len(given) == 2:
        raise ModelConfigError("--cuda-graph-scope", "cannot be used together with --cuda-graph-modules (Megatron "
                               "refuses it)", args["--cuda-graph-scope"])
    value = args.get(given[0]) if given else None
    names = [str(v) for v in value] if isinstance(value, list) else str(value or "").split()
    modules = []
    for name in names:
        if name == "full_iteration" and impl == "local":
            impl = "full_iteration"
        elif name not in ("full", "full_iteration", "full_iteration_inference"):
            modules.append(name)
    if impl == "none":
        return CudaGraphs()
    return CudaGraphs(impl=impl, modules=",".join(modules))  # type: ignore[arg-type]


def _impl(args: Mapping[str, Any]) -> str:
    impl = str(args.get("--cuda-graph-impl", "none"))
    if impl not in _IMPLS:
        raise ModelConfigError("--cuda-graph-impl", f"must be one of {', '.join(_IMPLS)}", impl)
    enable, external = flag_is_set(args, "--enable-cuda-graph"), flag_is_set(args, "--external-cuda-graph")
    if (enable or external) and impl != "none":
        raise ModelConfigError("--cuda-graph-impl", "cannot be combined with --enable-cuda-graph or "
                               "--external-cuda-graph (Megatron refuses it)", impl)
    if enable and external:
        raise ModelConfigError("--external-cuda-graph", "cannot be combined with --enable-cuda-graph (Megatron "
                               "refuses it)", True)
    return "local" if enable else "transformer_engine" if external else impl
