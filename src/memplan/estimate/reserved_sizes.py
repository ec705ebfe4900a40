"""The sizes a reserved-memory schedule allocates (issue 25, item 8; :mod:`memplan.estimate.reserved_sim`):
the stage's parameter tensors grouped per unit (the root, then each decoder layer), a total of bytes spread
over them in proportion, the gradients', optimizer moments' and step temporaries' sizes (the last two in the
order the optimizer makes them: :func:`piece_sizes`), and the whole-step state's allocations. Pure functions
of the ledger's totals and the model, cached across jobs (a fit search prices one model under many layouts)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from memplan.estimate.context import StageContext
from memplan.estimate.memo import Same
from memplan.estimate.reserved_optimizer import foreach_temporaries
from memplan.estimate.reserved_replay import encoded
from memplan.estimate.reserved_tp import rank_numel
from memplan.model.linears import ParamTensor, model_parameters

#: Per unit (the root, then each layer) its tensors' sizes.
Units = tuple[tuple[int, ...], ...]


def stage_units(ctx: StageContext, layers: list[int]) -> Units:
    """The stage's parameter tensors' numels on one rank (:mod:`~memplan.estimate.reserved_tp`) grouped as
    the schedule allocates them: the root unit (embedding, final norm, head) first, then one unit per
    decoder layer in forward order. Cached per model, TP degree and framework profile (what
    :func:`~memplan.estimate.reserved_tp.rank_numel` reads; a test compares with the uncached sizes)."""
    run = ctx.run
    tp = max(run.job.parallel.tp, 1)
    return _rank_units(Same(run.model), tp, Same(run.profile) if tp > 1 else None, tuple(layers),
                       ctx.layout.has_embedding or ctx.layout.has_head)


@lru_cache(maxsize=256)
def _rank_units(model: Same, tp: int, profile: Same | None, layers: tuple[int, ...], root: bool) -> Units:
    tensors = model_parameters(model.obj)  # type: ignore[arg-type]
    sizes = ([t.numel for t in tensors] if profile is None
             else [rank_numel(model.obj, profile.obj, tp, t) for t in tensors])  # type: ignore[arg-type]
    return _grouped(tensors, sizes, list(layers), root)


def head_position(ctx: StageContext) -> int | None:
    """The position of the output head's own weight among the root unit's tensors (:func:`stage_units`), None
    where the stage has no head or the head has no tensor of its own (tied to the embedding)."""
    return _head_position(Same(ctx.run.model)) if ctx.layout.has_head else None


@lru_cache(maxsize=64)
def _head_position(model: Same) -> int | None:
    root = [t.name for t in model_parameters(model.obj) if t.layer is None]  # type: ignore[arg-type]
    return next((i for i, name in enumerate(root) if name.startswith("lm_head.")), None)


def parameter_lead(ctx: StageContext) -> int:
    """How many of the root unit's tensors (:func:`stage_units`) ``model.parameters()`` lists before the
    decoder layers: the embeddings (``embed_tokens``; GPT-2's ``wte`` and ``wpe``). The root's other tensors
    (the final norm, the head) come after the layers (:func:`in_parameter_order`)."""
    return _lead(Same(ctx.run.model))


@lru_cache(maxsize=64)
def _lead(model: Same) -> int:
    lead = 0
    for t in model_parameters(model.obj):  # type: ignore[arg-type]
        if t.layer is not None:
            break
        lead += 1
    return lead


def in_parameter_order(pieces: Sequence[Sequence[int]], lead: int | None) -> list[list[int]]:
    """Per unit (the root, then the layers) ``pieces`` put in ``model.parameters()`` order (``lead``: the root's
    pieces that come before the layers, :func:`parameter_lead`): the root's first ``lead``, the layers', then the
    root's others; unchanged (root first) when ``lead`` is None."""
    if lead is None or not pieces:
        return [list(unit) for unit in pieces]
    root = list(pieces[0])
    return [root[:lead], *(list(unit) for unit in pieces[1:]), root[lead:]]


def _grouped(tensors: Sequence[ParamTensor], sizes: list[int], layers: list[int], root: bool) -> Units:
    by_layer: dict[int | None, list[int]] = {}
    for t, size in zip(tensors, sizes):
        by_layer.setdefault(t.layer, []).append(size)
    return (tuple(by_layer.get(None, [])) if root else (),) + tuple(tuple(by_layer.get(i, [1])) for i in layers)


def spread(total: int, units: Sequence[Sequence[int]]) -> list[list[int]]:
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


@lru_cache(maxsize=1024)
def piece_sizes(optimizer: int, step: int, gradients: int, units: Units, lead: int | None = None, counter: int = 0
                ) -> tuple[Units, Units, Units]:
    """The gradients', optimizer moments' and step temporaries' sizes per unit (a pure function of the
    ledger's totals and the units, cached: jobs of one model and layout share them). With ``lead`` (the
    root's tensors before the layers, :func:`parameter_lead`) the moments and temporaries come in
    ``model.parameters()`` order, as torch.optim makes them (:func:`in_parameter_order`; the root unit split in
    two around the layers), else per unit, the root first.

    ``counter``: the bytes of the step counter a fused torch optimizer keeps on the GPU per tensor
    (:func:`~memplan.estimate.states.device_step_counters`; 0: none), made before the tensor's moments
    (``_init_group``: ``state["step"]``, then ``exp_avg``, ``exp_avg_sq``). The optimizer total counts them;
    spread over the moments, they made each moment a few bytes larger than its parameter, so every large one
    rounded up to the next 2 MiB and fitted no segment that a tensor of the parameter's size had left (a trace
    of deepseek-v2-lite under torchtitan: 52 four-byte ``zeros``, moments of exactly 800, 1,408 and 704 MiB)."""
    count = sum(map(len, units)) if counter else 0
    counters, per = (count * counter, 3) if counter and optimizer >= count * counter else (0, 2)
    moments = spread(optimizer - counters, units)
    # the moments are created in the first step's optimizer step, exp_avg and exp_avg_sq per tensor
    halves = in_parameter_order([[part for size in unit for part in (counter, size // 2, size - size // 2)[3 - per:]]
                                 for unit in moments], None if lead is None else per * lead)
    temps = (foreach_temporaries(step, [unit[per - 1::per] for unit in halves])
             or in_parameter_order(spread(step, units), lead))
    return frozen(spread(gradients, units)), frozen(halves), frozen(temps)


def frozen(sizes: list[list[int]]) -> Units:
    return tuple(tuple(unit) for unit in sizes)


@lru_cache(maxsize=1024)
def static_allocations(totals: tuple[int, ...], units: Units) -> tuple[tuple[int, ...], int]:
    """Each of ``totals`` spread over the units' tensors (:func:`spread`), one after the other: the whole-step
    state's allocations, encoded (:func:`~memplan.estimate.reserved_replay.encoded`)."""
    return encoded([size for total in totals for unit in spread(total, units) for size in unit])
