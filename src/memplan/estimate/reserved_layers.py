"""The decoder layers' forward and backward passes of a reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`), each layer's events made by :mod:`~memplan.estimate.reserved_forward`
and :mod:`~memplan.estimate.reserved_backward`, FSDP2's all-gather around them.

A layer whose stretch is made from the same values as an earlier one's (its tensors, weight copies,
transient, gradient and FSDP2 sizes: its :class:`LayerKeys` entry) makes the same events, so its stretch of
the schedule is copied rather than built again (:meth:`~memplan.estimate.reserved_replay.Replay.repeat`),
a forward also when another stage or job recorded it (:func:`~memplan.estimate.reserved_replay.shared_templates`),
and a run of such layers is copied at once (:meth:`~memplan.estimate.reserved_replay.Replay.repeat_run`, the
copies made by :func:`memplan.alloc.schedule.repeat_copies`, in the C core when built). The copies are
exactly the events the layers would make (tests compare with the schedule built layer by layer, also after
other jobs recorded the stretches). Copying a whole pass in the second step as well was measured slower (its
recording cost more than the copy saved once runs are copied at once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memplan.estimate.context import StageContext
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.ledger import Ledger
from memplan.estimate.reserved_attention_backward import masked_fp32
from memplan.estimate.reserved_backward import backward_layer, recomputed_softmax
from memplan.estimate.reserved_forward import forward_layer, layer_blocks, recomputed_blocks
from memplan.estimate.reserved_fsdp import FsdpSizes
from memplan.estimate.reserved_grouped_experts import grouped_backward
from memplan.estimate.reserved_mlp_backward import EXPERT_SLOT
from memplan.estimate.reserved_fused_recompute import mlp_first
from memplan.estimate.reserved_recompute import general_tensors, recompute_tensors
from memplan.estimate.reserved_replay import Block, Replay, Templates, shared_templates
from memplan.estimate.reserved_walked import walked_backward, walked_fused, walked_whole

Saved = list[list[Block | None]]


@dataclass(frozen=True)
class LayerKeys:
    """Per layer of the stage, the recorded stretches of its forward
    (:func:`~memplan.estimate.reserved_replay.shared_templates`: layers, stages and jobs whose stretches make
    the same events share them) and of its backward (this schedule's), and the tensors its forward makes
    (:func:`~memplan.estimate.reserved_forward.layer_blocks`)."""

    forward: tuple[Templates, ...]
    backward: tuple[Templates, ...]
    tensors: tuple[list[tuple[int, int, bool]], ...]


def layer_keys(ctx: StageContext, walk: LayerWalk, casts: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]],
               grads: Sequence[Sequence[int]] | None, fsdp: FsdpSizes | None) -> LayerKeys:
    """The keys of the stage's layers (``casts``: per layer autocast's saved and cached weight copies;
    ``grads``: per unit the gradients its backward makes, None when they are not made in the backward).

    A forward's key holds, as values, what its events are made from: its FSDP2 sizes, its tensors
    (:func:`~memplan.estimate.reserved_forward.layer_blocks`) and weight copies (:func:`forward_pass`), so
    its stretches are shared across stages and jobs. A backward reads the run as well (the op-by-op plans
    of :func:`~memplan.estimate.reserved_backward.backward_layer`, a recomputed layer's forward made again),
    so its key is local to the schedule: the forward's, the layer's kind, kept bytes, transient, recompute
    and the gradients it makes. Within the stage, layers are first told apart by what the values are
    computed from (the layer's kind, kept bytes, recompute, copies), so each is computed once per kind."""
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
            local[seen] = (shared_templates(("forward", tuple(blocks), made_by, masked_fp32(ctx.run))), blocks)
        forward_key, blocks = local[seen]
        forward.append(forward_key)
        tensors.append(blocks)
        made = None if grads is None else tuple(grads[unit])
        # the backward reads more of the run than these values (the op-by-op plans; a recomputed layer's forward
        # made again: reserved_recompute), so its stretches are shared within this schedule only, told apart by
        # the layer's kind and recompute as well
        # under FSDP2 a layer's backward prefetches the unit before's all-gather (none before the first layer)
        before = unit - 1
        ahead = None if fsdp is None or not (before or fsdp.outer) else (fsdp.gather_input[before],
                                                                         sum(fsdp.unsharded[before]))
        seen_backward = (forward_key, id(layer), kept, transient, index in ctx.recomputed, made, ahead)
        if seen_backward not in local_backward:
            local_backward[seen_backward] = Templates()
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
                 keys: LayerKeys, root: list[Block | None]) -> tuple[list[Saved], list[Block | None]]:
    """Each layer's forward (its FSDP2 all-gather around it; ``casts``: per layer autocast's saved and cached
    weight copies). Returns per layer its blocks (those the backward frees early, the others it frees, the
    cached copies freed after the loss's forward, the op-by-op slots' tensors: :func:`forward_layer`), and the
    last layer's all-gather output, alive until the root's forward ends (``root``: the root's, freed at the
    first layer's copy-out; :mod:`~memplan.estimate.reserved_fsdp`)."""
    copies, cached = casts
    fp32_mask = masked_fp32(ctx.run)

    def layer(position: int, before: list[Block | None]) -> Saved:
        output = replay.all_gather(fsdp, position + 1)
        params = replay.copy_out(fsdp, position + 1, *before)
        held = forward_layer(replay, keys.tensors[position], list(copies[position]), list(cached[position]), fp32_mask)
        replay.give(*params)
        return list(held) if fsdp is None else [*held, [] if output is None else [output]]

    flat: list[list[Block | None]] = []
    passed = None if fsdp is None else root
    for run in _runs(keys.forward, range(len(keys.forward))):
        made, after = replay.repeat_run(keys.forward[run[0]], layer, run, lambda _: (), passed)
        flat += made
        passed = None if fsdp is None else after
    per = len(flat) // max(len(keys.forward), 1)  # the lists forward_layer returns
    return [flat[per * position:per * (position + 1)] for position in range(len(keys.forward))], passed or []


def _gradient_maker(replay: Replay, fsdp: FsdpSizes | None, grads: Sequence[int] | None, unit: int,
                    made_grads: Saved) -> Callable[[Sequence[int] | None], None]:
    """The hook a layer's backward calls to make ``unit``'s gradients (``grads``: their sizes, None: none made
    in the backward) at positions ``part`` (None: those not made yet), appending them to ``made_grads``."""
    done: set[int] = set()

    def made(part: Sequence[int] | None) -> None:
        if grads is None:
            return
        if part is None and not done:  # all at once (every layer but the op-by-op ones)
            made_grads.append(replay.gradients(fsdp, list(grads), unit))
            return
        chosen = [i for i in range(len(grads)) if i not in done] if part is None else part
        done.update(chosen)
        made_grads.append(replay.gradients(fsdp, [grads[i] for i in chosen], unit))
    return made


def backward_pass(ctx: StageContext, walk: LayerWalk, replay: Replay, saved: list[Saved],
                  grads: Sequence[Sequence[int]] | None, plan: tuple[Ledger, FsdpSizes | None], check: bool,
                  keys: LayerKeys, held: tuple[list[Block | None], list[Block | None]], *, moment: int,
                  probe: dict[int, int] | None = None) -> Saved:
    """Each layer's backward in reverse order, the ledger's backward moment in the layer at position ``moment``
    (``probe``: positions whose requested bytes at their worst step are recorded into it); under FSDP2
    each layer's copy-out frees its all-gather output (``prefetched``: the last layer's) and prefetches the
    layer before's (:mod:`~memplan.estimate.reserved_fsdp`; the first layer the embedding's unit when it is
    apart, its output left in ``prefetched`` for the caller) and the last layer frees, after its backward, the
    head unit's reduce-scatter input (``held``: (prefetched, that input)). Returns the gradients made
    (``grads`` per unit, None: none made in the backward), per layer in that order."""
    ledger, fsdp = plan
    prefetched, staged = held
    last = len(walk.per_layer) - 1

    def layer(position: int, prefetch: list[Block | None]) -> Saved:
        made_grads: Saved = []
        unit = position + 1
        params = replay.copy_out(fsdp, unit, *prefetch)
        before = position > 0 or (fsdp is not None and fsdp.outer)
        ahead = replay.all_gather(fsdp, unit - 1) if before else None
        made = _gradient_maker(replay, fsdp, None if grads is None else grads[unit], unit, made_grads)
        peak = _peak_hook(replay, (ledger, check), position, (moment, probe))
        count = None if grads is None or fsdp is not None else len(grads[unit])
        again = recompute_tensors(ctx, walk.per_layer[position][0], count)
        layer_saved = (saved[position][0], saved[position][1], saved[position][3])
        if again is not None:  # a recomputed layer's forward made again (reserved_recompute)
            held = forward_layer(replay, again, [], [], masked_fp32(ctx.run))
            backward_layer(ctx.run, walk.per_layer[position], (held[0], held[1], held[3]), replay, (made, peak),
                           count)
            replay.give(*layer_saved[0], *layer_saved[1], *layer_saved[2])
        else:
            walked = walked_fused(ctx, walk.per_layer[position][0])  # a fused core's walk (reserved_walked)
            if walked is None or not walked_backward(ctx.run, (walk.per_layer[position][0], walked), layer_saved,
                                                     replay, (made, peak)):
                _general_backward(ctx, walk.per_layer[position], layer_saved, replay, (made, peak), count)
        replay.give(*params)
        return made_grads if fsdp is None else [*made_grads, [] if ahead is None else [ahead]]

    def outside(position: int) -> list[Block | None]:
        return [*saved[position][0], *saved[position][1], *saved[position][3]]

    passed = None if fsdp is None else prefetched
    made: Saved = [] if last < 0 else layer(last, passed or [])
    replay.give(*staged)
    if passed is not None and last >= 0:
        *made, passed = made
    alone = {p for p in (moment, *(probe or ())) if 0 <= p < last}
    passed = _earlier_layers(replay, keys, (layer, outside), (last, alone), made, passed)
    prefetched[:] = passed or []
    return made


def _general_backward(ctx: StageContext, visit: tuple[int, int, int],
                      saved: tuple[list[Block | None], list[Block | None], Sequence[Block | None]], replay: Replay,
                      hooks: tuple[Callable[[Sequence[int] | None], None], Callable[[], None]],
                      count: int | None) -> None:
    """A layer's backward by :func:`~memplan.estimate.reserved_backward.backward_layer`; a layer recomputed whole
    without an op-by-op plan first makes its forward again tensor by tensor
    (:func:`~memplan.estimate.reserved_recompute.general_tensors`), the rest of its transient beside them, all freed
    after its gradients are made."""
    index, kept, transient = visit
    walked = walked_whole(ctx, index)
    if walked is not None:  # the allocated peak's walk, after the forward made again (reserved_walked)
        tensors = recomputed_blocks(ctx, index, reads_input=not ctx.run.job.offload.activations)
        held = forward_layer(replay, tensors, [], [], masked_fp32(ctx.run))
        walked_backward(ctx.run, (index, walked), ([*saved[0], *held[0]], [*saved[1], *held[1], *held[2]], held[3]),
                        replay, hooks)
        replay.give(*saved[2])
        return
    if grouped_backward(ctx, index, saved, replay, hooks, count):  # grouped experts op by op (reserved_grouped_experts)
        return
    again = general_tensors(ctx, index, transient)
    if again is None:
        backward_layer(ctx.run, visit, saved, replay, hooks, count)
        return
    tensors, layers, rest = again
    early, late = [*saved[0]], [*saved[1]]
    walked = False
    for _ in range(layers):  # the checkpointed group's layers, one after the other
        held = forward_layer(replay, tensors, [], [], masked_fp32(ctx.run))
        # a fused core's layer alone: its MLP's backward op by op (reserved_recompute)
        walked = layers == 1 and mlp_first(ctx.run, (index, count, rest), held[3], replay, hooks)
        # the slots' tensors freed as backward_layer frees a layer's without the op-by-op plan
        early += [*held[0], *held[3][:6], *held[3][EXPERT_SLOT:]]
        late += [*held[1], *held[2], *held[3][6:EXPERT_SLOT]]
    if walked:
        replay.give(*early, *late, *saved[2])
        return
    backward_layer(ctx.run, (index, kept, rest), (early, late, saved[2]), replay, hooks, count,
                   recomputed_softmax(ctx.run, index) if layers == 1 else None)


def _peak_hook(replay: Replay, ledger: tuple[Ledger, bool], position: int,
               moment: tuple[int, dict[int, int] | None]) -> Callable[[], None]:
    """The hook layer ``position``'s backward calls at its worst step: the ledger's backward moment
    (:meth:`~memplan.estimate.reserved_replay.Replay.moment`, ``ledger``: the ledger and whether to check it) in the
    layer at ``moment[0]``, and the requested bytes recorded where ``moment[1]`` (a probe) asks for them."""
    at, probe = moment

    def peak() -> None:
        if position == at:
            replay.moment(ledger[0], "backward", ledger[1])
        if probe is not None and position in probe:
            probe[position] = replay.requested
    return peak


def _earlier_layers(replay: Replay, keys: LayerKeys,
                    build: tuple[Callable[[int, list[Block | None]], Saved], Callable[[int], list[Block | None]]],
                    at: tuple[int, set[int]], made: Saved, passed: list[Block | None] | None) -> list[Block | None] | None:
    """The backward of the layers before the last (``at``: the last's position and those built alone), in reverse
    order, their gradients appended to ``made``: the layers holding the ledger's moment or a probe built alone (their
    hook runs), runs of the others copied where they can (:meth:`~memplan.estimate.reserved_replay.Replay.repeat_run`;
    ``build``: one layer's backward and the blocks made before it that it frees). Returns what the first layer
    passes on (FSDP2's all-gather output; None without FSDP2)."""
    layer, outside = build
    last, alone = at
    stretches: list[list[int]] = []
    for position in range(last - 1, -1, -1):
        if position in alone or not stretches or stretches[-1][-1] in alone:
            stretches.append([position])
        else:
            stretches[-1].append(position)
    for positions in stretches:
        if positions[0] in alone:
            one = layer(positions[0], passed or [])
            if passed is not None:
                *one, passed = one
            made += one
            continue
        for run in _runs(keys.backward, positions):
            more, after = replay.repeat_run(keys.backward[run[0]], layer, run, outside, passed)
            made += more
            passed = None if passed is None else after
    return passed
