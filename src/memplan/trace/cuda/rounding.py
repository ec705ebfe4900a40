"""How the CUDA caching allocator sizes a request, and how a GPU run's optimizer runs.

A trace records the bytes the program *requested*; a ``--device cuda`` report shows them "as CUDA
would allocate": every request is rounded up to a multiple of 512 bytes (``kMinBlockSize`` and
``round_size()`` in PyTorch's ``c10/cuda/CUDACachingAllocator.cpp``), and a zero-byte request
allocates nothing. ``torch.cuda.max_memory_allocated`` counts these rounded sizes.
"""

from __future__ import annotations

__all__ = ["CUDA_MIN_BLOCK_BYTES", "cuda_allocated_size"]

#: ``kMinBlockSize`` of c10/cuda/CUDACachingAllocator.cpp: all sizes are rounded to multiples of it.
CUDA_MIN_BLOCK_BYTES = 512


def cuda_allocated_size(requested_bytes: int) -> int:
    """Bytes the CUDA caching allocator counts as allocated for a request of ``requested_bytes``.

    >>> cuda_allocated_size(1), cuda_allocated_size(512), cuda_allocated_size(513), cuda_allocated_size(0)
    (512, 512, 1024, 0)
    """
    if requested_bytes <= 0:
        return 0
    blocks = -(-requested_bytes // CUDA_MIN_BLOCK_BYTES)
    return blocks * CUDA_MIN_BLOCK_BYTES
