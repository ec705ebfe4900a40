"""``--optimizer-in-backward``: each parameter is stepped the moment its gradient is accumulated.

As torchtune's ``optimizer_in_backward`` does: one optimizer per parameter, a
``register_post_accumulate_grad_hook`` on every parameter that steps it and frees its gradient, so
at most the gradients of the parameters whose backward is under way are alive at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["InBackwardOptimizer"]

GradientSeen = Callable[[torch.Tensor], None]
StateSeen = Callable[[torch.optim.Optimizer], None]


class InBackwardOptimizer(torch.optim.Optimizer):
    """Per-parameter optimizers stepped from the backward; ``step`` and ``zero_grad`` do nothing.

    ``state`` holds each parameter's state after its first step (the per-parameter optimizers'
    own dicts). ``observe`` lets a recorder see each gradient just before its step and each
    optimizer's state just after.
    """

    def __init__(self, params: list[torch.nn.Parameter],
                 make_one: Callable[[torch.nn.Parameter], torch.optim.Optimizer]) -> None:
        super().__init__(params, {})
        self._inner = {param: make_one(param) for param in params}
        self._on_gradient: GradientSeen | None = None
        self._on_state: StateSeen | None = None
        self._handles = [param.register_post_accumulate_grad_hook(self._step_one) for param in params]

    def observe(self, gradient: GradientSeen | None, state: StateSeen | None) -> None:
        """Call ``gradient(param)`` before each step and ``state(optimizer)`` after it (None: stop)."""
        self._on_gradient, self._on_state = gradient, state

    def _step_one(self, param: torch.Tensor) -> None:
        inner = self._inner[param]  # type: ignore[index]
        if self._on_gradient is not None:
            self._on_gradient(param)
        inner.step()
        inner.zero_grad(set_to_none=True)
        self.state[param] = inner.state[param]
        if self._on_state is not None:
            self._on_state(inner)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing to do: every parameter was stepped in the backward."""
        return

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: every gradient was freed after its step."""
        return
