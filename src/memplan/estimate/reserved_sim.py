"""Reserved memory from the caching-allocator simulator (issue 25, item 8; ``reserved="simulated"``).

The estimate's own contributions are laid out as an allocation schedule of one training step on one
GPU, repeated so that the allocator's cache reaches its steady state, and replayed through
:mod:`memplan.alloc`'s model of PyTorch's caching allocator; the stage's reserved memory is the
simulated peak reserved. The schedule, in execution order:

- the whole-step state (parameters, master weights, optimizer moments, workspaces) allocated first,
  one block per decoder layer plus one for the embedding/head (the FSDP root unit) per category;
- forward: the stage's other activations, then per decoder layer autocast's weight copies
  (:mod:`~memplan.estimate.reserved_autocast`: those autograd saves, and those of checkpointed regions
  that autocast's cache alone holds until the loss's forward is done) and the tensors it saves (the
  layer's saved terms, split into the tensors each counts by :mod:`~memplan.estimate.reserved_terms`,
  when they add up to what the estimate keeps for it, else one block; under autocast each pre-norm's
  fp32 output held to its block's end: :mod:`~memplan.estimate.reserved_forward`), then the loss's
  logits (:mod:`~memplan.estimate.reserved_loss`), autocast's cached copies freed after its forward;
- backward: the head's weight gradient right after the loss, then in reverse layer order the layer's
  backward transient allocated, its gradients allocated (when gradients are made in the backward), the
  transient and the layer's saved tensors freed (an eager softmax backward instead as autograd runs it:
  :mod:`~memplan.estimate.reserved_backward`; a dense layer with a gated MLP and eager attention op by op:
  :mod:`~memplan.estimate.reserved_mlp_backward`, :mod:`~memplan.estimate.reserved_attention_backward`, a fully
  recomputed one after its forward made again: :mod:`~memplan.estimate.reserved_recompute`); the embedding's
  gradient (and a tied sum) last (:mod:`~memplan.estimate.reserved_root`);
- the optimizer step's temporaries, one ``exp_avg_sq``-sized tensor per trainable tensor
  (:mod:`~memplan.estimate.reserved_optimizer`), freed; gradients freed before the next step where they
  are not alive through the whole step. The first step makes the optimizer's moments before them; under
  ``torch.optim`` (``FrameworkProfile.torch_optimizer``) moments and temporaries come in
  ``model.parameters()``' order, as ``_init_group`` and the foreach ops make them: the embedding's, the
  layers', then the final norm's and head's (:func:`~memplan.estimate.reserved_sizes.piece_sizes`).

Gradients, moments and step temporaries are laid out over the trainable tensors
(:mod:`~memplan.estimate.reserved_trainable`: under PEFT the adapters and ``modules_to_save`` copies).

At each of the ledger's candidate moments the schedule holds what it placed; what else the ledger
has alive at that moment (communication buffers, inputs, temporaries the schedule does not place)
is allocated as one block there and freed after, so the schedule's allocated peak is the estimate's
peak allocated. Limits: gradients and states are split per layer, not per parameter tensor, so the
small pool and per-tensor holes are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memplan.estimate.context import StageContext
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.reserved_autocast import layer_cached_copies, layer_weight_copies
from memplan.estimate.reserved_backward import eager_backward
from memplan.estimate.reserved_sinks import sink_note
from memplan.estimate.reserved_layers import LayerKeys, Saved, backward_pass, forward_pass, layer_keys
from memplan.estimate.reserved_fsdp import FsdpSizes, fsdp_sizes
from memplan.estimate.reserved_loss import schedule_loss, softcapped
from memplan.estimate.reserved_offload import offloaded_plan
from memplan.estimate.reserved_recompute import moment_choice, moment_position, op_plans
from memplan.estimate.reserved_replay import Block, Replay
from memplan.estimate.reserved_root import finish_root, root_gradients
from memplan.estimate.reserved_sizes import (Units, frozen, head_position, parameter_lead, piece_sizes, spread,
                                             stage_units, static_allocations)
from memplan.estimate.reserved_trainable import trainable_lead, trainable_units
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
from memplan.estimate.stage_activations import StageActivations, head_numel
from memplan.estimate.fsdp_units import head_unit
from memplan.estimate.stage_peak import LossPart
from memplan.estimate.states import STEP_COUNTER_BYTES, device_step_counters

#: Training steps replayed (the first allocates what later steps find cached).
_STEPS = 2


@dataclass(frozen=True)
class ScheduleReserved:
    """The simulated peak reserved bytes of a stage's schedule, its peak requested bytes, and its explanation."""

    reserved: int
    #: The schedule's peak of requested bytes (the estimate's peak allocated when the schedule is right).
    requested: int
    events: int
    note: str


