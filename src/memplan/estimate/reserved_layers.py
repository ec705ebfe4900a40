"""The decoder layers' forward and backward passes of a reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`), each layer's events made by :mod:`~memplan.estimate.reserved_forward`
and :mod:`~memplan.estimate.reserved_backward`, FSDP2's all-gather around them.

A layer whose stretch is made from the same values as an earlier one's (its tensors, weight copies,
transient, gradient and FSDP2 sizes: its :class:`LayerKeys` entry) makes the same events, so its stretch of
the schedule is copied rather than built again (:meth:`~memplan.estimate.reserved_replay.Replay.repeat`),
also when another stage or job recorded it (:func:`~memplan.estimate.reserved_replay.shared_templates`),
and a run of such layers is copied at once (:meth:`~memplan.estimate.reserved_replay.Replay.repeat_run`, the
copies made by :func:`memplan.alloc.schedule.repeat_copies`, in the C core when built). The copies are
exactly the events the layers would make (tests compare with the schedule built layer by layer, also after
other jobs recorded the stretches). Copying a whole pass in the second step as well was measured slower (its
recording cost more than the copy saved once runs are copied at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memplan.estimate.context import StageContext
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.ledger import Ledger
from memplan.estimate.reserved_backward import backward_layer, eager_backward
from memplan.estimate.reserved_forward import forward_layer, layer_blocks
from memplan.estimate.reserved_fsdp import FsdpSizes
from memplan.estimate.reserved_replay import Block, Replay, Templates, shared_templates

Saved = list[list[Block | None]]


@dataclass(frozen=True)
class LayerKeys:
    """Per layer of the stage, the recorded stretches of its forward and of its backward
    (:func:`~memplan.estimate.reserved_replay.shared_templates`: layers, stages and jobs whose stretches make
    the same events share them), and the tensors its forward makes
    (:func:`~memplan.estimate.reserved_forward.layer_blocks`)."""

    forward: tuple[Templates, ...]
    backward: tuple[Templates, ...]
    tensors: tuple[list[tuple[int, int, bool]], ...]


def layer_keys(ctx: StageContext, walk: LayerWalk, casts: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]],
               grads: Sequence[Sequence[int]] | None, fsdp: FsdpSizes | None) -> LayerKeys:
    """The keys of the stage's layers (``casts``: per layer autocast's saved and cached weight copies;
    ``grads``: per unit the gradients its backward makes, None when they are not made in the backward).

    A key holds, as values, what the stretch's events are made from: a forward's FSDP2 sizes, its tensors
    (:func:`~memplan.estimate.reserved_forward.layer_blocks`) and weight copies (:func:`forward_pass`); a
    backward's also its transient, the eager softmax backward's plan
    (:func:`~memplan.estimate.reserved_backward.eager_backward`, what
    :func:`~memplan.estimate.reserved_backward.backward_layer` reads of the run) and the gradients it makes
    (:func:`backward_pass`). Within the stage, layers are first told apart by what those are computed from
    (the layer's kind, kept bytes, recompute, copies), so each is computed once per kind."""
    copies, cached = casts
    forward: list[Templates] = []
    backward: list[Templates] = []
    tensors: list[list[tuple[int, int, bool]]] = []
    local: dict[object, tuple[Templates, list[tuple[int, int, bool]]]] = {}
    local_backward: dict[object, Templates] = {}
    for position, (index, kept, transient) in enumerate(walk.per_layer):
        unit = position + 1
        layer = ctx.run.model.layers[index]  # the model outlives the schedule: its id tells kinds apart here
        sizes = None if fsdp is None else (fsdp.gather_input[unit], tuple(fsdp.unsharded[unit]),
                                           tuple(fsdp.sharded_grads[unit]))
        made_by = (tuple(copies[position]), tuple(cached[position]), sizes)
        # layer_blocks reads whether the layer is checkpointed (a layer-checkpointing policy's others save all)
        seen = (id(layer), kept, index in ctx.recomputed, made_by)
        if seen not in local:
            blocks = layer_blocks(ctx, index, kept)
            local[seen] = (shared_templates(("forward", tuple(blocks), made_by)), blocks)
        forward_key, blocks = local[seen]
        forward.append(forward_key)
        tensors.append(blocks)
        made = None if grads is None else tuple(grads[unit])
        seen_backward = (forward_key, id(layer), transient, made)
        if seen_backward not in local_backward:
            plan = eager_backward(layer, ctx.run, transient)
            local_backward[seen_backward] = shared_templates(("backward", tuple(blocks), made_by, transient, plan,
                                                              made))
        backward.append(local_backward[seen_backward])
    return LayerKeys(tuple(forward), tuple(backward), tuple(tensors))


def _runs(keys: Sequence[object], order: Sequence[int]) -> list[list[int]]:
    """The positions ``order`` split into runs of consecutive layers with equal keys."""
    runs: list[list[int]] = []
    for position in order:
        if runs and keys[runs[-1][-1]] == keys[position]:
            runs[-1].append(position)
        else:
            runs.append([position])
    return runs


def forward_pass(ctx: StageContext, walk: LayerWalk, replay: Replay,
                 casts: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]], fsdp: FsdpSizes | None,
                 keys: LayerKeys) -> list[Saved]:
    """Each layer's forward (its FSDP2 all-gather around it; ``casts``: per layer autocast's saved and cached
    weight copies). Returns per layer its blocks (those the backward frees early, the others it frees, the
    cached copies freed after the loss's forward)."""
    copies, cached = casts

    def layer(position: int) -> Saved:
        params = replay.gather(fsdp, position + 1)
        held = forward_layer(replay, keys.tensors[position], list(copies[position]), list(cached[position]))
        replay.give(*params)
        return list(held)

    flat = [blocks for run in _runs(keys.forward, range(len(keys.forward)))
            for blocks in replay.repeat_run(keys.forward[run[0]], layer, run, lambda _: ())]
    per = len(flat) // max(len(keys.forward), 1)  # the lists forward_layer returns
    return [flat[per * position:per * (position + 1)] for position in range(len(keys.forward))]


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

    def outside(position: int) -> list[Block | None]:
        return [*saved[position][0], *saved[position][1]]

    made = layer(last) if last >= 0 else []
    return made + [blocks for run in _runs(keys.backward, range(last - 1, -1, -1))
                   for blocks in replay.repeat_run(keys.backward[run[0]], layer, run, outside)]
