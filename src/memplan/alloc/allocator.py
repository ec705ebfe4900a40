"""A rule-for-rule model of one device of PyTorch's ``DeviceCachingAllocator``.

Each method names the C++ function it follows (``c10/cuda/CUDACachingAllocator.cpp``); the
constants come from :mod:`memplan.alloc.constants`. What is modelled: 512-byte rounding and
``roundup_power2_divisions``; the small (<= 1 MiB, 2 MiB segments) and large pools (20 MiB
segments below 10 MiB, else the request rounded to 2 MiB); best fit by (stream, size, address);
``should_split``; the oversize rules of ``max_split_size``; coalescing on free; per-stream pools;
``garbage_collection_threshold``; ``expandable_segments`` (one growing segment per stream and
pool, 2 MiB / 20 MiB pages); at a capacity, free-one-oversize-block / free-all-cached and retry,
then the OOM PyTorch raises.

Known limitations: no cross-stream ``record_stream`` uses (a free completes at once), no CUDA
graph private pools, no IPC, the free-memory callbacks are empty; cudaMalloc's addresses are
invented (increasing, 2 MiB aligned) unless an address source is given.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from memplan.alloc.blocks import Block, BlockPool, Segment, SegmentEvent, key_stream, size_key
from memplan.alloc.constants import (
    ADDRESS_ALIGNMENT,
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    NO_MAX_SPLIT,
)
from memplan.alloc.settings import AllocatorSettings
from memplan.errors import MemplanError

__all__ = ["AddressSource", "CachingAllocator", "OutOfMemory", "allocation_size", "format_size", "oom_message",
           "round_size"]

_FIRST_ADDRESS = 0x7F0000000000


class OutOfMemory(MemplanError):
    """The allocator could not serve a request within the capacity (PyTorch's OutOfMemoryError)."""

    def __init__(self, message: str, *, size: int, alloc_size: int) -> None:
        super().__init__(message)
        self.size = size
        self.alloc_size = alloc_size


def format_size(size: int) -> str:
    """``format_size`` of the allocator: ``512 bytes``, ``1.50 KiB``, ``20.00 MiB``, ``2.00 GiB``."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


def oom_message(capacity: int | None, reserved: int, allocated: int, alloc_size: int) -> str:
    """The message of PyTorch's OutOfMemoryError (without the per-process NVML part) for that state."""
    capacity = capacity or 0
    return (
        f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 has a total capacity of "
        f"{format_size(capacity)} of which {format_size(max(capacity - reserved, 0))} is free. "
        f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and "
        f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated. "
        "If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
        "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_size(size: int, settings: AllocatorSettings) -> int:
    """``round_size``: at least 512, a multiple of 512, or the next power-of-two division."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = settings.divisions_for(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a rounded request would cudaMalloc."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


AddressSource = Callable[[int, int], "int | None"]


class CachingAllocator:
    """One device's caching allocator. ``malloc``/``free`` mirror ``DeviceCachingAllocator``.

    Example::

        alloc = CachingAllocator(AllocatorSettings())
        block = alloc.malloc(3_000_000, stream=0)   # a 20 MiB segment, split
        alloc.free(block)
        alloc.reserved, alloc.allocated              # (20971520, 0)
    """

    def __init__(self, settings: AllocatorSettings, *, address_source: AddressSource | None = None) -> None:
        self.settings = settings
        self.small_pool = BlockPool(small=True)
        self.large_pool = BlockPool(small=False)
        #: ``total_allocated_memory``: bytes cudaMalloc'ed or mapped (PyTorch's "reserved").
        self.reserved = 0
        #: Sum of the sizes of allocated blocks (PyTorch's "allocated", rounded sizes).
        self.allocated = 0
        self.requested = 0
        self.segments: dict[int, Segment] = {}
        self.segment_events: list[SegmentEvent] = []
        self.num_alloc_retries = 0
        self.event_index = 0
        self._address_source = address_source
        self._next_address = _FIRST_ADDRESS
        self._max_split = settings.max_split_size
        self._gc = settings.capacity is not None and settings.garbage_collection_threshold > 0.0
        self._expandable = settings.expandable_segments
        self._plain_rounding = all(d <= 1 for d in settings.roundup_power2_divisions)

    # ------------------------------------------------------------------------------------------
    # malloc / free

    def malloc(self, orig_size: int, stream: int = 0) -> Block:
        """Serve a request of ``orig_size`` bytes; raises :class:`OutOfMemory` like PyTorch."""
        if self._plain_rounding:
            size = K_MIN_BLOCK_SIZE if orig_size < K_MIN_BLOCK_SIZE else -(-orig_size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
        else:
            size = round_size(orig_size, self.settings)
        pool = self.small_pool if size <= K_SMALL_SIZE else self.large_pool
        block = self._get_free_block(pool, stream, size)
        if block is None:
            alloc_size = allocation_size(size)
            if self._gc:
                self._garbage_collect()
            block = self._alloc_block(pool, stream, size, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, stream, size):
                block = self._alloc_block(pool, stream, size, alloc_size)
            if block is None:
                self._release_cached_blocks()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, stream, size, alloc_size)
            if block is None:
                raise OutOfMemory(self.oom_message(alloc_size), size=orig_size, alloc_size=alloc_size)
        if self._should_split(block, size):
            block = self._split(block, size, pool)
        block.allocated = True
        block.requested = orig_size
        self.allocated += block.size
        self.requested += orig_size
        return block

    def free(self, block: Block) -> None:
        """``free`` + ``free_block``: return a block to its pool, merging with free neighbours."""
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        pool = self.small_pool if block.small else self.large_pool
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._try_merge(block, prev, pool)
        if nxt is not None and not nxt.allocated:
            self._try_merge(block, nxt, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """``emptyCache``: release every unsplit cached block (and unmap free expandable pages)."""
        self._release_cached_blocks()

    # ------------------------------------------------------------------------------------------
    # the rules

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self._expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: BlockPool, stream: int, size: int) -> Block | None:
        if self._gc:
            pool.free_calls += 1
        keys = pool.keys
        index = bisect_left(keys, size_key(stream, size))  # pool.first_at_least, one call fewer
        if index >= len(keys) or key_stream(keys[index]) != stream:
            return None
        key = keys[index]
        block = pool.blocks[key]
        if block.segment.expandable:
            if self._expandable:
                block = self._best_expandable(pool, stream, index)
                key = -1  # not known: removed by pool.remove below
            else:
                index += 1
                while index < len(keys) and key_stream(keys[index]) == stream \
                        and pool.blocks[keys[index]].segment.expandable:
                    index += 1
                if index >= len(keys) or key_stream(keys[index]) != stream:
                    return None
                key = keys[index]
                block = pool.blocks[key]
        max_split = self._max_split
        if size < max_split <= block.size:
            return None  # do not return an oversized block for a small request
        if size >= max_split and block.size >= size + K_LARGE_BUFFER:
            return None  # an oversized block may only be rounded up within kLargeBuffer
        if key < 0:
            pool.remove(block)
        else:  # pool.remove without searching again: the block is keys[index]
            del pool.blocks[key]
            del keys[index]
        return block

    def _best_expandable(self, pool: BlockPool, stream: int, index: int) -> Block:
        """Among expandable blocks, best fit counts the unmapped space that follows a block."""
        def expandable_size(b: Block) -> int:
            nxt = b.next
            return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

        keys = pool.keys
        block = pool.blocks[keys[index]]
        nxt_index = index + 1
        while block.segment.expandable and nxt_index < len(keys) and key_stream(keys[nxt_index]) == stream:
            candidate = pool.blocks[keys[nxt_index]]
            if expandable_size(candidate) >= expandable_size(block):
                break
            block = candidate
            nxt_index += 1
        return block

    def _split(self, block: Block, size: int, pool: BlockPool) -> Block:
        """``alloc_found_block`` with ``split_remainder``: the request takes the low addresses."""
        head = Block(block.address, size, block.stream, block.small, block.segment)
        head.prev = block.prev
        if head.prev is not None:
            head.prev.next = head
        head.next = block
        block.prev = head
        block.address += size
        block.size -= size
        pool.insert(block)
        return head

    def _try_merge(self, dst: Block, src: Block | None, pool: BlockPool) -> int:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ------------------------------------------------------------------------------------------
    # segments

    def _new_address(self, size: int, stream: int) -> int:
        if self._address_source is not None:
            address = self._address_source(size, stream)
            if address is not None:
                return address
        address = self._next_address
        self._next_address += -(-size // ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT + ADDRESS_ALIGNMENT
        return address

    def _record(self, action: str, address: int, size: int, stream: int) -> None:
        self.segment_events.append(SegmentEvent(self.event_index, action, address, size, stream))

    def _fits(self, size: int) -> bool:
        capacity = self.settings.capacity
        return capacity is None or self.reserved + size <= capacity

    def _alloc_block(self, pool: BlockPool, stream: int, size: int, alloc_size: int) -> Block | None:
        """``alloc_block``: cudaMalloc a new segment (or map pages of an expandable one)."""
        if self._expandable:
            from memplan.alloc.expandable import try_allocate_expandable_block

            return try_allocate_expandable_block(self, pool, stream, size)
        if not self._fits(alloc_size):
            return None
        address = self._new_address(alloc_size, stream)
        segment = Segment(address, alloc_size, stream, pool.small, expandable=False)
        self.segments[address] = segment
        self.reserved += alloc_size
        self._record("segment_alloc", address, alloc_size, stream)
        return Block(address, alloc_size, stream, pool.small, segment)

    def _release_block(self, block: Block, pool: BlockPool) -> None:
        """``release_block``: cudaFree a whole cached segment."""
        pool.remove(block)
        del self.segments[block.address]
        self.reserved -= block.size
        self._record("segment_free", block.address, block.size, block.stream)

    def _release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int) -> bool:
        """Free one oversize cached block big enough, else the largest ones until enough is freed."""
        if self._max_split == NO_MAX_SPLIT:
            return False
        target = max(size, self._max_split)
        keys = pool.keys
        index = pool.first_at_least(stream, target)
        if index < len(keys) and key_stream(keys[index]) == stream:
            block = pool.blocks[keys[index]]
            if block.is_split or block.segment.expandable:
                return False  # never happens in PyTorch: oversize blocks are whole segments
            self._release_block(block, pool)
            return True
        if index == 0:
            return False
        released = 0
        index -= 1
        while index >= 0 and released < target:
            block = pool.blocks[keys[index]]
            if block.size < self._max_split or block.stream != stream:
                break
            released += block.size
            if not block.is_split and not block.segment.expandable:
                self._release_block(block, pool)
            index -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: free every unsplit cached block of both pools."""
        for pool in (self.large_pool, self.small_pool):
            to_unmap = []
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is None:
                    continue
                if block.segment.expandable:
                    to_unmap.append(block)
                elif not block.is_split:
                    self._release_block(block, pool)
            if to_unmap:
                from memplan.alloc.expandable import release_expandable_blocks

                release_expandable_blocks(self, pool, to_unmap)

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: free old unsplit large blocks above the threshold."""
        assert self.settings.capacity is not None
        threshold = int(self.settings.garbage_collection_threshold * self.settings.capacity)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.large_pool
        freeable = [pool.blocks[k] for k in pool.keys if not pool.blocks[k].is_split]
        if not freeable:
            return
        total_age = sum(pool.free_calls - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed, freed_one = 0, True
        while reclaimed < target and freed_one and count > 0:
            age_threshold = total_age / count
            freed_one = False
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is None or block.is_split or block.segment.expandable:
                    continue
                age = pool.free_calls - block.gc_base
                if age >= age_threshold:
                    freed_one = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block, pool)

    # ------------------------------------------------------------------------------------------
    # reporting

    def oom_message(self, alloc_size: int) -> str:
        """The message of PyTorch's OutOfMemoryError (without the per-process NVML part)."""
        return oom_message(self.settings.capacity, self.reserved, self.allocated, alloc_size)

    def free_blocks(self) -> list[Block]:
        """Every cached (free, mapped) block of both pools."""
        return [b for pool in (self.small_pool, self.large_pool) for b in pool.blocks.values()]

    def check_free_pool_keys(self) -> None:
        """Consistency check used by tests: pool keys match their blocks and are sorted."""
        for pool in (self.small_pool, self.large_pool):
            assert pool.keys == sorted(pool.keys)
            assert set(pool.keys) == set(pool.blocks)
            for key, block in pool.blocks.items():
                assert key == block.key and not block.allocated and block.mapped

