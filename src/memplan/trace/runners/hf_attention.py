"""The attention function a transformers model calls, looked up as transformers looks it up.

Used by the tracer's ``core_attn`` checkpoint (:mod:`memplan.trace.runners.policies`) and by ``mla_up_proj``
(:mod:`memplan.trace.runners.mla_up`), which both call the model's attention function themselves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["attention_function"]


def attention_function(module: torch.nn.Module, key: str) -> Callable[..., Any]:
    """The attention function transformers registers as ``key`` for ``module``; for ``eager``, the model's
    own ``eager_attention_forward`` (Gemma's soft-capping, GPT-2's scaling...)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    default = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(key, default)  # type: ignore[no-any-return]
