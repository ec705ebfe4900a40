"""A decoder layer's forward in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`): the tensors it saves, split as a trace allocates them
(:mod:`~memplan.estimate.reserved_terms`), those a recompute policy drops made and freed, autocast's
weight copies between them, and each pre-norm's fp32 output under autocast held until its block ends
(:func:`~memplan.estimate.reserved_terms.norm_output`)."""

from __future__ import annotations

from functools import lru_cache

from memplan.estimate.activations import KEPT_BY, divided, has_eager_core, layer_terms
from memplan.estimate.context import RunContext, StageContext
from memplan.estimate.layer_costs import per_tensor_offload
from memplan.estimate.memo import Same
from memplan.estimate.reserved_adapters import adapter_step, with_adapters
from memplan.estimate.reserved_attention_backward import (
    SOFTMAX_SLOT,
    TANH_SLOT,
    capped_first,
    capped_forward,
    core_forward,
)
from memplan.estimate.reserved_backward import early_terms
from memplan.estimate.reserved_experts_backward import clamped_experts, experts_forward
from memplan.estimate.reserved_grouped_forward import grouped_forward
from memplan.estimate.reserved_mlp_backward import EXPERT_SLOT, GROUPED_SLOT, SLOTS, grouped_slots, op_slots, term_slots
from memplan.estimate.reserved_replay import Block, Replay
from memplan.estimate.reserved_sinks import sink_temporaries
from memplan.estimate.reserved_terms import (
    ADAPTER,
    DROPPED,
    HELD,
    KEPT,
    LAYER_HELD,
    RELEASE,
    norm_output,
    term_tensors,
)
from memplan.estimate.terms import TermRole
from memplan.model.spec import LayerSpec


def layer_blocks(ctx: StageContext, index: int, kept: int) -> list[tuple[int, int, bool]]:
    """The tensors layer ``index``'s forward makes, in order, as (size, kind, early): its terms when the kept
    ones add up to ``kept`` (those a recompute policy drops are made and freed in the forward), else one
    block; ``kind`` one of :data:`KEPT`, :data:`DROPPED`, :data:`HELD` (a pre-norm's output held to its
    block's end, :func:`~memplan.estimate.reserved_terms.norm_output`) or :data:`RELEASE` (size 0: the held
    ones freed); ``early``: freed before an eager softmax backward (:mod:`~memplan.estimate.reserved_backward`),
    or, an int from 2, the tensor's slot + 2 among the MLP tensors its backward frees op by op
    (:data:`~memplan.estimate.reserved_mlp_backward.SLOTS`; also early)."""
    if per_tensor_offload(ctx.run):  # every tensor made and freed in the forward, none kept (_kind_tensors)
        return list(_kind_tensors(Same(ctx.run), Same(ctx.run.model.layers[index]), True, True))
    # a layer that a layer-checkpointing policy (block, uniform) leaves out saves what it saves without recompute
    run, shape = ctx.run, ctx.run.shape
    whole = index not in ctx.recomputed and not run.policy.partial
    eager = has_eager_core(shape)
    if index in ctx.recomputed and not run.policy.partial and eager:
        # a layer recomputed whole with an eager core: its checkpointed forward makes every tensor and frees it (the
        # core's score temporaries around them, as under save_on_cpu), the input kept
        terms = list(_kind_tensors(Same(run), Same(run.model.layers[index]), False, checkpointed=True))
    else:
        terms = _layer_tensors(ctx, index, whole)
    if sum(size for size, kind, _ in terms if kind == KEPT) != kept:
        return [(kept, KEPT, False)]
    if ctx.run.counts is None:
        return terms
    # a fine-tuned layer's forward under checkpointing makes every tensor and its adapters' (reserved_adapters);
    # without, the schedule lays out what it keeps
    return with_adapters(ctx, index, terms) if index in ctx.recomputed and not run.policy.partial else [
        term for term in terms if term[1] == KEPT]


def recomputed_blocks(ctx: StageContext, index: int, *, reads_input: bool = False,
                      grouped: bool = False) -> list[tuple[int, int, bool]]:
    """The tensors a recomputed layer's forward makes again in its backward (:func:`layer_blocks` of the whole
    layer: every term kept); ``reads_input``: without the layer's input, which the recompute reads from the
    checkpoint (no copy; the allocated peak's walk counts it so: :mod:`~memplan.estimate.recomputed_backward`);
    ``grouped``: transformers' grouped experts' tensors tagged with their slots
    (:func:`~memplan.estimate.reserved_mlp_backward.grouped_slots`)."""
    if reads_input or grouped:
        return list(_kind_tensors(Same(ctx.run), Same(ctx.run.model.layers[index]), True, without_input=reads_input,
                                  grouped=grouped))
    return _layer_tensors(ctx, index, True)


