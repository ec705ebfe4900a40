"""The constants of PyTorch's CUDA caching allocator, in one place, with their source.

Every value is copied from ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch, read at
commit 001074d25084; unchanged from torch 2.1 to 2.13 for these names) or from
``c10/cuda/CUDAAllocatorConfig.{h,cpp}`` for the configuration limits. The simulator and the
settings parser import them from here and nowhere else.
"""

from __future__ import annotations

from memplan.units import MiB

__all__ = [
    "ADDRESS_ALIGNMENT",
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "MAX_SPLIT_SIZE_MIN_MB",
    "NO_MAX_SPLIT",
    "ROUNDUP_INTERVALS",
    "ROUNDUP_INTERVAL_START_LOG2",
]

#: ``kMinBlockSize``: every request is rounded up to a multiple of 512 bytes (and to at least 512).
K_MIN_BLOCK_SIZE = 512
#: ``kSmallSize``: requests of at most 1 MiB are served from the small pool.
K_SMALL_SIZE = 1 * MiB
#: ``kSmallBuffer``: small-pool segments are 2 MiB (also the page of a small expandable segment).
K_SMALL_BUFFER = 2 * MiB
#: ``kLargeBuffer``: requests between 1 and 10 MiB get a 20 MiB segment (also the page of a
#: large expandable segment, and the slack within which an oversize block may serve a request).
K_LARGE_BUFFER = 20 * MiB
#: ``kMinLargeAlloc``: requests of 10 MiB or more get a segment of their own size...
K_MIN_LARGE_ALLOC = 10 * MiB
#: ``kRoundLarge``: ...rounded up to a multiple of 2 MiB.
K_ROUND_LARGE = 2 * MiB

#: ``max_split_size`` when ``max_split_size_mb`` is not set: ``std::numeric_limits<size_t>::max()``.
NO_MAX_SPLIT = 2**64 - 1
#: ``CUDAAllocatorConfig``: ``max_split_size_mb`` must be greater than ``kLargeBuffer / 1 MiB`` (20).
MAX_SPLIT_SIZE_MIN_MB = K_LARGE_BUFFER // MiB

#: ``kRoundUpPowerOfTwoIntervals``: ``roundup_power2_divisions`` holds one value per power-of-two
#: interval of request size, from 1 MiB (index 0, also every size below) to 32 GiB and above (15).
ROUNDUP_INTERVALS = 16
#: log2 of the size at which the first interval starts (1 MiB).
ROUNDUP_INTERVAL_START_LOG2 = 20

#: Alignment of the addresses the simulator invents for new segments (cudaMalloc returns
#: 2 MiB-aligned addresses for allocations of 2 MiB and more). Not an allocator constant.
ADDRESS_ALIGNMENT = 2 * MiB
