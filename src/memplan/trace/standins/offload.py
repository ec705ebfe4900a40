"""``--offload-activations``: every tensor saved for the backward goes to host memory and comes back.

The semantics of ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the forward: the pack
hook copies each saved tensor into a fresh host tensor (parameters too, as ``save_on_cpu`` does),
so the device copy is freed unless something else holds it; the unpack hook copies it back to the
device when the backward needs it. On a ``cuda`` trace the host copies are left out of the device
total (the recorder's ``host`` role), the copies back are device temporaries of the backward.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.trace.core.recorder import HOST, AllocationRecorder

__all__ = ["save_on_host"]


def save_on_host(recorder: AllocationRecorder | None) -> Any:
    """A ``saved_tensors_hooks`` context moving saved tensors to the host and back."""

    def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout)
        host.copy_(tensor)
        if recorder is not None:
            recorder.mark(host.untyped_storage(), HOST)
        return tensor.device, host

    def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        _device, host = packed
        back = torch.empty(host.size(), dtype=host.dtype, layout=host.layout)
        back.copy_(host)
        return back

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
