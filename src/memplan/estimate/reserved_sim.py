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
  estimate keeps for it, else one block; under autocast each pre-norm's fp32 output held to its block's
  end: :mod:`~memplan.estimate.reserved_forward`), then the loss's logits
  (:mod:`~memplan.estimate.reserved_loss`);
- backward: the head's weight gradient right after the loss, then in reverse layer order the layer's
  backward transient allocated, its gradients allocated (when gradients are made in the backward), the
  transient and the layer's saved tensors freed (an eager softmax backward instead as autograd runs it:
  :mod:`~memplan.estimate.reserved_backward`); the embedding's gradient (and a tied sum) last
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

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from memplan.estimate.context import StageContext
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.memo import Same
from memplan.estimate.reserved_autocast import layer_weight_copies
from memplan.estimate.reserved_backward import eager_backward
from memplan.estimate.reserved_layers import LayerKeys, backward_pass, forward_pass, layer_keys
from memplan.estimate.reserved_fsdp import FsdpSizes, fsdp_sizes
from memplan.estimate.reserved_loss import schedule_loss, softcapped
from memplan.estimate.reserved_replay import Block, Replay, encoded
from memplan.estimate.reserved_root import finish_root, root_gradients
from memplan.estimate.reserved_optimizer import foreach_temporaries
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
#: Per unit (the root, then each layer) its tensors' sizes.
Units = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ScheduleReserved:
    """The simulated peak reserved bytes of a stage's schedule, its peak requested bytes, and its explanation."""

    reserved: int
    #: The schedule's peak of requested bytes (the estimate's peak allocated when the schedule is right).
    requested: int
    events: int
    note: str


def _units(ctx: StageContext, layers: list[int]) -> Units:
    """The stage's parameter tensors' numels grouped as the schedule allocates them: the root unit
    (embedding, final norm, head) first, then one unit per decoder layer in forward order."""
    return _model_units(Same(ctx.run.model), tuple(layers), ctx.layout.has_embedding or ctx.layout.has_head)


@lru_cache(maxsize=256)
def _model_units(model: Same, layers: tuple[int, ...], root: bool) -> Units:
    by_layer: dict[int | None, list[int]] = {}
    for t in model_parameters(model.obj):  # type: ignore[arg-type]
        by_layer.setdefault(t.layer, []).append(t.numel)
    return (tuple(by_layer.get(None, [])) if root else (),) + tuple(tuple(by_layer.get(i, [1])) for i in layers)


def _spread(total: int, units: Sequence[Sequence[int]]) -> list[list[int]]:
    """``total`` bytes spread over the tensors of ``units`` in proportion to their numel (the last tensor
    takes the rounding), zero-sized pieces dropped."""
    if total == 0:
        return [[] for _ in units]
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


def simulated_reserved(ctx: StageContext, ledger: Ledger, walk: LayerWalk, acts: StageActivations,
                       loss: LossPart, *, engine: str = "auto") -> ScheduleReserved:
    """Replay the stage's schedule (see the module) and return its simulated peaks. ``engine="python"``:
    every layer's events built one by one and replayed by the pure-Python allocator model (the reference
    the default, which copies repeated layers and replays in the C core when built, is tested against)."""
    layers = [index for index, _, _ in walk.per_layer]
    units = _units(ctx, layers)
    replay = Replay(repeat=engine != "python")
    replay.take_encoded(*_static((ledger.total(PARAMETERS), ledger.total(MASTER), ledger.total(WORKSPACE)), units))
    trained = trainable_units(ctx, layers)
    copies = layer_weight_copies(ctx, layers)
    if sum(map(sum, copies)) + acts.head_copy > acts.other:
        copies = [[] for _ in copies]
    fsdp = fsdp_sizes(ctx, ledger, units, _spread)
    moments = _pieces(ctx, walk, ledger, _frozen(trained) if trained else units, copies, fsdp)
    grads = [] if moments.made_in_backward else [replay.take_all(u) for u in moments.grads]
    if not moments.states_in_step:
        replay.take_encoded(*_static((ledger.total(OPTIMIZER),), units))
    for step in range(_STEPS):
        grads = _step(ctx, walk, acts, loss, replay, grads, moments, (ledger, fsdp), first=step == 0)
    visits = {(id(ctx.run.model.layers[i]), transient): (i, transient) for i, _, transient in walk.per_layer}
    eager = any(eager_backward(ctx.run.model.layers[i], ctx.run, transient) for i, transient in visits.values())
    shaped = (trained is not None, any(copies), eager, softcapped(ctx, loss))
    return ScheduleReserved(replay.finish(engine=engine), replay.peak_requested, replay.events,
                            _note(ctx, replay.events, shaped, moments.made_in_backward))


