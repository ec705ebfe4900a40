"""PyTorch's own memory-history and out-of-memory hooks, behind one small interface.

:class:`TorchCudaHooks` is the real thing, imported lazily (torch is imported on :meth:`start`):

* ``torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=..., max_entries=...)``
  keeps the allocator's ring buffer of alloc/free events with their stacks
  (``torch/cuda/memory.py``); ``enabled=None`` stops it;
* ``torch.cuda.memory._snapshot()`` returns that history and the segments as plain dicts and lists
  (what ``_dump_snapshot`` pickles);
* ``torch._C._cuda_attach_out_of_memory_observer(observer)`` makes the caching allocator call
  ``observer(device, alloc_size, device_total, device_free)`` when a request fails, after the
  ``oom`` trace entry is recorded and before the ``OutOfMemoryError`` is raised
  (``c10/cuda/CUDACachingAllocator.cpp``: the third argument is the device's total memory, or
  the allowed maximum under ``torch.cuda.set_per_process_memory_fraction``). PyTorch offers no way
  to detach an observer, so :class:`~memplan.watch.session.Watch` disarms its own instead.

Any object with the same four methods can stand in (a recorded snapshot replayed on a machine
without a GPU, as the tests do).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

__all__ = ["MemoryHooks", "Observer", "TorchCudaHooks", "cuda_unavailable_reason"]

#: ``observer(device, alloc_size, device_total, device_free)``, as the caching allocator calls it.
Observer = Callable[[int, int, int, int], None]


class MemoryHooks(Protocol):
    """Where a :class:`~memplan.watch.session.Watch` records memory history and takes snapshots."""

    def start(self, *, max_entries: int, stacks: Literal["python", "all"]) -> None: ...

    def stop(self) -> None: ...

    def snapshot(self) -> Mapping[str, Any]: ...

    def attach_oom_observer(self, observer: Observer) -> None: ...


def cuda_unavailable_reason() -> str | None:
    """Why the real hooks cannot run here (``None`` when they can): torch missing, no CUDA build, no GPU."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


class TorchCudaHooks:
    """The hooks of ``torch.cuda`` (see the module docstring)."""

    def start(self, *, max_entries: int, stacks: Literal["python", "all"]) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=stacks,
                                                 max_entries=max_entries)

    def stop(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)

    def snapshot(self) -> Mapping[str, Any]:
        import torch

        return torch.cuda.memory._snapshot()

    def attach_oom_observer(self, observer: Observer) -> None:
        import torch

        torch._C._cuda_attach_out_of_memory_observer(observer)