def simulated_reserved(ctx: StageContext, ledger: Ledger, walk: LayerWalk, acts: StageActivations,
                       loss: LossPart, *, engine: str = "auto", walked: int | None = None) -> ScheduleReserved:
    """Replay the stage's schedule (see the module) and return its simulated peaks. ``engine="python"``:
    every layer's events built one by one and replayed by the pure-Python allocator model (the reference
    the default, which copies repeated layers and replays in the C core when built, is tested against).
    ``walked``: the position in ``walk`` of the layer the ledger's backward moment stops at, where it walks
    the backward (:func:`~memplan.estimate.backward_walk.walked_backward`)."""
    layers = [index for index, _, _ in walk.per_layer]
    units = stage_units(ctx, layers)
    replay = Replay(repeat=engine != "python")
    state = (ledger.total(PARAMETERS), ledger.total(MASTER), ledger.total(WORKSPACE))
    replay.take_encoded(*static_allocations(state, units))
    trained = trainable_units(ctx, layers)
    saved = layer_weight_copies(ctx, layers)
    copies = [[] for _ in saved] if sum(map(sum, saved)) + acts.head_copy > acts.other else saved
    if acts.per_tensor_offload:
        plan = offloaded_plan(ctx, walk, layers, acts, (trained, saved))
        walk, cached = plan.walk, plan.cached
        # the head's cached copy lives as the head's saved one would: made at the head, gone after the loss
        acts = replace(acts, head_copy=acts.head_copy + plan.head_cached, other=acts.other + plan.head_cached)
    else:
        # all empty unless they add up to the estimate's autocast cache (layer_cached_copies): none, none to split
        cached = layer_cached_copies(ctx, layers, acts.autocast_cache, trained) if acts.autocast_cache else [
            [] for _ in layers]
    fsdp = fsdp_sizes(ctx, ledger, units, spread, head_unit(ctx), trained is not None)
    # torch.optim makes the states (and a foreach step its temporaries) in the parameters' order (reserved_sizes)
    lead = (trainable_lead(ctx) if trained else parameter_lead(ctx)) if ctx.run.profile.torch_optimizer else None
    moments = _pieces(ctx, walk, ledger, (frozen(trained) if trained else units, lead), (copies, cached), fsdp)
    moments = replace(moments, head=None if trained else head_position(ctx))
    grads = [] if moments.made_in_backward else [replay.take_all(u) for u in moments.grads]
    if not moments.states_in_step:
        replay.take_encoded(*static_allocations((ledger.total(OPTIMIZER),), units))
    at = moment_position(ctx, walk)
    # the ledger's backward moment: the last layer's, or the layer the ledger's walk stops at (gradients of every
    # later layer made) where the first step's schedule holds more there (reserved_recompute.moment_choice)
    probe = dict.fromkeys((at, walked), -1) if walked is not None and walked != at else None
    for step in range(_STEPS):
        grads = _step(ctx, walk, acts, loss, replay, grads, moments, (ledger, fsdp), first=step == 0,
                      moment=(at, probe))
        at = at if probe is None or step else moment_choice(at, probe)
    visits = {(id(ctx.run.model.layers[i]), transient): (i, transient) for i, _, transient in walk.per_layer}
    eager = any(eager_backward(ctx.run.model.layers[i], ctx.run, transient) for i, transient in visits.values())
    counts = [len(moments.grads[p + 1]) if moments.made_in_backward and fsdp is None else None
              for p in range(len(layers))]
    shaped = (trained is not None, any(copies), eager, softcapped(ctx, loss), any(cached), acts.per_tensor_offload,
              *op_plans(ctx, walk, counts))
    return ScheduleReserved(replay.finish(engine=engine), replay.peak_requested, replay.events,
                            _note(ctx, replay.events, shaped, moments.made_in_backward))


