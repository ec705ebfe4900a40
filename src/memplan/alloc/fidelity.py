"""Replay a real snapshot's device trace through the simulator and measure how often it agrees.

For every recorded ``alloc`` the simulator predicts, from its own state, where the block goes
(an address inside an existing segment, or a new segment). The prediction matches when it is the
recorded address: same segment, same offset. The replay is *teacher-forced*: after a mismatch
the recorded placement is imposed, so one early difference does not condemn every later
decision. The recorded ``segment_alloc``/``segment_free`` sequence is compared with the
simulated one, and the final block layout of every segment with the snapshot's ``segments``.

Most snapshots do not start from an empty allocator: the state before the first entry is
rebuilt from the dump-time segments and the trace (segments created in the trace are removed,
blocks freed in the trace without an ``alloc`` are live at the start). The size of such a block
is its rounded request, extended over a following gap too small to be a free block (< 512 B in
the small pool, <= 1 MiB in the large pool) — the allocator would not have split it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from memplan.alloc.allocator import CachingAllocator, allocation_size, round_size
from memplan.alloc.blocks import Block, BlockPool, Segment
from memplan.alloc.constants import K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, K_SMALL_SIZE
from memplan.alloc.settings import AllocatorSettings
from memplan.alloc.snapshot import Snapshot

__all__ = ["FidelityReport", "replay_snapshot"]

_SEGMENT_ACTIONS = ("segment_alloc", "segment_free")


@dataclass(frozen=True)
class FidelityReport:
    """How well the simulator reproduced one snapshot."""

    source: str
    allocs: int
    alloc_matches: int
    recorded_segment_events: tuple[tuple[str, int, int], ...]
    simulated_segment_events: tuple[tuple[str, int, int], ...]
    segments_compared: int
    segments_matching: int
    unplaceable: int
    starts_empty: bool
    forced_segments: int = 0

    @property
    def alloc_match_rate(self) -> float:
        return self.alloc_matches / self.allocs if self.allocs else 1.0

    @property
    def segment_sequence_match(self) -> bool:
        return self.recorded_segment_events == self.simulated_segment_events

    @property
    def layout_match_rate(self) -> float:
        return self.segments_matching / self.segments_compared if self.segments_compared else 1.0


class _Replay:
    def __init__(self, snapshot: Snapshot, settings: AllocatorSettings) -> None:
        self.snapshot = snapshot
        self.settings = settings
        self.pending_segments: list[tuple[int, int]] = []
        self.alloc = CachingAllocator(settings, address_source=self._address)
        self.live: dict[int, Block | None] = {}
        self.forced_segments = 0
        self.teacher_forcing = True

    def _address(self, size: int, stream: int) -> int | None:
        for i, (address, seg_size) in enumerate(self.pending_segments):
            if seg_size == size:
                del self.pending_segments[i]
                return address
        return None

    # -- initial state ---------------------------------------------------------------------

    def build_initial_state(self) -> bool:
        entries = self.snapshot.entries
        segments = {s.address: (s.total_size, s.stream, s.segment_type == "small") for s in self.snapshot.segments}
        for entry in reversed(entries):
            if entry.action == "segment_alloc":
                segments.pop(entry.addr, None)
            elif entry.action == "segment_free":
                segments[entry.addr] = (entry.size, entry.stream, entry.size == K_SMALL_BUFFER)
        live: dict[int, tuple[int, int, bool]] = {}  # addr -> (size, requested, exact)
        allocated_in_trace: set[int] = set()
        for entry in entries:
            if entry.action == "alloc":
                allocated_in_trace.add(entry.addr)
            elif entry.action in ("free_completed", "free") and entry.addr not in allocated_in_trace:
                live.setdefault(entry.addr, (round_size(entry.size, self.settings), entry.size, False))
            if entry.action in ("free_completed", "free"):
                allocated_in_trace.discard(entry.addr)
        ever_allocated = {e.addr for e in entries if e.action == "alloc"}
        for segment in self.snapshot.segments:
            for b in segment.blocks:
                if b.active and b.address not in ever_allocated:
                    live[b.address] = (b.size, b.requested_size, True)
        for address, (size, stream, small) in sorted(segments.items()):
            self._install_segment(address, size, stream, small, live)
        return not segments

    def _install_segment(self, address: int, size: int, stream: int, small: bool,
                         live: dict[int, tuple[int, int, bool]]) -> None:
        segment = Segment(address, size, stream, small, expandable=False)
        self.alloc.segments[address] = segment
        self.alloc.reserved += size
        end = address + size
        inside = sorted(a for a in live if address <= a < end)
        pieces: list[Block] = []
        cursor = address
        for i, start in enumerate(inside):
            block_size, requested, exact = live[start]
            if start > cursor:
                pieces.append(Block(cursor, start - cursor, stream, small, segment))
            limit = inside[i + 1] if i + 1 < len(inside) else end
            gap = limit - (start + block_size)
            if not exact and 0 < gap and (gap < K_MIN_BLOCK_SIZE if small else gap <= K_SMALL_SIZE):
                block_size += gap
            block = Block(start, min(block_size, end - start), stream, small, segment)
            block.allocated, block.requested = True, requested
            pieces.append(block)
            self.live[start] = block
            self.alloc.allocated += block.size
            cursor = start + block.size
        if cursor < end:
            pieces.append(Block(cursor, end - cursor, stream, small, segment))
        pool = self.alloc.small_pool if small else self.alloc.large_pool
        for before, after in pairwise(pieces):
            before.next, after.prev = after, before
        for piece in pieces:
            if not piece.allocated:
                pool.insert(piece)

    # -- replay ----------------------------------------------------------------------------

    def predict(self, size: int, stream: int) -> int | None:
        """Address the allocator would return, without changing its state (None: unknown)."""
        rounded = round_size(size, self.settings)
        pool = self.alloc.small_pool if rounded <= K_SMALL_SIZE else self.alloc.large_pool
        block = _peek(self.alloc, pool, stream, rounded)
        if block is not None:
            return block.address
        alloc_size = allocation_size(rounded)
        for address, seg_size in self.pending_segments:
            if seg_size == alloc_size:
                return address
        return None

    def force(self, address: int, size: int, stream: int) -> Block | None:
        """Impose the recorded placement: carve [address, address + rounded) out of a free block."""
        rounded = round_size(size, self.settings)
        small = rounded <= K_SMALL_SIZE
        pool = self.alloc.small_pool if small else self.alloc.large_pool
        for i, (seg_address, seg_size) in enumerate(self.pending_segments):
            if seg_address <= address < seg_address + seg_size:
                del self.pending_segments[i]
                self._install_segment(seg_address, seg_size, stream, small, {})
                self.alloc._record("segment_alloc", seg_address, seg_size, stream)
                self.forced_segments += 1
                break
        host = next((b for b in pool.blocks.values()
                     if b.address <= address and address + rounded <= b.address + b.size), None)
        if host is None:
            return None
        pool.remove(host)
        if host.address < address:
            front = Block(host.address, address - host.address, host.stream, host.small, host.segment)
            front.prev, front.next = host.prev, host
            if host.prev is not None:
                host.prev.next = front
            host.prev = front
            host.size -= address - host.address
            host.address = address
            pool.insert(front)
        if self.alloc._should_split(host, rounded):
            host = self.alloc._split(host, rounded, pool)
        host.allocated, host.requested = True, size
        self.alloc.allocated += host.size
        return host

    def run(self) -> tuple[int, int, int, list[tuple[str, int, int]]]:
        allocs = matches = unplaceable = 0
        recorded: list[tuple[str, int, int]] = []
        completed = any(e.action == "free_completed" for e in self.snapshot.entries)
        free_actions = ("free_completed", "free") if completed else ("free_requested", "free")
        for entry in self.snapshot.entries:
            if entry.action == "segment_alloc":
                recorded.append((entry.action, entry.addr, entry.size))
                self.pending_segments.append((entry.addr, entry.size))
            elif entry.action == "segment_free":
                recorded.append((entry.action, entry.addr, entry.size))
                self._external_free(entry.addr)
            elif entry.action == "alloc":
                allocs += 1
                if self.predict(entry.size, entry.stream) == entry.addr:
                    matches += 1
                    self.live[entry.addr] = self.alloc.malloc(entry.size, entry.stream)
                elif not self.teacher_forcing:
                    self.live[entry.addr] = self.alloc.malloc(entry.size, entry.stream)
                else:
                    block = self.force(entry.addr, entry.size, entry.stream)
                    unplaceable += block is None
                    self.live[entry.addr] = block
            elif entry.action in free_actions:
                block = self.live.pop(entry.addr, None)
                if block is not None:
                    self.alloc.free(block)
        return allocs, matches, unplaceable, recorded

    def _external_free(self, address: int) -> None:
        """A recorded segment_free the simulator did not do itself (an ``empty_cache()`` call)."""
        if address not in self.alloc.segments or any(
                e.action == "segment_free" and e.address == address for e in self.alloc.segment_events[-4:]):
            return
        for pool in (self.alloc.small_pool, self.alloc.large_pool):
            block = next((b for b in pool.blocks.values() if b.address == address and not b.is_split), None)
            if block is not None:
                self.alloc._release_block(block, pool)
                return


def _peek(alloc: CachingAllocator, pool: BlockPool, stream: int, size: int) -> Block | None:
    """``get_free_block`` without taking the block out of the pool."""
    block = alloc._get_free_block(pool, stream, size)
    if block is not None:
        pool.insert(block)
        block.gc_base = pool.free_calls  # unchanged ordering; GC ages are not used in replays
    return block


def replay_snapshot(snapshot: Snapshot, settings: AllocatorSettings | None = None, *,
                    teacher_forcing: bool = True) -> FidelityReport:
    """Replay ``snapshot``'s trace; settings default to the snapshot's own ``allocator_settings``.

    With ``teacher_forcing=False`` the simulator keeps its own placements after a mismatch (a
    free-running replay; blocks are then freed wherever the simulator put them).
    """
    settings = settings or snapshot.settings or AllocatorSettings()
    replay = _Replay(snapshot, settings)
    replay.teacher_forcing = teacher_forcing
    starts_empty = replay.build_initial_state()
    allocs, matches, unplaceable, recorded = replay.run()
    simulated = [(e.action, e.address, e.size) for e in replay.alloc.segment_events if e.action in _SEGMENT_ACTIONS]
    compared, matching = _compare_layout(replay, snapshot)
    return FidelityReport(
        source=snapshot.source, allocs=allocs, alloc_matches=matches,
        recorded_segment_events=tuple(recorded), simulated_segment_events=tuple(simulated),
        segments_compared=compared, segments_matching=matching, unplaceable=unplaceable,
        starts_empty=starts_empty, forced_segments=replay.forced_segments,
    )


def _compare_layout(replay: _Replay, snapshot: Snapshot) -> tuple[int, int]:
    from memplan.alloc.simulator import segment_map

    simulated = {s.address: s for s in segment_map(replay.alloc, [b for b in replay.live.values() if b])}
    compared = matching = 0
    for segment in snapshot.segments:
        compared += 1
        sim = simulated.get(segment.address)
        if sim is None:
            continue
        want = [(b.address - segment.address, b.size, b.state == "active_allocated") for b in segment.blocks]
        have = [(b.offset, b.size, b.allocated) for b in sim.blocks]
        matching += want == have
    return compared, matching
