"""Reserved memory from the caching-allocator simulator (issue 25, item 8; ``reserved="simulated"``).

The estimate's own contributions are laid out as an allocation schedule of one training step on one
GPU, repeated so that the allocator's cache reaches its steady state, and replayed through
:mod:`memplan.alloc`'s model of PyTorch's caching allocator; the stage's reserved memory is the
simulated peak reserved. The schedule, in execution order:

- the whole-step state (parameters, master weights, optimizer moments, workspaces) allocated first,
  one block per decoder layer plus one for the embedding/head (the FSDP root unit) per category;
- forward: the stage's other activations, then per decoder layer autocast's weight copies
  (:mod:`~memplan.estimate.reserved_autocast`) and the tensors it saves (the layer's saved terms, split
  into the tensors each counts by :mod:`~memplan.estimate.reserved_terms`, when they add up to what the
  estimate keeps for it, else one block), then the loss's logits (:mod:`~memplan.estimate.reserved_loss`);
- backward: the head's weight gradient right after the loss, then in reverse layer order the layer's
  backward transient allocated, its gradients allocated (when gradients are made in the backward), the
  transient and the layer's saved tensors freed; the embedding's gradient (and a tied sum) last
  (:mod:`~memplan.estimate.reserved_root`);
- the optimizer step's temporaries, one ``exp_avg_sq``-sized tensor per trainable tensor
  (:mod:`~memplan.estimate.reserved_optimizer`), freed; gradients freed before the next step where they
  are not alive through the whole step.

Gradients, moments and step temporaries are laid out over the trainable tensors
(:mod:`~memplan.estimate.reserved_trainable`: under PEFT the adapters and ``modules_to_save`` copies).

At each of the ledger's candidate moments the schedule holds what it placed; what else the ledger
has alive at that moment (communication buffers, inputs, temporaries the schedule does not place)
is allocated as one block there and freed after, so the schedule's allocated peak is the estimate's
peak allocated. Limits: gradients and states are split per layer, not per parameter tensor, so the
small pool and per-tensor holes are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.alloc.blocks import Block
from memplan.estimate.activations import divided, layer_terms
from memplan.estimate.context import StageContext
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.reserved_autocast import layer_weight_copies
from memplan.estimate.reserved_fsdp import FsdpSizes, fsdp_sizes
from memplan.estimate.reserved_loss import schedule_loss
from memplan.estimate.reserved_replay import Replay
from memplan.estimate.reserved_root import finish_root, root_gradients
from memplan.estimate.reserved_optimizer import foreach_temporaries
from memplan.estimate.reserved_terms import term_tensors
from memplan.estimate.reserved_trainable import trainable_units
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
from memplan.model.linears import model_parameters

#: Training steps replayed (the first allocates what later steps find cached).
_STEPS = 2
_STATIC = (PARAMETERS, MASTER, OPTIMIZER, WORKSPACE)


@dataclass(frozen=True)
class ScheduleReserved:
    """The simulated peak reserved bytes of a stage's schedule, its peak requested bytes, and its explanation."""

    reserved: int
    #: The schedule's peak of requested bytes (the estimate's peak allocated when the schedule is right).
    requested: int
    events: int
    note: str


def _units(ctx: StageContext, layers: list[int]) -> list[list[int]]:
    """The stage's parameter tensors' numels grouped as the schedule allocates them: the root unit
    (embedding, final norm, head) first, then one unit per decoder layer in forward order."""
    tensors = model_parameters(ctx.run.model)
    by_layer: dict[int | None, list[int]] = {}
    for t in tensors:
        by_layer.setdefault(t.layer, []).append(t.numel)
    root = by_layer.get(None, []) if ctx.layout.has_embedding or ctx.layout.has_head else []
    return [root] + [by_layer.get(i, [1]) for i in layers]