def _note(ctx: StageContext, events: int, shaped: tuple[bool, ...], grads_in_backward: bool) -> str:
    """The --explain sentence: the schedule, and the mechanics that shaped this job's (``shaped``: trainable
    tensors of a fine-tuning job, autocast's weight copies, an eager softmax backward, a soft-capped loss,
    autocast's cached copies of checkpointed layers, save_on_cpu, kept layers' backward op by op, recomputed
    layers' forward made again)."""
    finetune, copies, eager, softcap, cached, offloaded, ops, recomputed = shaped
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
    if cached:
        whose = ("every layer and the head (what save_on_cpu packs to host is the cached tensor)" if offloaded
                 else "the checkpointed layers")
        parts.append(f"torch.autocast's cached 16-bit weight copies of {whose} (and their fp32 adapters) made in "
                     "each layer's forward and freed together when the autocast region exits, after the loss's "
                     "forward")
    if offloaded:
        parts.append("under save_on_cpu no layer's saved tensors kept on the GPU: each layer's forward makes them "
                     "(an eager core's score temporaries and fp32 softmax output too, that held to the layer's end) "
                     "and frees them once used, each layer's backward bringing back its largest saved tensor beside "
                     "its transient")
    if eager and not ops:  # the op-by-op core replaces the eager plan
        parts.append("each eager-attention layer's backward frees its MLP block's and later attention tensors "
                     "before the softmax backward makes its two fp32 gradients of the probabilities and casts "
                     "the result back")
    sinks = sink_note(ctx.run)
    if sinks is not None:
        parts.append(sinks)
    if ops:
        parts.append("each layer's gated MLP and eager attention core run backward op by op as autograd runs them: "
                     "each weight gradient made between the frees of its op's saved tensors, the MLP's "
                     "intermediate gradients, the softmax backward's fp32 upcast beside the saved fp32 softmax "
                     "output (and the forward's score temporaries)")
    if recomputed:
        parts.append("each fully recomputed layer's forward made again in its backward, temporaries included, "
                     "before its backward runs op by op")
    if softcap:
        parts.append("the soft-capped logits' 16-bit tensors (logits / cap, its tanh, kept for the backward, "
                     "and * cap) made before the fp32 cross-entropy and one per op again in its backward")
    if ctx.run.job.parallel.tp > 1:
        parts.append("under tensor parallelism each tensor at its size on one rank (the layers' linear weights "
                     "split, norms whole, the embedding, head and the loss's logits split only where the "
                     "framework splits the vocabulary)")
    if ctx.layout.has_head and grads_in_backward:
        parts.append("the head's weight gradient made right after the loss"
                     + (", summed with the tied embedding's at the end of the backward"
                        if ctx.run.model.tie_word_embeddings else ""))
    return "; ".join(parts)


def _forward(ctx: StageContext, walk: LayerWalk, replay: Replay, pieces: _Pieces, fsdp: FsdpSizes | None
             ) -> tuple[list[Block | None], list[Saved], list[Block | None]]:
    """The forward's FSDP2 root and layers: the root unit's parameters alive after it (under torchtitan's
    outer units the head's: the embedding's reshard after its forward,
    :mod:`~memplan.estimate.reserved_fsdp`), each layer's saved blocks, and the all-gather output the root's
    forward end frees (:func:`forward_pass`)."""
    output = replay.all_gather(fsdp, 0)
    root = replay.copy_out(fsdp, 0)
    outer = fsdp is not None and fsdp.outer
    if outer:
        replay.give(*root)
    saved, held = forward_pass(ctx, walk, replay, (pieces.copies, pieces.cached), fsdp, pieces.keys,
                               [] if output is None else [output])
    if outer:
        return replay.head_forward(fsdp, held), saved, []
    return root, saved, held


