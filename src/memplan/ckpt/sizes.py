"""The input size of a batch: what the predictors are functions of (tokens by default)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from memplan.errors import ConfigError

__all__ = ["SizeFn", "batch_of", "default_size", "measure_size"]

SizeFn = Callable[[Any], int]

_NO_TENSOR_HINT = "pass size_fn=..., e.g. auto_checkpoint(model, budget, size_fn=lambda batch: batch.num_tokens)"


def batch_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """What ``size_fn`` receives: the forward's first positional argument, else its keyword arguments."""
    return args[0] if args else dict(kwargs)


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return None
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def default_size(batch: Any) -> int:
    """Tokens in the batch: batch × sequence length of its first tensor (``input_ids`` when named)."""
    t = _first_tensor(batch)
    if t is None:
        raise ConfigError(
            "size_fn", "the batch holds no tensor to take its size (batch × sequence length) from",
            type(batch).__name__, hint=_NO_TENSOR_HINT,
        )
    return int(t.shape[0] * t.shape[1]) if t.dim() >= 2 else int(t.numel())


def measure_size(size_fn: SizeFn, batch: Any) -> int:
    """``size_fn(batch)`` checked to be a positive integer."""
    size = size_fn(batch)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        try:
            size_int = int(size)
        except (TypeError, ValueError):
            size_int = -1
        if isinstance(size, bool) or size_int <= 0 or size_int != size:
            raise ConfigError("size_fn", "must return a positive integer (e.g. tokens in the batch)", size)
        size = size_int
    return size
