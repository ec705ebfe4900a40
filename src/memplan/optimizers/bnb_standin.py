"""The tracer's stand-in for bitsandbytes' optimizers (8-bit, paged, Lion), whose CUDA kernels cannot run on fake
tensors. Imports torch: loaded only by the registry entries' builders (:mod:`memplan.optimizers.bnb`).

:class:`BitsAndBytesStandIn` allocates each parameter's state as ``bitsandbytes.optim.optimizer``
(0.50) ``Optimizer8bit.init_state`` does, and updates in place as its fused kernels do (no
temporaries):

* ``optim_bits`` 8: ``state1`` (and ``state2`` for Adam) ``uint8`` like the parameter, with an fp32
  ``absmax`` per 256-element block each, and the optimizer's two shared 256-entry fp32 quantization
  maps; parameters under ``min_8bit_size`` (4096 elements) get fp32 states;
* ``optim_bits`` 32 (``lion``, ``paged-adamw``): fp32 states like the parameter;
* paged optimizers (``paged-*``): a state buffer of a parameter with at least 1e5 elements lives in
  CUDA unified memory (``F.get_paged``), outside PyTorch's caching allocator: its storage is listed in
  :attr:`BitsAndBytesStandIn.outside_allocator` and left out of a ``cuda`` trace's device total. On
  the CPU bitsandbytes falls back to ordinary buffers, and so does a ``cpu`` trace.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["BitsAndBytesStandIn"]

#: bitsandbytes ``min_8bit_size``: smaller parameters keep 32-bit states.
MIN_8BIT_SIZE = 4096
#: Elements per fp32 absmax of an 8-bit state (``blocksize = 256`` in ``init_state``).
STATE_BLOCKSIZE = 256
#: Parameters from this size get paged state buffers (``get_state_buffer``: ``p.numel() < 1e5`` is not paged).
MIN_PAGED_NUMEL = 100_000
_QMAP_ENTRIES = 256


class BitsAndBytesStandIn(torch.optim.Optimizer):
    """What a bitsandbytes optimizer allocates, on fake tensors; the update itself is not computed."""

    def __init__(self, params: Iterable[Any], *, states_per_param: int, bits: int, paged: bool, paged_on_device: bool,
                 lr: float = 1e-4) -> None:
        """``states_per_param`` (2: Adam, 1: Lion), ``bits`` (8 or 32) and ``paged``: what the registry entry
        (:mod:`memplan.optimizers.bnb`) says of the optimizer."""
        super().__init__(params, {"lr": lr})
        self.states_per_param, self.bits = states_per_param, bits
        self.paged = paged and paged_on_device
        #: ids of state tensors in CUDA unified memory (outside PyTorch's allocator).
        self.outside_allocator: set[int] = set()
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    def _buffer(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.zeros_like(param, dtype=dtype)
        if self.paged and param.numel() >= MIN_PAGED_NUMEL:
            self.outside_allocator.add(id(buffer))
        return buffer

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        eight_bit = self.bits == 8 and param.numel() >= MIN_8BIT_SIZE
        dtype = torch.uint8 if eight_bit else torch.float32
        blocks = -(-param.numel() // STATE_BLOCKSIZE)
        for index in range(1, self.states_per_param + 1):
            state[f"state{index}"] = self._buffer(param, dtype)
            if eight_bit:
                if self._qmaps is None:
                    self._qmaps = (torch.zeros(_QMAP_ENTRIES), torch.zeros(_QMAP_ENTRIES))
                state[f"qmap{index}"] = self._qmaps[index - 1]
                state[f"absmax{index}"] = torch.zeros(blocks, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Create missing states and count the step; the in-place kernels allocate nothing."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    self._init_state(param, state)
                state["step"] += 1
