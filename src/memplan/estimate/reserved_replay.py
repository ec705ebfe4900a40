"""The running replay of a reserved-memory schedule (:mod:`memplan.estimate.reserved_sim`): the caching
allocator model, the blocks the schedule holds, its peaks, and the allocation patterns the schedule
repeats (FSDP2's all-gather and gradients, :mod:`memplan.estimate.reserved_fsdp`)."""

from __future__ import annotations

from memplan.alloc.allocator import CachingAllocator
from memplan.alloc.blocks import Block
from memplan.alloc.settings import AllocatorSettings
from memplan.estimate.ledger import Ledger
from memplan.estimate.reserved_fsdp import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, FsdpSizes


class Replay:
    """The allocator and the blocks the schedule holds (a running replay, local to one call)."""

    def __init__(self) -> None:
        self.alloc = CachingAllocator(AllocatorSettings())
        self.events = 0
        self.peak_reserved = 0
        self.peak_requested = 0

    def take(self, size: int, stream: int = 0) -> Block | None:
        if size <= 0:
            return None
        block = self.alloc.malloc(size, stream)
        self.events += 1
        self.peak_reserved = max(self.peak_reserved, self.alloc.reserved)
        self.peak_requested = max(self.peak_requested, self.alloc.requested)
        return block

    def give(self, *blocks: Block | None) -> None:
        for block in blocks:
            if block is not None:
                self.alloc.free(block)
                self.events += 1

    def take_all(self, sizes: list[int], stream: int = 0) -> list[Block | None]:
        return [self.take(size, stream) for size in sizes]

    def gather(self, fsdp: FsdpSizes | None, unit: int) -> list[Block | None]:
        """FSDP2's all-gather of ``unit`` (:mod:`memplan.estimate.reserved_fsdp`): its unsharded parameters."""
        if fsdp is None:
            return []
        staged = [self.take(fsdp.gather_input[unit], ALL_GATHER_STREAM),
                  self.take(sum(fsdp.unsharded[unit]), ALL_GATHER_STREAM)]
        params = self.take_all(fsdp.unsharded[unit])
        self.give(*reversed(staged))
        return params

    def root_gradients(self, fsdp: FsdpSizes, head: Block | None) -> list[Block | None]:
        """The root unit's gradients at the end of an FSDP2 backward (:mod:`memplan.estimate.reserved_fsdp`):
        the embedding's beside the head's (``head``), their sum when tied, the reduce-scatter's input
        in the reduce dtype, then its output on the reduce-scatter stream; the rest freed."""
        made = [head, self.take(fsdp.head)]
        if fsdp.tied:
            made.append(self.take(fsdp.head))
        made.append(self.take(sum(fsdp.sharded_grads[0]) * fsdp.shards))
        sharded = self.take_all(fsdp.sharded_grads[0], REDUCE_SCATTER_STREAM)
        self.give(*made)
        return sharded

    def gradients(self, fsdp: FsdpSizes | None, grads: list[int], unit: int) -> list[Block | None]:
        """The gradients of ``unit`` made in its backward: under FSDP2 the unsharded ones until the
        reduce-scatter, whose output (the sharded gradients) lives on the reduce-scatter stream."""
        if fsdp is None:
            return self.take_all(grads)
        unsharded = self.take_all(fsdp.unsharded[unit])
        sharded = self.take_all(fsdp.sharded_grads[unit], REDUCE_SCATTER_STREAM)
        self.give(*unsharded)
        return sharded

    def moment(self, ledger: Ledger, phase: str, check: bool = True) -> None:
        """At the ledger's peak moment, top the schedule up to the ledger's bytes alive there for an instant.

        Only there: the ledger's other moments are bounds (its backward moment may count every gradient
        beside the last layer's activations), and a top-up is one block the allocator must find in one
        piece, so bounding moments would reserve segments no real step asks for."""
        if check and phase in ledger.phases and phase == max(ledger.phases, key=ledger.allocated_at):
            self.give(self.take(ledger.allocated_at(phase) - self.alloc.requested))
