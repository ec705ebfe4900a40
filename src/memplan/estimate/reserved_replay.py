"""The running replay of a reserved-memory schedule (:mod:`memplan.estimate.reserved_sim`): the events
of the schedule, the requested bytes it holds, its peaks, and the allocation patterns the schedule
repeats (FSDP2's all-gather and gradients, :mod:`memplan.estimate.reserved_fsdp`).

The schedule is recorded, not replayed as it is built: each allocation and free is one int in a list
(:mod:`memplan.alloc.schedule`), a block is the position of its allocation there, and the requested
bytes (what :attr:`CachingAllocator.requested <memplan.alloc.allocator.CachingAllocator>` counts: the sum
of the sizes asked for by the live allocations) are tracked as the schedule goes, so a ledger moment's
top-up is known without the allocator. :meth:`Replay.finish` replays the list once through the
caching-allocator model (its C core when built). A stretch of the schedule that repeats, a decoder
layer's forward or backward at the same sizes, is recorded once and copied (:meth:`Replay.repeat`); a
stretch whose key says everything its events depend on is recorded once for every replay (and every job)
that asks for it (:func:`shared_templates`, a bounded cache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from memplan.alloc.schedule import STREAM_BITS, repeat_copies, replay_schedule
from memplan.alloc.settings import AllocatorSettings
from memplan.estimate.ledger import Ledger
from memplan.estimate.reserved_fsdp import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, FsdpSizes

#: A block of the schedule: the position of its allocation in :attr:`Replay.ops`.
Block = int
#: Lists of blocks, as a stretch of the schedule returns them (:meth:`Replay.repeat`).
Lists = list[list[Block | None]]


def encoded(sizes: Sequence[int], stream: int = 0) -> tuple[tuple[int, ...], int]:
    """The allocations of ``sizes`` (those > 0) on ``stream`` as schedule ops, and their bytes
    (for :meth:`Replay.take_encoded`)."""
    positive = [size for size in sizes if size > 0]
    return tuple(size << STREAM_BITS | stream for size in positive), sum(positive)


@dataclass(frozen=True)
class _Template:
    """A recorded stretch of the schedule (:meth:`Replay.repeat`)."""

    start: int
    ops: list[int]
    #: (index in ``ops``, index in the stretch's outside blocks) of each free of a block made before it, flat.
    outside: list[int]
    requested: int
    #: The stretch's peak of requested bytes above the requested bytes at its start.
    peak: int
    result: list[list[Block | None]]


class Templates(dict[tuple[int, ...], "_Template | None"]):
    """The recorded stretches of one :meth:`Replay.repeat` key, by the sizes of the blocks made before them
    that they free (None: that stretch cannot be copied)."""

    __slots__ = ()

    def __hash__(self) -> int:  # a key of Replay.repeat: compared by identity
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


@lru_cache(maxsize=4096)
def shared_templates(key: object) -> Templates:
    """The stretches recorded for ``key`` by every replay so far (a bounded cache: the least recently used
    keys are dropped). ``key`` must hold everything the stretch's events depend on, as values (never an
    object's id), so that any two stretches of equal keys make the same events (a test builds schedules
    with and without the cache and compares their events)."""
    return Templates()


class Replay:
    """The schedule's events and requested bytes (a running replay, local to one call).

    ``repeat=False`` records every stretch as it is built (the reference the copies are tested against)."""

    def __init__(self, *, repeat: bool = True) -> None:
        #: The schedule (:mod:`memplan.alloc.schedule`): ``size << 8 | stream`` per allocation,
        #: ``~position`` per free.
        self.ops: list[int] = []
        self.requested = 0
        self.peak_requested = 0
        #: (position in :attr:`ops`, phase) of each ledger moment asked for (the schedule's log).
        self.moments: list[tuple[int, str]] = []
        #: Per key of :meth:`repeat` its recorded stretches (a :class:`Templates` key is its own).
        self._templates: dict[object, Templates] | None = {} if repeat else None
        #: Per ledger (by id) its peak phase and the bytes it has alive there.
        self._peaks: dict[int, tuple[str | None, int]] = {}

    @property
    def events(self) -> int:
        return len(self.ops)

    def take(self, size: int, stream: int = 0) -> Block | None:
        if size <= 0:
            return None
        ops = self.ops
        ops.append(size << STREAM_BITS | stream)
        self.requested += size
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        return len(ops) - 1

    def give(self, *blocks: Block | None) -> None:
        ops = self.ops
        for block in blocks:
            if block is not None:
                self.requested -= ops[block] >> STREAM_BITS
                ops.append(~block)

    def take_encoded(self, allocations: Sequence[int], total: int) -> None:
        """Allocations already encoded (:func:`encoded`; ``total``: their bytes), never freed."""
        self.ops += allocations
        self.requested += total
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def take_all(self, sizes: Sequence[int], stream: int = 0) -> list[Block | None]:
        """``take`` of each size in turn (all allocations: the peak of requested bytes is at the end)."""
        ops = self.ops
        start = len(ops)
        if min(sizes, default=1) > 0:
            ops += [size << STREAM_BITS | stream for size in sizes]
            blocks: list[Block | None] = list(range(start, len(ops)))
            self.requested += sum(sizes)
        else:
            blocks = [self.take(size, stream) for size in sizes]
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        return blocks

    def all_gather(self, fsdp: FsdpSizes | None, unit: int) -> Block | None:
        """FSDP2's unshard of ``unit`` (``foreach_all_gather``, :mod:`memplan.estimate.reserved_fsdp`): the all-gather
        input and output made on the all-gather stream, the input freed once copied in; the output returned, alive
        until a later copy-out frees it (:meth:`copy_out`)."""
        if fsdp is None:
            return None
        staged = self.take(fsdp.gather_input[unit], ALL_GATHER_STREAM)
        output = self.take(sum(fsdp.unsharded[unit]), ALL_GATHER_STREAM)
        self.give(staged)
        return output

    def copy_out(self, fsdp: FsdpSizes | None, unit: int, *outputs: Block | None) -> list[Block | None]:
        """FSDP2's copy-out of ``unit`` (``wait_for_unshard``): its unsharded parameters made on the default
        stream, then the all-gather ``outputs`` freed (:mod:`memplan.estimate.reserved_fsdp`: in the forward the
        unit before's, in the backward the unit's own)."""
        if fsdp is None:
            return []
        params = self.take_all(fsdp.unsharded[unit])
        self.give(*outputs)
        return params

    def root_gradients(self, fsdp: FsdpSizes, head: Block | None, params: Sequence[Block | None],
                       trained: Sequence[int] = ()) -> list[Block | None]:
        """The root unit's gradients at the end of an FSDP2 backward (:mod:`memplan.estimate.reserved_fsdp`):
        the embedding's beside the head's (``head``), their sum when tied, then the unit's post-backward
        (:meth:`post_backward`); under torchtitan's outer units the embedding's unit alone, its gradients
        made after its copy-out; under fine-tuning the gradients of its trainable tensors alone (``trained``:
        their sharded sizes), all made there."""
        if fsdp.grad_scale is not None:
            return self.post_backward(fsdp, 0, self.take_all(_unsharded(fsdp.grad_scale, trained)), params,
                                      trained)
        made = [head, self.take(fsdp.head)] if not fsdp.outer else self.take_all(fsdp.unsharded[0])
        if fsdp.tied:
            made.append(self.take(fsdp.head))
        return self.post_backward(fsdp, 0, made, params)

    def head_forward(self, fsdp: FsdpSizes, held: Sequence[Block | None]) -> list[Block | None]:
        """The forward of torchtitan's head unit (:mod:`memplan.estimate.reserved_fsdp`): its all-gather, its
        copy-out freeing the last block's output (``held``), its own output freed as the root's forward ends,
        before the loss (computed outside the model). Returns its unsharded parameters (kept to its
        post-backward)."""
        output = self.all_gather(fsdp, len(fsdp.unsharded) - 1)
        params = self.copy_out(fsdp, len(fsdp.unsharded) - 1, *held)
        self.give(output)
        return params

    def head_backward(self, fsdp: FsdpSizes, grads: Sequence[Block | None],
                      params: Sequence[Block | None]) -> list[Block | None]:
        """The post-backward of torchtitan's head unit: :meth:`post_backward` when its gradients (``grads``)
        are made in the backward, else its reshard alone. Returns the reduce-scatter's input (None: none) and
        output."""
        if not grads:
            self.give(*params)
            return [None]
        return self.post_backward(fsdp, len(fsdp.unsharded) - 1, grads, params)

    def post_backward(self, fsdp: FsdpSizes, unit: int, grads: Sequence[Block | None],
                      params: Sequence[Block | None], sharded: Sequence[int] | None = None
                      ) -> list[Block | None]:
        """An outer unit's post-backward in torch's order (``FSDPParamGroup.post_backward``,
        ``foreach_reduce``): its unsharded parameters (``params``) freed (its reshard); the reduce-scatter's
        input in the reduce dtype; the gradients (``grads``) freed once copied in, then its output on the
        reduce-scatter stream. Returns the input (the caller frees it) and the output (the sharded
        gradients)."""
        self.give(*params)
        sharded = fsdp.sharded_grads[unit] if sharded is None else sharded
        if not grads:  # no parameter of the unit has a gradient: its reshard alone
            return [None]
        num, den = fsdp.reduce_scale  # the input in the reduce dtype, as the output (foreach_reduce)
        staged = self.take(sum(sharded) * fsdp.shards * num // den)
        self.give(*grads)
        return [staged, *self.reduced(fsdp, sharded)]

    def reduced(self, fsdp: FsdpSizes, sharded: Sequence[int]) -> list[Block | None]:
        """The reduce-scatter's output on its stream: in the reduce dtype, cast to the gradients' dtype
        (torch ``foreach_reduce``'s ``_to_dtype_if_needed``) where they differ, the cast's source then freed."""
        num, den = fsdp.reduce_scale
        low = self.take(sum(sharded) * num // den, REDUCE_SCATTER_STREAM) if num != den else None
        out = self.take_all(sharded, REDUCE_SCATTER_STREAM)
        self.give(low)
        return out

    def gradients(self, fsdp: FsdpSizes | None, grads: list[int], unit: int) -> list[Block | None]:
        """The gradients of ``unit`` made in its backward: under FSDP2 the unsharded ones until the
        reduce-scatter, whose output (the sharded gradients) lives on the reduce-scatter stream."""
        if fsdp is None:
            return self.take_all(grads)
        if fsdp.grad_scale is not None:  # fine-tuning: the trainable tensors' alone (``grads``: sharded)
            unsharded = self.take_all(_unsharded(fsdp.grad_scale, grads))
            sharded = self.take_all(grads, REDUCE_SCATTER_STREAM)
            self.give(*unsharded)
            return sharded
        unsharded = self.take_all(fsdp.unsharded[unit])
        sharded = self.reduced(fsdp, fsdp.sharded_grads[unit])
        self.give(*unsharded)
        return sharded

    def moment(self, ledger: Ledger, phase: str, check: bool = True) -> None:
        """At the ledger's peak moment, top the schedule up to the ledger's bytes alive there for an instant.

        Only there: the ledger's other moments are bounds (its backward moment may count every gradient
        beside the last layer's activations), and a top-up is one block the allocator must find in one
        piece, so bounding moments would reserve segments no real step asks for."""
        self.moments.append((len(self.ops), phase))
        if not check:
            return
        if id(ledger) not in self._peaks:  # the ledger is complete and outlives the replay: its peak is fixed
            top = max(ledger.phases, key=ledger.allocated_at) if ledger.phases else None
            self._peaks[id(ledger)] = (top, 0 if top is None else ledger.allocated_at(top))
        top, allocated = self._peaks[id(ledger)]
        if phase == top:
            self.give(self.take(allocated - self.requested))

    def finish(self, settings: AllocatorSettings | None = None, *, engine: str = "auto") -> int:
        """The schedule's peak reserved bytes: its events replayed once through the caching-allocator model
        (:func:`memplan.alloc.schedule.replay_schedule`, default settings unless given)."""
        return replay_schedule(self.ops, settings or AllocatorSettings(), engine=engine).peak_reserved_bytes

    def log(self) -> list[tuple[str, object]]:
        """The schedule as ("take", size), ("give", size) and ("moment", phase) entries, in order."""
        marks: dict[int, list[str]] = {}
        for at, phase in self.moments:
            marks.setdefault(at, []).append(phase)
        out: list[tuple[str, object]] = []
        for position, op in enumerate([*self.ops, None]):
            out += [("moment", phase) for phase in marks.get(position, ())]
            if op is not None:
                out.append(("take", op >> STREAM_BITS) if op >= 0 else ("give", self.ops[~op] >> STREAM_BITS))
        return out

    def repeat(self, key: object, body: Callable[[], list[list[Block | None]]],
               outside: Sequence[Block | None] = ()) -> list[list[Block | None]]:
        """Run ``body`` (a stretch of the schedule returning lists of the blocks it made that outlive it), or,
        when a stretch of the same ``key`` was recorded in this replay with outside blocks of the same sizes,
        append a copy of its events instead. ``body`` must depend only on ``key`` and may free, of the blocks
        made before it, only those in ``outside``; a stretch that frees others, returns blocks it did not make
        or asks for a ledger moment is not copied (recorded each time)."""
        if self._templates is None:
            return body()
        ops = self.ops
        store = self._store(key)
        sizes = tuple([-1 if b is None else ops[b] for b in outside])
        known = store.get(sizes, False)
        if known is False:
            store[sizes], result = self._record(body, outside)
            return result
        if known is None:
            return body()
        delta = len(ops) - known.start
        copied = [op if op >= 0 else op - delta for op in known.ops]
        for at, index in zip(known.outside[::2], known.outside[1::2]):
            copied[at] = ~outside[index]  # type: ignore[operator]
        ops += copied
        if self.requested + known.peak > self.peak_requested:
            self.peak_requested = self.requested + known.peak
        self.requested += known.requested
        return [[None if b is None else b + delta for b in blocks] for blocks in known.result]

    def repeat_run(self, key: object, layer: Callable[[int, list[Block | None]], Lists], run: Sequence[int],
                   outside: Callable[[int], Sequence[Block | None]], passed: list[Block | None] | None = None
                   ) -> tuple[Lists, list[Block | None]]:
        """:meth:`repeat` of ``layer(p, ...)`` for each ``p`` of ``run`` in turn (stretches of one ``key``, each
        freeing only ``outside(p)``), the copies after the first made together where they can be; the results
        concatenated.

        With ``passed`` (FSDP2's all-gather outputs), each layer also receives what the layer before passes on (the
        argument for the first): the last list ``layer`` returns, which the layer may free; then the layers' other
        lists are returned, and what the last passes on (else ``layer`` gets ``[]`` and ``[]`` is returned)."""
        if passed is None:
            first = run[0]
            made = self.repeat(key, lambda: layer(first, []), outside(first))
            copies = self._copy_run(key, run[1:], outside, None) if len(run) > 1 else ([], None)
            if copies is None:  # not copyable, or the layers' outside blocks differ in size: made one by one
                for p in run[1:]:
                    made += self.repeat(key, lambda p=p: layer(p, []), outside(p))
                return made, []
            return made + copies[0], []
        made = []
        for i, p in enumerate(run):
            chained = self._copy_run(key, run[i:], outside, passed) if i else None
            if chained is not None:
                return made + chained[0], chained[1] or []
            one = self.repeat(key, lambda p=p, passed=passed: layer(p, passed), [*outside(p), *passed])
            made += one[:-1]
            passed = one[-1]
        return made, passed

    def _copy_run(self, key: object, run: Sequence[int], outside: Callable[[int], Sequence[Block | None]],
                  passed: list[Block | None] | None) -> tuple[Lists, list[Block | None] | None] | None:
        """The stretches of ``run`` copied at once (:meth:`repeat_run`), or None (nothing made) where this replay
        has not recorded a copyable stretch of ``key`` with these outside blocks (and ``passed``), or the stretch
        passes on blocks of other sizes than it frees. With ``passed`` each copy but the first frees what the copy
        before passes on: the copies are made with the first's blocks there and those frees set after."""
        if self._templates is None:
            return None
        ops = self.ops
        first = [*outside(run[0]), *(passed or ())]
        sizes = tuple([-1 if b is None else ops[b] for b in first])
        known = self._store(key).get(sizes)
        if known is None:
            return None
        width = len(first) - len(passed or ())
        if passed is not None and len(run) > 1 and tuple(
                [-1 if b is None else known.ops[b - known.start] for b in known.result[-1]]) != sizes[width:]:
            return None
        sides = [first, *[[*outside(p), *(passed or ())] for p in run[1:]]]
        span, base, start = len(known.ops), len(ops) - known.start, len(ops)
        copies = repeat_copies(ops, known.ops, known.outside, sides, sizes, known.result, base)
        if copies is None:  # the layers' outside blocks differ in size
            return None
        chained = [] if passed is None else [(at, known.result[-1][index - width]) for at, index in
                                             zip(known.outside[::2], known.outside[1::2]) if index >= width]
        for c in range(1, len(run) if chained else 1):
            for at, block in chained:
                ops[start + c * span + at] = ~(block + base + (c - 1) * span)  # type: ignore[operator]
        self.peak_requested = max(self.peak_requested,
                                  self.requested + known.peak + max(0, (len(run) - 1) * known.requested))
        self.requested += len(run) * known.requested
        if passed is None:
            return copies, None
        n = len(known.result)
        return [blocks for c in range(len(run)) for blocks in copies[c * n:(c + 1) * n - 1]], copies[-1]

    def _store(self, key: object) -> Templates:
        """The recorded stretches of ``key`` (its own when it is a :class:`Templates`)."""
        if isinstance(key, Templates):
            return key
        assert self._templates is not None
        store = self._templates.get(key)
        if store is None:
            store = self._templates[key] = Templates()
        return store

    def _record(self, body: Callable[[], list[list[Block | None]]], outside: Sequence[Block | None]
                ) -> tuple[_Template | None, list[list[Block | None]]]:
        """Run ``body``; its stretch as a template (None: it cannot be copied) and its result."""
        start, before, peak, moments = len(self.ops), self.requested, self.peak_requested, len(self.moments)
        self.peak_requested = before
        result = body()
        template = _Template(start, self.ops[start:], [], self.requested - before, self.peak_requested - before,
                             [list(blocks) for blocks in result])
        self.peak_requested = max(peak, self.peak_requested)
        where = {b: index for index, b in enumerate(outside) if b is not None}
        # the frees of blocks made before the stretch
        frees = [(at, ~op) for at, op in enumerate(template.ops) if -start <= op < 0]
        template.outside.extend([value for at, block in frees for value in (at, where.get(block, -1))])
        kept_outside = [b for blocks in result for b in blocks if b is not None and b < start]
        copyable = not kept_outside and all(index >= 0 for index in template.outside[1::2])
        return (template if copyable and len(self.moments) == moments else None), result


def _unsharded(scale: tuple[int, int], sharded: Sequence[int]) -> list[int]:
    """The unsharded gradients in the compute dtype of trainable tensors of ``sharded`` gradients
    (:attr:`FsdpSizes.grad_scale <memplan.estimate.reserved_fsdp.FsdpSizes>`)."""
    return [size * scale[0] // scale[1] for size in sharded]
