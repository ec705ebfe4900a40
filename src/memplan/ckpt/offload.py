"""Offloading a block's saved tensors to host memory (``saved_tensors_hooks``), and its price.

On CUDA, :class:`OffloadHooks` packs each saved tensor of at least :data:`MIN_OFFLOAD_BYTES` into a
pinned host buffer, copied on a side stream (the compute stream waits for nothing; the copy waits
for the tensor's producer through an event), and unpacks it with a copy back on the side stream that
the compute stream waits for before use. The device tensor's memory is returned to the caching
allocator once the copy is done (``record_stream`` keeps it alive until then).

On a CPU "device" the host *is* the device: a copy frees nothing. :func:`offload_seconds` prices
offloading there as not beneficial (``None``: the planner does not offer it), and
:class:`OffloadHooks` on CPU tensors makes plain copies — meaningful only to test the hooks' logic
(values and gradients unchanged), which is what ``tests/ckpt`` does without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HOST_BYTES_PER_S", "MIN_OFFLOAD_BYTES", "OffloadHooks", "offload_seconds"]

#: Host-device bandwidth assumed for pinned copies (PCIe 4 x16 in practice; bytes per second).
HOST_BYTES_PER_S = 20e9
#: Saved tensors smaller than this stay on the device (their copies cost more than they free).
MIN_OFFLOAD_BYTES = 1 << 20


def offload_seconds(device: torch.device, saved_bytes: int, overlap_s: float) -> float | None:
    """Seconds an offloaded block adds: the round trip not hidden behind ``overlap_s`` of compute.

    ``None`` where offloading frees no device memory (any device but CUDA).
    """
    if device.type != "cuda":
        return None
    return max(0.0, 2.0 * saved_bytes / HOST_BYTES_PER_S - overlap_s)


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of the code run inside go to host memory (pinned, side stream on CUDA)."""

    def __init__(self, device: torch.device, *, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.device = device
        self.min_bytes = min_bytes
        self.offloaded_bytes = 0
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or t.device.type == "meta" or t.device.type != self.device.type:
            return t
        self.offloaded_bytes += nbytes
        if self._stream is None:
            return (t.device, t.detach().clone())
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(t.detach(), non_blocking=True)
        t.record_stream(self._stream)
        event = self._stream.record_event()
        return (t.device, host, event)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if self._stream is None:
            return packed[1]
        device, host, event = packed
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            back = host.to(device, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(self._stream)
        back.record_stream(torch.cuda.current_stream(device))
        return back
