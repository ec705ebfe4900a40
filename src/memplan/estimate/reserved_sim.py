"""Reserved memory from the caching-allocator simulator (issue 25, item 8; ``reserved="simulated"``).

The estimate's own contributions are laid out as an allocation schedule of one training step on one
GPU, repeated so that the allocator's cache reaches its steady state, and replayed through
:mod:`memplan.alloc`'s model of PyTorch's caching allocator; the stage's reserved memory is the
simulated peak reserved. The schedule, in execution order:

- the whole-step state (parameters, master weights, optimizer moments, workspaces) allocated first,
  one block per decoder layer plus one for the embedding/head (the FSDP root unit) per category;
- forward: the stage's other activations, then per decoder layer the tensors it saves (the layer's
  saved terms when they add up to what the estimate keeps for it, else one block), then the loss's
  logits;
- backward in reverse layer order: the layer's backward transient allocated, its gradients allocated
  (when gradients are made in the backward), the transient and the layer's saved tensors freed;
- the optimizer step's temporaries, allocated per layer and freed; gradients freed before the next
  step where they are not alive through the whole step.

At each of the ledger's candidate moments the schedule holds what it placed; what else the ledger
has alive at that moment (communication buffers, inputs, temporaries the schedule does not place)
is allocated as one block there and freed after, so the schedule's allocated peak is the estimate's
peak allocated. Limits: gradients and states are split per layer, not per parameter tensor, so the
small pool and per-tensor holes are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.alloc.allocator import CachingAllocator
from memplan.alloc.blocks import Block
from memplan.alloc.settings import AllocatorSettings
from memplan.estimate.activations import divided, layer_terms
from memplan.estimate.context import StageContext
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.ledger import (
    ABSENT,
    GRADIENTS,
    MASTER,
    OPTIMIZER,
    PARAMETERS,
    TEMPORARY,
    WORKSPACE,
    Ledger,
)
from memplan.estimate.stage_activations import StageActivations
from memplan.estimate.stage_peak import LossPart

#: Training steps replayed (the first allocates what later steps find cached).
_STEPS = 2
_STATIC = (PARAMETERS, MASTER, OPTIMIZER, WORKSPACE)


@dataclass(frozen=True)
class SimulatedReserved:
    """The simulated peak reserved bytes of a stage's schedule, its peak requested bytes, and its explanation."""

    reserved: int
    #: The schedule's peak of requested bytes (the estimate's peak allocated when the schedule is right).
    requested: int
    events: int
    note: str


class _Replay:
    """The allocator and the blocks the schedule holds (a running replay, local to one call)."""

    def __init__(self) -> None:
        self.alloc = CachingAllocator(AllocatorSettings())
        self.events = 0
        self.peak_reserved = 0
        self.peak_requested = 0

    def take(self, size: int) -> Block | None:
        if size <= 0:
            return None
        block = self.alloc.malloc(size, 0)
        self.events += 1
        self.peak_reserved = max(self.peak_reserved, self.alloc.reserved)
        self.peak_requested = max(self.peak_requested, self.alloc.requested)
        return block

    def give(self, *blocks: Block | None) -> None:
        for block in blocks:
            if block is not None:
                self.alloc.free(block)
                self.events += 1

    def moment(self, ledger: Ledger, phase: str) -> None:
        """Top the schedule up to the ledger's bytes alive at ``phase`` for an instant."""
        if phase in ledger.phases:
            self.give(self.take(ledger.allocated_at(phase) - self.alloc.requested))


def _split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal pieces (no zero pieces)."""
    parts = max(1, parts)
    base, extra = divmod(total, parts)
    return [s for s in (base + (1 if i < extra else 0) for i in range(parts)) if s > 0]


def _layer_blocks(ctx: StageContext, index: int, kept: int) -> list[int]:
    """The sizes of the tensors layer ``index`` keeps: its saved terms when they add up to ``kept``."""
    run = ctx.run
    terms = [t for t in layer_terms(run.model.layers[index], run.shape)
             if t.keep in run.kept_classes and t.site not in run.dropped]
    sizes = [b for b in (divided(t, run.shape) for t in terms) if b > 0]
    return sizes if sum(sizes) == kept else [kept]


def simulated_reserved(ctx: StageContext, ledger: Ledger, walk: LayerWalk, acts: StageActivations,
                       loss: LossPart) -> SimulatedReserved:
    """Replay the stage's schedule (see the module) and return its simulated peaks."""
    pieces = len(walk.per_layer) + 1
    replay = _Replay()
    for category in _STATIC:
        for size in _split(ledger.total(category), pieces):
            replay.take(size)
    grad_sizes = _split(ledger.total(GRADIENTS, "end of backward"), pieces)
    made_in_backward = ledger.total(ABSENT, "backward") > 0
    grads = [] if made_in_backward else [replay.take(s) for s in grad_sizes]
    for _ in range(_STEPS):
        grads = _step(ctx, ledger, walk, acts, loss, replay, grads, grad_sizes if made_in_backward else [])
    note = (f"reserved = the caching-allocator simulator's peak over an allocation schedule of the estimate's "
            f"contributions ({_STEPS} steps, {replay.events} allocator events; states and gradients per layer, "
            "saved activations per tensor)")
    return SimulatedReserved(replay.peak_reserved, replay.peak_requested, replay.events, note)


def _step(ctx: StageContext, ledger: Ledger, walk: LayerWalk, acts: StageActivations, loss: LossPart,
          replay: _Replay, grads: list[Block | None], grad_sizes: list[int]) -> list[Block | None]:
    """One training step of the schedule; ``grad_sizes``: the gradients the backward makes (in reverse
    layer order, the root unit last). Returns the gradients alive after the step."""
    other = replay.take(acts.other)
    saved = [[replay.take(s) for s in _layer_blocks(ctx, i, kept)] for i, kept, _ in walk.per_layer]
    replay.moment(ledger, "forward")
    logits = replay.take(loss.logits)
    replay.moment(ledger, "loss")
    replay.give(logits)
    made = list(reversed(grad_sizes[1:])) + grad_sizes[:1]
    for position in reversed(range(len(walk.per_layer))):
        temp = replay.take(walk.per_layer[position][2])
        if position == len(walk.per_layer) - 1:
            replay.moment(ledger, "backward")
        if made:
            grads.append(replay.take(made.pop(0)))
        replay.give(temp, *saved[position])
    grads.extend(replay.take(s) for s in made)
    replay.give(other)
    replay.moment(ledger, "end of backward")
    step = [replay.take(s) for s in _split(ledger.total(TEMPORARY, "optimizer step"), len(walk.per_layer) + 1)]
    replay.moment(ledger, "optimizer step")
    replay.give(*step)
    if grad_sizes:
        replay.give(*grads)
        return []
    return grads