def _head_gradients(replay: Replay, made_by: tuple[_Pieces, StageContext], fsdp: FsdpSizes | None, head: int,
                    logits_grad: Block | None) -> tuple[Block | None, list[Block | None]]:
    """The gradients made right after the loss: the head's weight gradient (``head``: its size without FSDP2),
    or under torchtitan's outer units the head unit's (final norm and head); under FSDP2 fine-tuning none here
    (the root's trainable tensors' are made at its post-backward: ``Replay.root_gradients``). The logits'
    gradient (``logits_grad``) is freed once the head's ``mm`` has read it: where autocast made the head's
    product from a 16-bit copy of wider weights (``made_by``: the pieces and the run), that product
    (16-bit) comes first and the gradient is its cast up by the copy's ``_to_copy`` backward, made after the
    logits' gradient is freed: a trace of deepseek-v2-lite under torchtitan (bf16-mixed, fp32 weights, s4096
    x 2) makes the 400 MiB ``mm``, frees the 1,600 MiB logits' gradient, then makes the 800 MiB fp32
    gradient in that freed segment (the schedule made it beside the logits' gradient, in another segment). A
    fine-tuned head (peft's ``modules_to_save`` copy) keeps the base's dtype: its gradient is the product itself.
    The product is the head's weight on one rank (:func:`~memplan.estimate.stage_activations.head_numel`: a head
    tied to an embedding that TP does not split is whole; it was sized vocab x hidden / TP, half the weight under
    Hugging Face's TP 2)."""
    pieces, ctx = made_by
    run = ctx.run
    if not pieces.made_in_backward or (fsdp is not None and fsdp.grad_scale is not None):
        replay.give(logits_grad)
        return None, []
    if fsdp is not None and fsdp.outer:
        made = replay.take_all(fsdp.unsharded[-1])
        replay.give(logits_grad)
        return None, made
    # the gradient's bytes per element against the compute dtype's (a fine-tuned head's copy keeps the base's dtype)
    numel = head_numel(ctx)
    upcast = fsdp is None and run.prec.weight_copies == "autocast" and head > numel * run.prec.act_bytes > 0
    product = replay.take(numel * run.prec.act_bytes) if upcast else None
    if upcast:
        replay.give(logits_grad)
    block = replay.take(fsdp.head if fsdp is not None else head)
    replay.give(product, None if upcast else logits_grad)
    return block, []


def _root_backward(replay: Replay, pieces: _Pieces, fsdp: FsdpSizes | None,
                   alive: tuple[Block | None, list[Block | None], list[Block | None]],
                   grads: list[list[Block | None]]) -> list[Block | None]:
    """The FSDP2 root unit's end of the backward (``alive``: the head's gradient, the root's parameters and
    the output the first layer prefetched); its sharded gradients appended to ``grads``. Returns the root's
    blocks the step's end frees (the reduce-scatter input, held to the end of the backward)."""
    head, root, prefetched = alive
    outer = fsdp is not None and fsdp.outer
    if outer:  # the embedding's backward: its copy-out frees the prefetched output
        root = replay.copy_out(fsdp, 0, *prefetched)
    if not pieces.made_in_backward and outer:  # no gradient: the embedding's reshard alone
        replay.give(*root)
        return []
    if not pieces.made_in_backward:
        return root
    staged, *sharded = replay.root_gradients(fsdp, head, root, pieces.grads[0])  # type: ignore[arg-type]
    grads.append(sharded)
    return [staged]


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
    #: Per layer, the copies autocast's cache alone holds until the loss (:mod:`~memplan.estimate.reserved_autocast`).
    cached: list[list[int]]
    keys: LayerKeys
    #: The position of the head's own gradient among the root's (:func:`~memplan.estimate.reserved_sizes.head_position`;
    #: None: the largest).
    head: int | None = None


