"""What the safety net needs to redo a step exactly: gradients set aside, RNG state restored."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RngState", "drop_grads", "restore_grads", "rng_state", "set_rng_state", "stash_grads"]

#: CPU generator state, and the CUDA one of the device when training there.
RngState = tuple[torch.Tensor, torch.Tensor | None]
GradStash = list[tuple[nn.Parameter, torch.Tensor]]


def stash_grads(model: nn.Module) -> GradStash:
    """Take existing gradients off the parameters (a step then starts from ``None`` gradients)."""
    stash = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    for p, _ in stash:
        p.grad = None
    return stash


def drop_grads(model: nn.Module) -> None:
    """Forget the gradients of a failed attempt."""
    for p in model.parameters():
        p.grad = None


def restore_grads(stash: GradStash) -> None:
    """Add the set-aside gradients back: ``old + new``, the sum plain accumulation computes."""
    for p, old in stash:
        p.grad = old if p.grad is None else old.add_(p.grad)


def rng_state(device: torch.device) -> RngState:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
