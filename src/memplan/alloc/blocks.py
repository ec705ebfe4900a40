"""The allocator's blocks, segments and free-block pools (data structures of the simulator).

A :class:`BlockPool` keeps its free blocks sorted the way ``BlockComparatorSize`` orders them
(stream, then size, then address), as a sorted list of integer keys searched with :mod:`bisect`:
``key = stream << 112 | size << 56 | address``. One integer comparison replaces a tuple
comparison, which is what lets the simulator replay a million events in seconds. Unmapped
ranges of expandable segments are kept by (stream, address), like ``BlockComparatorAddress``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

__all__ = ["ADDR_BITS", "SIZE_BITS", "Block", "BlockPool", "Segment", "size_key"]

ADDR_BITS = 56
SIZE_BITS = 56
_STREAM_SHIFT = ADDR_BITS + SIZE_BITS
_ADDR_MASK = (1 << ADDR_BITS) - 1


class Segment:
    """One cudaMalloc'ed segment, or one expandable segment's reserved address range."""

    __slots__ = ("address", "expandable", "size", "small", "stream")

    def __init__(self, address: int, size: int, stream: int, small: bool, expandable: bool) -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.small = small
        self.expandable = expandable


class Block:
    """A contiguous range of a segment: allocated, free (cached) or, in an expandable segment, unmapped."""

    __slots__ = (
        "address",
        "allocated",
        "gc_base",
        "mapped",
        "next",
        "prev",
        "requested",
        "segment",
        "size",
        "small",
        "stream",
    )

    def __init__(self, address: int, size: int, stream: int, small: bool, segment: Segment) -> None:
        self.address = address
        self.size = size
        self.requested = 0
        self.stream = stream
        self.small = small
        self.allocated = False
        self.mapped = True
        self.prev: Block | None = None
        self.next: Block | None = None
        self.segment = segment
        self.gc_base = 0

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    @property
    def key(self) -> int:
        return (self.stream << _STREAM_SHIFT) | (self.size << ADDR_BITS) | self.address


def size_key(stream: int, size: int) -> int:
    """The smallest key of a block of ``stream`` with at least ``size`` bytes (the search key)."""
    return (stream << _STREAM_SHIFT) | (size << ADDR_BITS)


def key_stream(key: int) -> int:
    return key >> _STREAM_SHIFT


class BlockPool:
    """Free blocks of one pool (small or large), ordered by (stream, size, address)."""

    __slots__ = ("blocks", "free_calls", "keys", "small", "unmapped", "unmapped_keys")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []
        self.blocks: dict[int, Block] = {}
        self.unmapped_keys: list[int] = []
        self.unmapped: dict[int, Block] = {}
        #: ``get_free_blocks_call_count``: the clock of the garbage collector's block ages.
        self.free_calls = 0

    def insert(self, block: Block) -> None:
        """``insert_into_blocks``: add a free mapped block and restart its GC age."""
        key = (block.stream << _STREAM_SHIFT) | (block.size << ADDR_BITS) | block.address
        block.gc_base = self.free_calls
        self.blocks[key] = block
        keys = self.keys
        if not keys or key > keys[-1]:
            keys.append(key)
        else:
            insort(keys, key)

    def remove(self, block: Block) -> None:
        key = (block.stream << _STREAM_SHIFT) | (block.size << ADDR_BITS) | block.address
        del self.blocks[key]
        keys = self.keys
        del keys[bisect_left(keys, key)]

    def first_at_least(self, stream: int, size: int) -> int:
        """Index in :attr:`keys` of the best-fit candidate (may be past the end)."""
        return bisect_left(self.keys, size_key(stream, size))

    def insert_unmapped(self, block: Block) -> None:
        key = (block.stream << ADDR_BITS) | block.address
        self.unmapped[key] = block
        insort(self.unmapped_keys, key)

    def remove_unmapped(self, block: Block) -> None:
        key = (block.stream << ADDR_BITS) | block.address
        del self.unmapped[key]
        del self.unmapped_keys[bisect_left(self.unmapped_keys, key)]

    def unmapped_of_stream(self, stream: int) -> list[Block]:
        """Unmapped blocks of ``stream`` in address order."""
        start = bisect_left(self.unmapped_keys, stream << ADDR_BITS)
        out = []
        for key in self.unmapped_keys[start:]:
            if key >> ADDR_BITS != stream:
                break
            out.append(self.unmapped[key])
        return out


@dataclass(frozen=True)
class SegmentEvent:
    """A segment created or released (``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap``)."""

    index: int
    action: str
    address: int
    size: int
    stream: int
