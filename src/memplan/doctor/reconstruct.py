"""An allocation history rebuilt from an out-of-memory message, so that a message alone can be replayed.

A message says how much PyTorch had reserved and allocated and what it asked for, not how the
reserve was laid out. A fragmentation verdict means the request did not fit in any cached block,
however much was cached. This module builds the history that is *most* fragmented and still
consistent with every figure: the reserve cut into segments that each hold live bytes and one
cached hole smaller than the request. Replayed at the message's limit (reserved + free, or the
``allowed`` cap) with the run's settings, that history must end in the message's out-of-memory;
it is used only when it does (:func:`message_history` returns None otherwise). Each candidate
allocator setting is then replayed on the same history: "fits" means the setting removes this
kind of fragmentation at these figures. It is a check on the worst consistent case, not on the
run's real history (only a snapshot with its trace gives that), and the fix says so.

The history, segment by segment (``K`` segments of ``S_i`` bytes, whole 2 MiB pages and at least
10 MiB, so each is one cudaMalloc of exactly that size; a hole ``h_i`` and a live part
``l_i = S_i - h_i``, both above 1 MiB so that splits happen; holes strictly growing, so no part
lands in an earlier hole):

1. allocate ``S_i`` and free it: no cached block is that large, so this makes segment ``i``;
2. allocate ``h_i`` (it splits segment ``i``: every earlier hole is smaller), then ``l_i`` (the
   cut-off part of exactly its size), then free ``h_i``: the segment keeps ``l_i`` live and
   ``h_i`` cached;
3. after the last segment, request the message's size: no cached block is large enough, and a
   new segment passes the limit.

At no point is more live than the live parts plus one segment, so the history asks no more of
the allocator than the run did at its out-of-memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memplan.alloc.allocator import round_size
from memplan.alloc.constants import K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_SIZE
from memplan.alloc.settings import AllocatorSettings
from memplan.doctor.message import OOMMessage
from memplan.events import ALLOC, FREE, AllocEvent, Trace

__all__ = ["MessageHistory", "message_history"]

#: More segments than this and the history is not built (the replay would be slow for no insight).
MAX_SEGMENTS = 20_000


@dataclass(frozen=True)
class MessageHistory:
    """A history consistent with a message, and the limit it was replayed at."""

    trace: Trace
    segments: int
    reserved_bytes: int
    allocated_bytes: int
    #: Largest cached hole (every one is smaller than the request).
    largest_hole_bytes: int
    limit_bytes: int


def _spread(total: int, parts: int, unit: int) -> list[int]:
    """``total`` (a multiple of ``unit``) cut into ``parts`` multiples of ``unit`` differing by one unit at most."""
    units, extra = divmod(total // unit, parts)
    return [(units + (i < extra)) * unit for i in range(parts)]


def _layout(reserved: int, allocated: int, request: int) -> tuple[list[int], list[int]] | None:
    """Segment and hole sizes, fewest segments first, meeting every rule of the module docstring."""
    pages = reserved // K_ROUND_LARGE
    unit = K_MIN_BLOCK_SIZE
    most = min(pages * K_ROUND_LARGE // K_MIN_LARGE_ALLOC, MAX_SEGMENTS)
    fewest = max(1, -(-(reserved - allocated) // max(request - K_ROUND_LARGE, unit)))
    for count in range(fewest, most + 1):
        spare = (reserved - allocated) // unit - count * (count - 1) // 2
        if spare <= 0:
            break
        base, extra = divmod(spare, count)
        holes = [(base + i + (i >= count - extra)) * unit for i in range(count)]
        sizes = _spread(pages * K_ROUND_LARGE, count, K_ROUND_LARGE)
        lives = [s - h for s, h in zip(sizes, holes, strict=True)]
        if holes[-1] >= request or holes[0] <= K_SMALL_SIZE or min(lives) <= K_SMALL_SIZE:
            continue
        if min(sizes) < K_MIN_LARGE_ALLOC or set(lives) & set(holes):
            continue
        return sizes, holes
    return None


def _trace(sizes: list[int], holes: list[int], request: int) -> Trace:
    events: list[AllocEvent] = []

    def add(kind: str, block: int, size: int, category: str) -> None:
        events.append(AllocEvent(len(events), kind, block, size, category, "forward", 0, "reconstructed"))

    for i, (size, hole) in enumerate(zip(sizes, holes, strict=True)):
        add(ALLOC, 3 * i, size, "temporary")
        add(FREE, 3 * i, size, "temporary")
        add(ALLOC, 3 * i + 1, hole, "temporary")
        add(ALLOC, 3 * i + 2, size - hole, "activation")
        add(FREE, 3 * i + 1, hole, "temporary")
    add(ALLOC, 3 * len(sizes), request, "temporary")
    return Trace(events=tuple(events))


def message_history(msg: OOMMessage, settings: AllocatorSettings) -> MessageHistory | None:
    """The most fragmented history consistent with ``msg``, if one reproduces its out-of-memory."""
    from memplan.doctor.replay import replay_trace

    request = msg.requested.bytes
    if request <= K_SMALL_SIZE:
        return None  # small-pool requests: 2 MiB segments, holes below 1 MiB; not rebuilt
    reserved = msg.reserved.bytes // K_ROUND_LARGE * K_ROUND_LARGE
    allocated = min(msg.allocated.bytes // K_MIN_BLOCK_SIZE * K_MIN_BLOCK_SIZE, reserved)
    rounded = round_size(request, settings)
    layout = _layout(reserved, allocated, rounded)
    if layout is None:
        return None
    sizes, holes = layout
    trace = _trace(sizes, holes, request)
    limit = msg.pytorch_limit_bytes
    result = replay_trace(trace, replace(settings, capacity=limit))
    if result.oom is None or result.oom.event_index != len(trace.events) - 1:
        return None
    if result.reserved_bytes != reserved or result.allocated_bytes != allocated:
        return None
    return MessageHistory(trace=trace, segments=len(sizes), reserved_bytes=reserved, allocated_bytes=allocated,
                          largest_hole_bytes=max(holes), limit_bytes=limit)
