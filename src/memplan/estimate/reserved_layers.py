"""The decoder layers' forward and backward passes of a reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`), each layer's events made by :mod:`~memplan.estimate.reserved_forward`
and :mod:`~memplan.estimate.reserved_backward`, FSDP2's all-gather around them.

A layer at the same sizes as an earlier one (same layer kind, kept bytes, transient, weight copies,
gradient and FSDP2 sizes: its :class:`LayerKeys` entry) makes the same events, so its stretch of the
schedule is copied rather than built again (:meth:`~memplan.estimate.reserved_replay.Replay.repeat`); so
is a whole pass in the second training step (the backward's but its last layer, which holds the ledger's
backward moment). The copies are exactly the events the layers would make (a test compares with the
schedule built layer by layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memplan.estimate.context import StageContext
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.ledger import Ledger
from memplan.estimate.reserved_backward import backward_layer
from memplan.estimate.reserved_forward import forward_layer, layer_blocks
from memplan.estimate.reserved_fsdp import FsdpSizes
from memplan.estimate.reserved_replay import Block, Replay

Saved = list[list[Block | None]]


@dataclass(frozen=True)
class LayerKeys:
    """Per layer of the stage, what its forward's and its backward's events depend on."""

    forward: tuple[object, ...]
    backward: tuple[object, ...]


def layer_keys(ctx: StageContext, walk: LayerWalk, copies: Sequence[Sequence[int]],
               grads: Sequence[Sequence[int]] | None, fsdp: FsdpSizes | None) -> LayerKeys:
    """The keys of the stage's layers (``grads``: per unit the gradients its backward makes, None when
    gradients are not made in the backward)."""
    forward: list[object] = []
    backward: list[object] = []
    # each distinct key as a small int: a pass's key is then a tuple of ints, cheap to hash
    ids: dict[object, int] = {}
    last = len(walk.per_layer) - 1
    for position, (index, kept, transient) in enumerate(walk.per_layer):
        unit = position + 1
        kind = id(ctx.run.model.layers[index])  # one object per layer kind: the model outlives the schedule
        sizes = None if fsdp is None else (fsdp.gather_input[unit], tuple(fsdp.unsharded[unit]),
                                           tuple(fsdp.sharded_grads[unit]))
        forward.append(ids.setdefault(("forward", kind, kept, tuple(copies[position]), sizes), len(ids)))
        made = None if grads is None else tuple(grads[unit])
        backward.append(ids.setdefault(("backward", kind, kept, transient, position == last,
                                        tuple(copies[position]), made, sizes), len(ids)))
    return LayerKeys(tuple(forward), tuple(backward))


def forward_pass(ctx: StageContext, walk: LayerWalk, replay: Replay, copies: Sequence[Sequence[int]],
                 fsdp: FsdpSizes | None, keys: LayerKeys) -> list[Saved]:
    """Each layer's forward (its FSDP2 all-gather around it). Returns per layer its saved blocks (those the
    backward frees early, the others)."""

    def layer(position: int) -> Saved:
        index, kept, _ = walk.per_layer[position]
        params = replay.gather(fsdp, position + 1)
        held = forward_layer(replay, layer_blocks(ctx, index, kept), list(copies[position]))
        replay.give(*params)
        return list(held)

    def whole() -> Saved:
        return [blocks for position, key in enumerate(keys.forward)
                for blocks in replay.repeat(key, lambda p=position: layer(p))]  # type: ignore[misc]

    flat = replay.repeat(("forward pass", keys.forward), whole)
    return [flat[2 * position:2 * position + 2] for position in range(len(keys.forward))]


def backward_pass(ctx: StageContext, walk: LayerWalk, replay: Replay, saved: list[Saved],
                  grads: Sequence[Sequence[int]] | None, plan: tuple[Ledger, FsdpSizes | None], check: bool,
                  keys: LayerKeys) -> Saved:
    """Each layer's backward in reverse order, the ledger's backward moment in the last layer's. Returns the
    gradients made (``grads`` per unit, None: none made in the backward), per layer in that order."""
    ledger, fsdp = plan
    last = len(walk.per_layer) - 1

    def layer(position: int) -> Saved:
        made_grads: Saved = []
        unit = position + 1
        params = replay.gather(fsdp, unit)
        made = (lambda: made_grads.append(replay.gradients(fsdp, list(grads[unit]), unit))
                ) if grads is not None else (lambda: None)
        peak = (lambda: replay.moment(ledger, "backward", check)) if position == last else (lambda: None)
        backward_layer(ctx.run, walk.per_layer[position], (saved[position][0], saved[position][1]), replay,
                       (made, peak))
        replay.give(*params)
        return made_grads

    def one(position: int) -> Saved:
        return replay.repeat(keys.backward[position], lambda: layer(position),
                             [*saved[position][0], *saved[position][1]])

    def rest() -> Saved:
        return [blocks for position in reversed(range(last)) for blocks in one(position)]

    made = one(last) if last >= 0 else []
    outside = [b for position in reversed(range(last)) for part in saved[position] for b in part]
    return made + replay.repeat(("backward pass", keys.backward[:last]), rest, outside)