def _spread(total: int, units: list[list[int]]) -> list[list[int]]:
    """``total`` bytes spread over the tensors of ``units`` in proportion to their numel (the last tensor
    takes the rounding), zero-sized pieces dropped."""
    numel = sum(map(sum, units)) or 1
    out: list[list[int]] = []
    given = 0
    for unit in units:
        sizes = [total * n // numel for n in unit]
        given += sum(sizes)
        out.append(sizes)
    for unit in reversed(out):
        if unit:
            unit[-1] += total - given
            break
    return [[s for s in unit if s > 0] for unit in out]


def _layer_blocks(ctx: StageContext, index: int, kept: int) -> list[tuple[int, bool]]:
    """The tensors layer ``index``'s forward makes, in order, as (size, kept): its terms when the kept ones
    add up to ``kept`` (those a recompute policy drops are made and freed in the forward), else one block."""
    run = ctx.run
    layer = run.model.layers[index]
    terms = [(piece, t.keep in run.kept_classes and t.site not in run.dropped)
             for t in layer_terms(layer, run.shape) for piece in term_tensors(t.name, divided(t, run.shape), layer, run)]
    terms = [(size, keep) for size, keep in terms if size > 0]
    if sum(size for size, keep in terms if keep) != kept:
        return [(kept, True)]
    return terms if ctx.run.counts is None else [(size, True) for size, keep in terms if keep]


def _forward_layer(replay: Replay, tensors: list[tuple[int, bool]], copies: list[int]) -> list[Block | None]:
    """A layer's forward: its tensors in order, a dropped one freed once the next is made; autocast's weight
    copies made between them, spread evenly (each linear casts its weight when it runs)."""
    held, pending = [], None
    done = 0
    for position, (size, keep) in enumerate(tensors):
        due = -(-(position + 1) * len(copies) // len(tensors))
        held.extend(replay.take_all(copies[done:due]))
        done = max(done, due)
        block = replay.take(size)
        replay.give(pending)
        pending = None
        if keep:
            held.append(block)
        else:
            pending = block
    replay.give(pending)
    held.extend(replay.take_all(copies[done:]))
    return held


def simulated_reserved(ctx: StageContext, ledger: Ledger, walk: LayerWalk, acts: StageActivations,
                       loss: LossPart) -> ScheduleReserved:
    """Replay the stage's schedule (see the module) and return its simulated peaks."""
    layers = [index for index, _, _ in walk.per_layer]
    units = _units(ctx, layers)
    replay = Replay()
    for category in (PARAMETERS, MASTER, WORKSPACE):
        for unit in _spread(ledger.total(category), units):
            replay.take_all(unit)
    trained = trainable_units(ctx, layers)
    copies = layer_weight_copies(ctx, layers)
    if sum(map(sum, copies)) + acts.head_copy > acts.other:
        copies = [[] for _ in copies]
    moments = _pieces(ledger, trained or units, copies)
    grads = [] if moments.made_in_backward else [replay.take_all(u) for u in moments.grads]
    for category in (() if moments.states_in_step else (OPTIMIZER,)):
        for unit in _spread(ledger.total(category), units):
            replay.take_all(unit)
    fsdp = fsdp_sizes(ctx, ledger, units, _spread)
    for step in range(_STEPS):
        grads = _step(ctx, walk, acts, loss, replay, grads, moments, (ledger, fsdp), first=step == 0)
    return ScheduleReserved(replay.peak_reserved, replay.peak_requested, replay.events,
                            _note(ctx, replay.events, trained is not None, any(copies), moments.made_in_backward))


def _note(ctx: StageContext, events: int, finetune: bool, copies: bool, grads_in_backward: bool) -> str:
    """The --explain sentence: the schedule, and the mechanics that shaped this job's."""
    parts = [f"reserved = the caching-allocator simulator's peak over an allocation schedule of the estimate's "
             f"contributions ({_STEPS} steps, {events} allocator events: parameters per tensor, saved activations "
             "per tensor inside their layer, gradients and optimizer states per trainable tensor, the optimizer "
             "step's temporaries one per trainable tensor as a foreach step makes them)"]
    if finetune:
        parts.append("gradients and states only for the trainable tensors (adapters, modules_to_save copies, "
                     "trained modules), each in its own dtype")
    if copies:
        parts.append("torch.autocast's 16-bit weight copies made in each kept layer's forward and freed in its "
                     "backward, the head's at the head")
    if ctx.layout.has_head and grads_in_backward:
        parts.append("the head's weight gradient made right after the loss"
                     + (", summed with the tied embedding's at the end of the backward"
                        if ctx.run.model.tie_word_embeddings else ""))
    return "; ".join(parts)


@dataclass(frozen=True)
class _Pieces:
    """Per unit (root, then layers) the sizes of the gradients, optimizer moments and step temporaries,
    and per layer autocast's weight copies."""

    grads: list[list[int]]
    moments: list[list[int]]
    step_temp: list[list[int]]
    made_in_backward: bool
    states_in_step: bool
    #: Per layer of the stage, autocast's weight copies its forward makes (:mod:`~memplan.estimate.reserved_autocast`).
    copies: list[list[int]]


def _pieces(ledger: Ledger, units: list[list[int]], copies: list[list[int]]) -> _Pieces:
    made = ledger.total(ABSENT, "backward") > 0
    moments = _spread(ledger.total(OPTIMIZER), units)
    # the moments are created in the first step's optimizer step, exp_avg and exp_avg_sq per tensor
    halves = [[part for size in unit for part in (size // 2, size - size // 2)] for unit in moments]
    step = ledger.total(TEMPORARY, "optimizer step")
    temps = foreach_temporaries(step, [unit[1::2] for unit in halves]) or _spread(step, units)
    return _Pieces(grads=_spread(ledger.total(GRADIENTS, "end of backward"), units), moments=halves,
                   step_temp=temps, made_in_backward=made, states_in_step=made, copies=copies)


def _step(ctx: StageContext, walk: LayerWalk, acts: StageActivations, loss: LossPart, replay: Replay,
          grads: list[list[Block | None]], pieces: _Pieces, plan: tuple[Ledger, FsdpSizes | None], *, first: bool
          ) -> list[list[Block | None]]:
    """One training step of the schedule; the first creates the optimizer moments (no ledger moment is
    checked then: the ledger describes the steady state). Returns the gradients alive after the step."""
    ledger, fsdp = plan
    check = not first
    copies = pieces.copies
    # the output head's autocast weight copy is made at the head, after the layers, and freed in its backward
    other = replay.take(acts.other - acts.head_copy - sum(map(sum, copies)))
    root = replay.gather(fsdp, 0)
    saved = []
    for position, (index, kept, _) in enumerate(walk.per_layer):
        params = replay.gather(fsdp, position + 1)
        saved.append(_forward_layer(replay, _layer_blocks(ctx, index, kept), copies[position]))
        replay.give(*params)
    head_copy = replay.take(acts.head_copy)
    replay.moment(ledger, "forward", check)
    schedule_loss(ctx, ledger, loss, replay, check)
    replay.give(head_copy)
    root_grads = root_gradients(pieces.grads[0], ctx.layout.has_head, ctx.run.model.tie_word_embeddings)
    head = None
    if pieces.made_in_backward:
        head = replay.take(fsdp.head if fsdp is not None else root_grads.head)
    last = len(walk.per_layer) - 1
    for position in reversed(range(len(walk.per_layer))):
        params = replay.gather(fsdp, position + 1)
        temp = replay.take(walk.per_layer[position][2])
        if position == last:
            replay.moment(ledger, "backward", check)
        if pieces.made_in_backward:
            grads.append(replay.gradients(fsdp, pieces.grads[position + 1], position + 1))
        replay.give(temp, *saved[position], *params)
    summed: list[Block | None] = []
    if pieces.made_in_backward and fsdp is None:
        alive, summed = finish_root(replay, root_grads, head)
        grads.append(alive)
    elif pieces.made_in_backward:
        grads.append(replay.root_gradients(fsdp, head))
    replay.give(other, *root)
    replay.moment(ledger, "end of backward", check)
    replay.give(*summed)
    if first and pieces.states_in_step:
        for unit in pieces.moments:
            replay.take_all(unit)
    step = [replay.take_all(unit) for unit in pieces.step_temp]
    replay.moment(ledger, "optimizer step", check)
    replay.give(*(b for unit in step for b in unit))
    if pieces.made_in_backward:
        replay.give(*(b for unit in grads for b in unit))
        return []
    return grads
