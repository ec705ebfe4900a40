"""CUDA backend: the core behind ``torch.cuda.memory.CUDAPluggableAllocator`` in a ``torch.cuda.MemPool``.

The pool is entered with ``torch.cuda.use_mem_pool`` around the ``planned(device="cuda")`` block only
(scoped, not a process-wide swap). PyTorch loads the core library by path and calls
``mpr_cuda_malloc(size, device, stream)`` / ``mpr_cuda_free(ptr, size, device, stream)``; those
serve the arena made current with ``mpr_set_current``. The core reaches cudaMalloc/cudaFree by
dlopen-ing the CUDA runtime (``libcudart.so``, or ``$MEMPLAN_CUDART``), so it builds without the CUDA
toolkit. PyTorch's limits for such pools apply: no expandable segments, no ``empty_cache`` inside,
and ``record_stream`` is not forwarded to a pluggable allocator (blocks are reused on their own stream
only, as the caching allocator does; the core's ``mpr_record_stream`` serves callers that know).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from memplan.alloc.runtime._native import Core, RuntimeUnavailable, core_library_path

__all__ = ["in_cuda_pool"]


@contextlib.contextmanager
def in_cuda_pool(core: Core) -> Iterator[None]:
    try:
        import torch
    except ImportError as exc:
        raise RuntimeUnavailable(f"the CUDA backend needs torch ({exc})") from None
    if not torch.cuda.is_available():
        raise RuntimeUnavailable("the CUDA backend needs a CUDA device; none is available")
    allocator = torch.cuda.memory.CUDAPluggableAllocator(str(core_library_path()), "mpr_cuda_malloc", "mpr_cuda_free")
    pool = torch.cuda.MemPool(allocator.allocator())
    core.set_current()
    try:
        with torch.cuda.use_mem_pool(pool):
            yield
    finally:
        torch.cuda.synchronize()