def _layer_tensors(ctx: StageContext, index: int, whole: bool) -> list[tuple[int, int, bool]]:
    return list(_kind_tensors(Same(ctx.run), Same(ctx.run.model.layers[index]), whole))


@lru_cache(maxsize=64)
def _kind_tensors(run_key: Same, layer_key: Same, whole: bool, offloaded: bool = False, checkpointed: bool = False,
                  without_input: bool = False, grouped: bool = False) -> tuple[tuple[int, int, bool], ...]:
    """The tensors of a layer of kind ``layer_key`` (every layer of one spec object makes the same) in ``run_key``'s
    job, cached per run and kind (the schedule asks again in the backward and for its --explain sentence).

    ``offloaded``: under ``save_on_cpu`` the forward (a checkpointed one too) makes every tensor of the whole
    layer on the GPU and frees it once the forward has used it, autograd holding only its host copy: each is
    :data:`DROPPED` (the fp32 softmax output held to the layer's end: :func:`_offloaded_kind`), the eager
    core's tagged with their slots so that its score temporaries are made around them (:func:`forward_layer`).
    A trace of gemma-2-2b's forward under ``save_on_cpu`` makes them so (at seq 4096 x 2 its 1 GiB fp32 masked
    scores beside the softmax output); the schedule made none of them (one empty block per layer), so it
    reserved no segment of their size, and the gradients and optimizer states that the trace puts in those
    segments filled the loss's: +6.6% against the trace's simulated reserved under full recompute."""
    run: RunContext = run_key.obj  # type: ignore[assignment]
    layer: LayerSpec = layer_key.obj  # type: ignore[assignment]
    terms: list[tuple[int, int, bool]] = []
    saved = layer_terms(layer, run.shape)
    norm_input = 0  # the last pre-norm input's bytes (its output comes after it)
    clamped = clamped_experts(run)
    classes, dropped = (KEPT_BY["none"], frozenset()) if whole else (run.kept_classes, run.dropped)
    for t, early in zip(saved, early_terms(layer, run)):
        size = divided(t, run.shape)
        if t.role is TermRole.NORM_INPUT:
            terms += [(0, RELEASE, False)] if terms else []
            norm_input = size or norm_input  # a parallel-residual MLP's norm reads the attention's input
        if t.role is TermRole.NORM_OUTPUT:
            terms.append((norm_output(norm_input, run), HELD, False))
        if t.role is TermRole.SINK_SOFTMAX:
            terms += sink_temporaries(layer, run)
        if without_input and t.keep == "input":  # read from the checkpoint, not made again
            continue
        keep = KEPT if t.keep in classes and t.site not in dropped and not offloaded else DROPPED
        pieces = term_tensors(t, size, layer, run)
        tagged = offloaded or (checkpointed and keep != KEPT)  # every tensor made and freed in the forward
        slots = term_slots(t.role, len(pieces), run) if tagged else op_slots(t.role, len(pieces), run,
                                                                             whole and keep == KEPT)
        if slots is None and (grouped or (keep != KEPT and run.shape.grouped_experts_combine and not clamped)):
            slots = grouped_slots(t.role, len(pieces))  # transformers' grouped experts (reserved_grouped_forward)
        terms += [(piece, _offloaded_kind(slots, slot, keep), early if slots is None else 2 + slot)
                  for piece, slot in zip(pieces, slots or [0] * len(pieces))]
    return tuple(capped_first([term for term in terms if term[0] > 0 or term[1] == RELEASE] + [(0, RELEASE, False)]))


def _offloaded_kind(slots: list[int] | None, slot: int, kind: int) -> int:
    """``kind``, but :data:`LAYER_HELD` for an eager core's fp32 softmax output that the forward makes under
    ``save_on_cpu`` (``slots`` given: :func:`_kind_tensors`): HF's eager attention returns it, and the decoder
    layer drops it only when it returns (a trace of gemma-2-2b frees it after the MLP block). Freed once the
    probabilities were made instead, gemma-2-2b s1024 b2 bf16-mixed was -3.9% against the trace's simulated
    reserved (each layer's scores then found no free segment of theirs: the weight copies sat in them)."""
    return LAYER_HELD if slots is not None and kind == DROPPED and slot == SOFTMAX_SLOT else kind


