"""Bookkeeping of storage allocations and frees: :class:`AllocationRecorder` (torch-light).

The recorder keeps one row per allocation and per free while a step runs, and resolves each
block's :class:`~memplan.categories.MemoryCategory` only at the end, when it is known what the
block turned out to be (a parameter's gradient, an optimizer moment, a tensor kept from the
forward for the backward ...). Storages are tracked by identity: a ``weakref.finalize`` on the
``torch.UntypedStorage`` object reports the free the moment the storage is released (PyTorch keeps
one Python object per storage while it lives).

Category rules, in order:

1. a role given explicitly: ``parameter``, ``buffer``, ``input`` (registered before the step),
   ``gradient`` (``p.grad`` after a backward), ``optimizer_state`` (``optimizer.state`` after a
   step), ``communication`` (collective outputs, FSDP's unsharded parameters);
2. allocated in a forward and still alive when that iteration's backward starts: ``activation``
   (what autograd saved for the backward), or ``logits`` when allocated by the output head (other
   than autocast's copies of its weight and input) or by the loss at the model's top level; this
   includes the outputs of functional collectives (:data:`COLLECTIVE`: DTensor's redistributions)
   kept for the backward, such as a sequence-parallel embedding's reduce-scatter output (the first
   layer's input; an activation although its hook runs at the top level) or the reduce-scatter
   outputs torchtitan's per-op checkpointing caches; those freed earlier are ``communication``;
3. everything else: ``temporary``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memplan.categories import MemoryCategory
from memplan.events import ALLOC, FREE, AllocEvent

__all__ = ["COLLECTIVE", "HOST", "AllocationRecorder"]

#: Role of blocks that live in host memory on a GPU run (Adam's ``step`` counters): dropped from
#: a ``cuda`` trace, kept as optimizer state in a ``cpu`` trace.
HOST = "host"
#: Role of the outputs of functional collectives: ``communication``, or what the forward keeps for
#: the backward (rule 2 of the module docstring) when still alive when the backward starts.
COLLECTIVE = "collective"

_PARAMETER = MemoryCategory.PARAMETER.value
_ACTIVATION = MemoryCategory.ACTIVATION.value
_LOGITS = MemoryCategory.LOGITS.value
_TEMPORARY = MemoryCategory.TEMPORARY.value
_OPT = MemoryCategory.OPTIMIZER_STATE.value
_CAST_OP = "aten._to_copy.default"
#: Roles given before the step that later marks never override.
_FIXED_ROLES = frozenset({_PARAMETER, MemoryCategory.BUFFER.value, MemoryCategory.INPUT.value})


@dataclass(slots=True)
class _Block:
    """One allocation while it is being recorded (mutable until the trace is finished)."""

    block: int
    size: int
    phase: str
    iteration: int
    module: str
    op: str = ""
    stream: int = 0
    role: str | None = None
    forward_alive: bool = False


@dataclass
class AllocationRecorder:
    """Records allocations/frees of storages with their phase, iteration, op and module.

    ``module_of`` returns the dotted path of the module running now ("" outside any module).
    ``head_modules`` are the module paths whose forward allocations alive at the backward are
    logits rather than activations (the output head and the top-level module computing the loss).
    ``stream_of`` returns the id of the stream current now (see :mod:`memplan.trace.core.streams`); a
    block keeps the stream it was allocated on, and its free carries that stream too.
    """

    module_of: Callable[[], str] = lambda: ""
    stream_of: Callable[[], int] = lambda: 0
    head_modules: frozenset[str] = frozenset()
    phase: str = "setup"
    iteration: int = -1
    op: str = ""
    _rows: list[tuple[str, _Block, str, str, str, int]] = field(default_factory=list)
    _live: dict[int, _Block] = field(default_factory=dict)
    _watched: set[int] = field(default_factory=set)
    _next: int = 0

    # -- recording ------------------------------------------------------------------------------

    def see(self, storage: Any, op: str) -> None:
        """Record ``storage`` as allocated by ``op`` unless it is already known."""
        if id(storage) in self._live:
            return
        self._alloc(storage, storage.nbytes(), op, self.module_of())

    def register(self, storage: Any, role: str, module: str = "") -> None:
        """Record an already existing storage (parameter, buffer, input) with its role."""
        block = self._live.get(id(storage))
        if block is None:
            block = self._alloc(storage, storage.nbytes(), "", module)
        block.role = role

    def mark(self, storage: Any, role: str) -> None:
        """Give a live storage a role (gradient, optimizer state, ...); unknown storages are added."""
        block = self._live.get(id(storage))
        if block is None:
            block = self._alloc(storage, storage.nbytes(), self.op, self.module_of())
        if block.role not in _FIXED_ROLES:
            block.role = role

    def resized(self, storage: Any, new_nbytes: int, role: str) -> None:
        """A storage was resized in place (FSDP frees/reallocates unsharded parameters this way)."""
        block = self._live.get(id(storage))
        if block is not None and block.size == new_nbytes:
            return
        if block is not None:
            self._free(id(storage), block)
        if new_nbytes > 0:
            block = self._alloc(storage, new_nbytes, "resize_", self.module_of())
            block.role = role

    def start_backward(self) -> None:
        """Mark every role-less block of this iteration's forward that is still alive."""
        for block in self._live.values():
            if block.role in (None, COLLECTIVE) and block.phase == "forward" and block.iteration == self.iteration:
                block.forward_alive = True

    def _alloc(self, storage: Any, size: int, op: str, module: str) -> _Block:
        block = _Block(self._next, size, self.phase, self.iteration, module, op, self.stream_of())
        self._next += 1
        key = id(storage)
        self._live[key] = block
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(storage, self._on_release, key)
        self._rows.append((ALLOC, block, op, module, self.phase, self.iteration))
        return block

    def _on_release(self, key: int) -> None:
        self._watched.discard(key)
        block = self._live.get(key)
        if block is not None:
            self._free(key, block)

    def _free(self, key: int, block: _Block) -> None:
        del self._live[key]
        self._rows.append((FREE, block, self.op, self.module_of(), self.phase, self.iteration))

    # -- results ------------------------------------------------------------------------------

    def category(self, block: _Block) -> str:
        """The final category of ``block`` (see the module docstring)."""
        if block.role == COLLECTIVE and not block.forward_alive:
            return MemoryCategory.COMMUNICATION.value
        if block.role is not None and block.role != COLLECTIVE:
            return _OPT if block.role == HOST else block.role
        if block.forward_alive:
            # (a collective at the top level redistributes a module's output in its hook, e.g. the
            # embedding's reduce-scatter: the first layer's input, not the loss's)
            if block.module not in self.head_modules or (block.role == COLLECTIVE and not block.module):
                return _ACTIVATION
            # Autocast's copies of the head's weight and input are activations, not logits.
            return _ACTIVATION if block.module and block.op == _CAST_OP else _LOGITS
        return _TEMPORARY

    def events(self, *, drop_host: bool) -> tuple[AllocEvent, ...]:
        """The recorded rows as :class:`AllocEvent` values, numbered in program order.

        A free row carries the phase and iteration at the time of the free; ``drop_host`` leaves
        out host-resident blocks (a CUDA run keeps them in CPU memory).
        """
        out: list[AllocEvent] = []
        index = 0
        for kind, block, op, module, phase, iteration in self._rows:
            if drop_host and block.role == HOST:
                continue
            out.append(AllocEvent(index, kind, block.block, block.size, self.category(block),
                                  phase, iteration, op, module, block.stream))
            index += 1
        return tuple(out)

    @property
    def live_blocks(self) -> int:
        return len(self._live)
