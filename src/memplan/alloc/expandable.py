"""Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``).

One segment per (stream, pool) reserves a large virtual range (1 1/8 of the device's memory) and
maps physical pages on demand: 2 MiB pages for the small pool (``kSmallBuffer``), 20 MiB for the
large pool (``kLargeBuffer``). A request that no cached block serves maps pages at the lowest
address where free plus unmapped space is large enough (``find_expandable_block``,
``try_allocate_expandable_block``, ``map_block``); emptying the cache unmaps whole free pages
(``unmap_block``). Functions here operate on a :class:`~memplan.alloc.allocator.CachingAllocator`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.alloc.blocks import Block, BlockPool, Segment
from memplan.alloc.constants import K_LARGE_BUFFER, K_SMALL_BUFFER

if TYPE_CHECKING:
    from memplan.alloc.allocator import CachingAllocator

__all__ = ["release_expandable_blocks", "try_allocate_expandable_block"]

_UNLIMITED_ADDRESS_SPACE = 1 << 44


def _page(block: Block) -> int:
    return K_SMALL_BUFFER if block.small else K_LARGE_BUFFER


def _splice(block: Block, before: Block | None, after: Block | None) -> None:
    block.prev = before
    if before is not None:
        before.next = block
    block.next = after
    if after is not None:
        after.prev = block


def _find_expandable_block(alloc: CachingAllocator, pool: BlockPool, stream: int, size: int) -> Block:
    def allocatable(b: Block | None) -> bool:
        return b is not None and not b.allocated

    def has_space(b: Block | None) -> bool:
        total = 0
        while total < size and b is not None and allocatable(b):
            total += b.size
            b = b.next
        return total >= size

    for candidate in pool.unmapped_of_stream(stream):
        start = candidate.prev if allocatable(candidate.prev) else candidate
        if has_space(start):
            return start  # type: ignore[return-value]
    capacity = alloc.settings.capacity
    space = capacity + capacity // 8 if capacity else _UNLIMITED_ADDRESS_SPACE
    address = alloc._new_address(space, stream)
    segment = Segment(address, space, stream, pool.small, expandable=True)
    alloc.segments[address] = segment
    block = Block(address, space, stream, pool.small, segment)
    block.mapped = False
    pool.insert_unmapped(block)
    return block


def _map_block(alloc: CachingAllocator, block: Block, size: int, pool: BlockPool) -> bool:
    page = _page(block)
    offset = block.address - block.segment.address
    first, end = offset // page, -(-(offset + size) // page)
    mapped = (end - first) * page
    if not alloc._fits(mapped):
        return False
    address = block.address
    pool.remove_unmapped(block)
    block.mapped = True
    if mapped < block.size:
        rest = Block(block.address + mapped, block.size - mapped, block.stream, block.small, block.segment)
        rest.mapped = False
        _splice(rest, block, block.next)
        pool.insert_unmapped(rest)
        block.size = mapped
    alloc._try_merge(block, block.prev, pool)
    alloc._try_merge(block, block.next, pool)
    pool.insert(block)
    alloc.reserved += mapped
    alloc._record("segment_map", address, mapped, block.stream)
    return True


def try_allocate_expandable_block(alloc: CachingAllocator, pool: BlockPool, stream: int, size: int) -> Block | None:
    """Map enough pages at the lowest possible address; the block returned is out of the pool."""
    candidate = _find_expandable_block(alloc, pool, stream, size)
    if not candidate.mapped and not _map_block(alloc, candidate, min(candidate.size, size), pool):
        return None
    while candidate.size < size:
        following = candidate.next
        assert following is not None and not following.mapped
        if not _map_block(alloc, following, min(size - candidate.size, following.size), pool):
            return None
        candidate = following
    pool.remove(candidate)
    return candidate


def _unmap_block(alloc: CachingAllocator, block: Block, pool: BlockPool) -> None:
    page = _page(block)
    base = block.segment.address
    offset = block.address - base
    first, end = -(-offset // page), (offset + block.size) // page
    if first >= end:
        return
    start, length = base + first * page, (end - first) * page
    pool.remove(block)
    before = start - block.address
    if before > 0:
        head = Block(block.address, before, block.stream, block.small, block.segment)
        _splice(head, block.prev, block)
        pool.insert(head)
    after = block.size - before - length
    if after > 0:
        tail = Block(start + length, after, block.stream, block.small, block.segment)
        _splice(tail, block, block.next)
        pool.insert(tail)
    block.address, block.size, block.mapped = start, length, False
    alloc._try_merge(block, block.prev, pool)
    alloc._try_merge(block, block.next, pool)
    pool.insert_unmapped(block)
    alloc.reserved -= length
    alloc._record("segment_unmap", start, length, block.stream)


def release_expandable_blocks(alloc: CachingAllocator, pool: BlockPool, blocks: list[Block]) -> None:
    """Unmap the whole free pages of ``blocks``; drop segments that become entirely unmapped."""
    for block in blocks:
        _unmap_block(alloc, block, pool)
        if not block.mapped and not block.is_split:
            pool.remove_unmapped(block)
            alloc.segments.pop(block.segment.address, None)
