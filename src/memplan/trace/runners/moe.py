"""Mixture-of-experts models on fake tensors.

Routing decides *which* tokens go to which expert, and code that gathers each expert's tokens
with ``nonzero``/``where`` has output shapes that depend on the router's values, which fake
tensors do not have. transformers' ``grouped_mm`` experts implementation is static instead: it
sorts the ``tokens x top_k`` (token, expert) pairs by expert and runs one grouped GEMM over all of
them, so its memory is the same for any routing — on one rank (no expert parallelism) every
routing, balanced or not, moves exactly ``tokens x top_k`` rows through the experts.

``--moe-routing balanced`` (the default) therefore selects that implementation for every MoE
block (``config._experts_implementation = "grouped_mm"``): the traced memory is that of a run
whose routing is balanced, and equal to any other routing's on one rank. Where PyTorch's
``_grouped_mm`` meta kernel refuses a dtype (it checks the CUDA kernel's bf16 requirement), the
trace uses transformers' ``grouped_mm_fallback`` operator, whose fake implementation produces the
same output shapes. ``--moe-routing error`` keeps the model's own implementation; a data-dependent
one then stops with an error naming the operator and the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["STATIC_EXPERTS", "static_grouped_mm", "static_routing"]

#: transformers' experts implementation whose shapes do not depend on the routing.
STATIC_EXPERTS = "grouped_mm"


def static_routing(model: torch.nn.Module) -> int:
    """Select the static experts implementation on every config of ``model``; returns how many."""
    changed = 0
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "_experts_implementation"):
            continue
        seen.add(id(config))
        if _has_experts(model):
            config._experts_implementation = STATIC_EXPERTS
            changed += 1
    return changed


def _has_experts(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.endswith("Experts") for m in model.modules())


@contextmanager
def static_grouped_mm() -> Iterator[None]:
    """Route grouped GEMMs that PyTorch's meta kernel refuses (non-bf16) to transformers' fallback op."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return

    def can_use(input: Any, weight: Any, offs: Any) -> bool:
        return bool(weight.dtype == torch.bfloat16 and original(input, weight, offs))

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