def _pieces(ctx: StageContext, walk: LayerWalk, ledger: Ledger, units: tuple[Units, int | None],
            casts: tuple[list[list[int]], list[list[int]]], fsdp: FsdpSizes | None) -> _Pieces:
    """The schedule's sizes (``units``: the units' tensors and the root's before the layers in the optimizer's
    order, :func:`~memplan.estimate.reserved_sizes.piece_sizes`; ``casts``: per layer autocast's saved and cached
    weight copies)."""
    copies, cached = casts
    made = ledger.total(ABSENT, "backward") > 0
    tensors = sum(map(len, units[0]))
    counter = STEP_COUNTER_BYTES if device_step_counters(ctx.run.job, ctx.run.profile, tensors) else 0
    grads, halves, temps = piece_sizes(ledger.total(OPTIMIZER), ledger.total(TEMPORARY, "optimizer step"),
                                        ledger.total(GRADIENTS, "end of backward"), *units, counter)
    return _Pieces(grads=grads, moments=halves, step_temp=temps, made_in_backward=made, states_in_step=made,
                   copies=copies, cached=cached,
                   keys=layer_keys(ctx, walk, (copies, cached), grads if made else None, fsdp))


def _step(ctx: StageContext, walk: LayerWalk, acts: StageActivations, loss: LossPart, replay: Replay,
          grads: list[list[Block | None]], pieces: _Pieces, plan: tuple[Ledger, FsdpSizes | None], *, first: bool,
          moment: tuple[int, dict[int, int] | None]) -> list[list[Block | None]]:
    """One training step of the schedule; the first creates the optimizer moments (no ledger moment is
    checked then: the ledger describes the steady state). ``moment``: the position of the layer whose backward
    holds the ledger's backward moment, and the positions whose requested bytes the first step records
    (:func:`~memplan.estimate.reserved_recompute.moment_choice`). Returns the gradients alive after the step."""
    ledger, fsdp = plan
    check = not first
    copies = pieces.copies
    # the output head's autocast weight copy is made at the head, after the layers, and freed in its backward
    other = replay.take(acts.other - acts.head_copy - sum(map(sum, copies)))
    root, saved, output_held = _forward(ctx, walk, replay, pieces, fsdp)
    outer = fsdp is not None and fsdp.outer
    head_copy = replay.take(acts.head_copy)
    replay.moment(ledger, "forward", check)
    prefetched: list[Block | None] = []
    # the root's forward ends after the loss's (the last layer's all-gather output freed then) and its backward
    # hook prefetches the last layer's (reserved_fsdp)
    last = len(walk.per_layer)  # the last layer's unit

    def ahead() -> None:
        if fsdp is not None and last:
            prefetched.append(replay.all_gather(fsdp, last))

    logits_grad = schedule_loss(ctx, ledger, loss, replay, check,
                                ([b for blocks in saved for b in blocks[2]] + output_held,
                                 (lambda: None) if outer else ahead))
    if outer:  # the head unit's pre-backward prefetches, once the logits' gradient is made (reserved_fsdp)
        ahead()
    replay.give(head_copy)
    root_grads = root_gradients(pieces.grads[0], ctx.layout.has_head, ctx.run.model.tie_word_embeddings, pieces.head)
    head, made = _head_gradients(replay, (pieces, ctx), fsdp, root_grads.head, logits_grad)
    staged: Block | None = None
    if outer:
        staged, *sharded = replay.head_backward(fsdp, made, root)
        grads.append(sharded)
        root = []
    grads += backward_pass(ctx, walk, replay, saved, pieces.grads if pieces.made_in_backward else None, plan, check,
                           pieces.keys, (prefetched, [staged]), moment=moment[0], probe=moment[1] if first else None)
    summed: list[Block | None] = []
    if pieces.made_in_backward and fsdp is None:
        alive, summed = finish_root(replay, root_grads, head)
        grads.append(alive)
    else:
        root = _root_backward(replay, pieces, fsdp, (head, root, prefetched), grads)
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