def _note(ctx: StageContext, events: int, shaped: tuple[bool, bool, bool, bool], grads_in_backward: bool) -> str:
    """The --explain sentence: the schedule, and the mechanics that shaped this job's (``shaped``: trainable
    tensors of a fine-tuning job, autocast's weight copies, an eager softmax backward, a soft-capped loss)."""
    finetune, copies, eager, softcap = shaped
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
    if eager:
        parts.append("each eager-attention layer's backward frees its MLP block's and later attention tensors "
                     "before the softmax backward makes its two fp32 gradients of the probabilities and casts "
                     "the result back")
    if softcap:
        parts.append("the soft-capped logits' 16-bit tensors (logits / cap, its tanh, kept for the backward, "
                     "and * cap) made before the fp32 cross-entropy and one per op again in its backward")
    if ctx.layout.has_head and grads_in_backward:
        parts.append("the head's weight gradient made right after the loss"
                     + (", summed with the tied embedding's at the end of the backward"
                        if ctx.run.model.tie_word_embeddings else ""))
    return "; ".join(parts)


@dataclass(frozen=True)
class _Pieces:
    """Per unit (root, then layers) the sizes of the gradients, optimizer moments and step temporaries,
    and per layer autocast's weight copies."""

    grads: Units
    moments: Units
    step_temp: Units
    made_in_backward: bool
    states_in_step: bool
    #: Per layer of the stage, autocast's weight copies its forward makes (:mod:`~memplan.estimate.reserved_autocast`).
    copies: list[list[int]]
    keys: LayerKeys


def _pieces(ctx: StageContext, walk: LayerWalk, ledger: Ledger, units: Units, copies: list[list[int]],
            fsdp: FsdpSizes | None) -> _Pieces:
    made = ledger.total(ABSENT, "backward") > 0
    grads, halves, temps = _piece_sizes(ledger.total(OPTIMIZER), ledger.total(TEMPORARY, "optimizer step"),
                                        ledger.total(GRADIENTS, "end of backward"), units)
    return _Pieces(grads=grads, moments=halves, step_temp=temps, made_in_backward=made, states_in_step=made,
                   copies=copies, keys=layer_keys(ctx, walk, copies, grads if made else None, fsdp))


@lru_cache(maxsize=1024)
def _piece_sizes(optimizer: int, step: int, gradients: int, units: Units) -> tuple[Units, Units, Units]:
    """The gradients', optimizer moments' and step temporaries' sizes per unit (a pure function of the
    ledger's totals and the units, cached: jobs of one model and layout share them)."""
    moments = _spread(optimizer, units)
    # the moments are created in the first step's optimizer step, exp_avg and exp_avg_sq per tensor
    halves = [[part for size in unit for part in (size // 2, size - size // 2)] for unit in moments]
    temps = foreach_temporaries(step, [unit[1::2] for unit in halves]) or _spread(step, units)
    return _frozen(_spread(gradients, units)), _frozen(halves), _frozen(temps)


def _frozen(sizes: list[list[int]]) -> Units:
    return tuple(tuple(unit) for unit in sizes)


@lru_cache(maxsize=1024)
def _static(totals: tuple[int, ...], units: Units) -> tuple[tuple[int, ...], int]:
    """Each of ``totals`` spread over the units' tensors (:func:`_spread`), one after the other: the whole-step
    state's allocations, encoded (:func:`~memplan.estimate.reserved_replay.encoded`)."""
    return encoded([size for total in totals for unit in _spread(total, units) for size in unit])


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
    saved = forward_pass(ctx, walk, replay, copies, fsdp, pieces.keys)
    head_copy = replay.take(acts.head_copy)
    replay.moment(ledger, "forward", check)
    schedule_loss(ctx, ledger, loss, replay, check)
    replay.give(head_copy)
    root_grads = root_gradients(pieces.grads[0], ctx.layout.has_head, ctx.run.model.tie_word_embeddings)
    head = None
    if pieces.made_in_backward:
        head = replay.take(fsdp.head if fsdp is not None else root_grads.head)
    grads += backward_pass(ctx, walk, replay, saved, pieces.grads if pieces.made_in_backward else None, plan, check,
                           pieces.keys)
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
        replay.take_all([size for unit in pieces.moments for size in unit])
    step = replay.take_all([size for unit in pieces.step_temp for size in unit])
    replay.moment(ledger, "optimizer step", check)
    replay.give(*step)
    if pieces.made_in_backward:
        replay.give(*(b for unit in grads for b in unit))
        return []
    return grads
