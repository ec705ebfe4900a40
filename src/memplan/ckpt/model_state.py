"""What a model already holds before a step: weights, gradients, optimizer states (bytes).

These are the part of the budget no checkpointing plan can touch; :func:`check_budget` refuses a
budget that does not even hold them, with the numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from memplan.categories import MemoryCategory
from memplan.ckpt.meter import storage_bytes
from memplan.errors import ConfigError
from memplan.units import format_bytes

__all__ = ["ModelStateBytes", "check_budget", "model_state_bytes", "optimizer_tensors", "state_tensors"]

#: States per parameter assumed when no optimizer is given: AdamW's two moments (exp_avg, exp_avg_sq).
ASSUMED_STATES_PER_PARAM = 2


@dataclass(frozen=True, kw_only=True)
class ModelStateBytes:
    """Bytes of the model states, and whether the optimizer's were measured or assumed."""

    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    optimizer_assumed: bool

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    def by_category(self) -> dict[MemoryCategory, int]:
        """The states in the categories every engine uses (weights include the module buffers)."""
        return {MemoryCategory.PARAMETER: self.weight_bytes, MemoryCategory.GRADIENT: self.grad_bytes,
                MemoryCategory.OPTIMIZER_STATE: self.optimizer_bytes}


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """Every tensor in the optimizer's state (moments, step counters)."""
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """Weights, buffers, existing gradients and optimizer states: what a step starts with."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    yield from optimizer_tensors(optimizer)


def _assumed_states(params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer | None) -> int:
    """States per parameter when they do not exist yet: Adam-like 2, SGD with momentum 1, else 0."""
    if optimizer is None:
        return ASSUMED_STATES_PER_PARAM
    defaults = optimizer.defaults
    if "betas" in defaults:
        return 2
    if defaults.get("momentum", 0):
        return 1
    return 0


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelStateBytes:
    """Weights + gradients (one per trainable weight) + optimizer states, measured where they exist."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weight = storage_bytes(params + list(model.buffers()))
    grad = storage_bytes(trainable)
    states = list(optimizer_tensors(optimizer))
    if states:
        return ModelStateBytes(weight_bytes=weight, grad_bytes=grad, optimizer_bytes=storage_bytes(states),
                               optimizer_assumed=False)
    return ModelStateBytes(weight_bytes=weight, grad_bytes=grad,
                           optimizer_bytes=_assumed_states(trainable, optimizer) * grad, optimizer_assumed=True)


def check_budget(budget_bytes: int, states: ModelStateBytes) -> None:
    """Refuse a budget that cannot hold the model states, saying by how much and what could work."""
    if budget_bytes > states.total_bytes:
        return
    assumed = " (assumed AdamW: two moments per weight; pass optimizer= to measure yours)" \
        if states.optimizer_assumed else ""
    raise ConfigError(
        "budget",
        f"{format_bytes(budget_bytes)} is not more than the model states it must hold: weights "
        f"{format_bytes(states.weight_bytes)} + gradients {format_bytes(states.grad_bytes)} + optimizer "
        f"states {format_bytes(states.optimizer_bytes)}{assumed} = {format_bytes(states.total_bytes)}",
        budget_bytes,
        hint=f"the minimum that could work is more than {format_bytes(states.total_bytes)} "
        f"({states.total_bytes} bytes) plus the activations of one block",
    )