def forward_layer(replay: Replay, tensors: list[tuple[int, int, bool]], copies: list[int], cached: list[int],
                  fp32_mask: bool = False) -> tuple[list[Block | None], ...]:
    """A layer's forward: its tensors in order, a dropped one freed once the next is made, a held one at
    the next release; autocast's weight copies (``copies``, saved for the layer's backward, then ``cached``,
    held by autocast's cache alone: :func:`~memplan.estimate.reserved_autocast.layer_cached_copies`) made
    between them, spread evenly (each linear casts its weight when it runs). Returns the kept blocks the
    backward frees early, the other kept ones, the cached copies (freed when autocast exits), and the MLP
    tensors its backward frees op by op, one per slot (None: not saved as such)."""
    held: tuple[list[Block | None], ...] = ([], [], [], [None] * len(SLOTS))
    casts = [(size, 1) for size in copies] + [(size, 2) for size in cached]
    pending, holding, to_end = None, [], []
    after = None  # the eager core's masked scores, freed once the next tensor (the probabilities) is made
    capped = False  # the eager core's soft-capped scores were made (reserved_attention_backward.capped_forward)
    done = 0
    made = [t for t in tensors if t[1] not in (RELEASE, ADAPTER)]
    scores = next((size for size, kind, slot in tensors if slot == 2 + SOFTMAX_SLOT - 1 and kind != ADAPTER), 0)
    position = 0
    experts: dict[str, Block | None] = {}  # gpt-oss's experts' forward temporaries (experts_forward)
    adapter: dict[int, Block | None] = {}  # a LoRA adapter's forward temporaries (adapter_step)
    for size, kind, early in tensors:
        if kind == RELEASE:
            replay.give(*holding)
            holding = []
            continue
        if kind == ADAPTER:
            adapter_step(replay, size, early, adapter)
            continue
        position += 1
        due = -(-position * len(casts) // len(made))
        _cast(replay, casts[done:due], held, 0 if early else 1)
        done = max(done, due)
        if early >= 2 + EXPERT_SLOT:  # the experts' temporaries around their tensors (gpt-oss's; transformers')
            block = _experts_step(replay, early - 2, size, kind == KEPT, experts)
            replay.give(pending, after)
            pending, after = None, None
        elif scores and early > 1:  # the eager core's temporaries around its saved tensors
            before = capped_forward(replay, scores) if early == 2 + TANH_SLOT else None
            upcast, masked = (core_forward(replay, (scores, size), capped, fp32_mask) if early == 2 + SOFTMAX_SLOT
                              else (None, None))
            capped = capped or before is not None
            block = replay.take(size)
            replay.give(before, upcast, pending, after)
            pending, after = None, masked
        else:
            block = replay.take(size)
            replay.give(pending, after)
            pending, after = None, None
        if kind == KEPT and early > 1:
            held[3][early - 2] = block
        elif kind == KEPT:
            held[not early].append(block)
        elif kind == HELD:
            holding.append(block)
        elif kind == LAYER_HELD:
            to_end.append(block)
        else:
            pending = block
    replay.give(pending, after, *holding, *to_end, *experts.values())
    _cast(replay, casts[done:], held, 1)
    return held


def _experts_step(replay: Replay, slot: int, size: int, kept: bool, temps: dict[str, Block | None]) -> Block | None:
    """An experts' tensor in ``slot`` made with the forward's temporaries around it: gpt-oss's
    (:func:`~memplan.estimate.reserved_experts_backward.experts_forward`) or transformers' grouped experts'
    (:func:`~memplan.estimate.reserved_grouped_forward.grouped_forward`, None where it frees the tensor itself)."""
    if slot < GROUPED_SLOT:
        return experts_forward(replay, slot - EXPERT_SLOT, size, temps)
    return grouped_forward(replay, slot - GROUPED_SLOT, size, kept, temps)


def _cast(replay: Replay, casts: list[tuple[int, int]], held: tuple[list[Block | None], ...], saved: int) -> None:
    """Make autocast's weight copies ``casts`` ((size, 1 saved / 2 cached)): a saved one joins ``held[saved]``,
    a cached one ``held[2]``."""
    for size, kind in casts:
        held[saved if kind == 1 else 2].append(replay.take(size))
