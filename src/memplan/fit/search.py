"""``fit``: which layouts, micro-batches and recompute settings of a model fit N GPUs, fastest first.

The search walks every layout of :func:`memplan.fit.space.enumerate_layouts` and, for each, the
micro-batch sizes from 1 upwards. It relies on two monotonicities of the estimator, so that most
layouts cost one or two estimates:

* memory grows with the micro-batch (at a fixed global batch, fewer but larger micro-batches are
  in flight), so the first micro-batch at which even full recompute does not fit ends the layout;
* memory falls and step time grows from no recompute through selective and full recompute of the
  first N layers of each chunk to full recompute of every layer, so the cheapest-memory member
  (full recompute) is estimated first — if it does not fit, nothing of that layout does — and the
  smallest N that fits is found by bisection.

Of the settings that fit at one micro-batch only the fastest is kept (more recompute is never
faster), so every candidate is a distinct (layout, micro-batch). Candidates are ranked by the
step-time model of :mod:`memplan.fit.steptime`.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable

from memplan.errors import ConfigError
from memplan.estimate.engine import DEFAULT_FRAGMENTATION
from memplan.estimate.layout import pipeline_layout
from memplan.fit.context import (
    FULL_RECOMPUTE,
    NO_RECOMPUTE,
    SELECTIVE_RECOMPUTE,
    Priced,
    SearchContext,
    make_context,
)
from memplan.fit.nofit import no_fit_error
from memplan.fit.results import FIT_MARGIN, Candidate, FitError, FitResult, RejectedFamily
from memplan.fit.space import Excluded, Layout, SearchSpace, divisors, enumerate_layouts
from memplan.gpus import GPU
from memplan.job import FrameworkName, Job, PrecisionName, Recompute
from memplan.model.spec import ModelSpec
from memplan.policies import resolve_policy
from memplan.profiles.framework import get_profile
from memplan.profiles.partial_recompute import every_nth_counts
from memplan.units import GiB

#: Called with (layouts searched, layouts in all) as the search goes.
ProgressCallback = Callable[[int, int], None]


def _chunk_layers(ctx: SearchContext, layout: Layout) -> int:
    """Layers of the largest model chunk: block recompute of this many = full recompute."""
    per_stage = [layout.first_stage_layers or 0, layout.last_stage_layers or 0]
    if layout.first_stage_layers is None:
        per_stage = [ctx.model.num_layers // layout.pp]
    else:
        inner = layout.pp - 2
        per_stage.append((ctx.model.num_layers - sum(per_stage)) // inner if inner else 0)
    return max(1, -(-max(per_stage) // layout.vpp))


def _partial_counts(ctx: SearchContext, layout: Layout, full: Job) -> list[int]:
    """Layers per stage a partial recompute may checkpoint, smallest first, as the framework runs it
    (:mod:`memplan.profiles.partial_recompute`)."""
    profile = get_profile(ctx.framework)
    if profile.partial_recompute == "layers":
        return list(range(1, _chunk_layers(ctx, layout)))
    if profile.partial_recompute == "every-nth":
        stages = pipeline_layout(ctx.model.num_layers, full.parallel, 1, profile.pipeline_split)
        return list(every_nth_counts([stage.num_layers for stage in stages]))
    return []


def _best_at(ctx: SearchContext, layout: Layout, mbs: int, plain_first: bool) -> Job | None:
    """The fastest recompute setting that fits at this micro-batch, or None if none fits.

    ``plain_first``: no recompute fitted at the previous micro-batch, so try it before the
    cheapest-memory check (one estimate instead of two when it still fits).
    """
    plain = ctx.job(layout, mbs, NO_RECOMPUTE)
    if plain_first and ctx.fits(plain):
        return plain
    full = ctx.job(layout, mbs, FULL_RECOMPUTE)
    if not ctx.fits(full):
        return None
    if ctx.fits(plain):
        return plain
    counts = _partial_counts(ctx, layout, full)  # the fewest recomputed layers per stage that fits
    best = full
    lo, hi = 0, len(counts) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        job = ctx.job(layout, mbs, Recompute(mode="full", method="block", num_layers=counts[mid]))
        if ctx.fits(job):
            best, hi = job, mid - 1
        else:
            lo = mid + 1
    selective = ctx.job(layout, mbs, SELECTIVE_RECOMPUTE)
    if ctx.seconds(selective) < ctx.seconds(best) and ctx.fits(selective):
        return selective
    return best


def _micro_batches(ctx: SearchContext, layout: Layout) -> list[int]:
    """Micro-batch sizes valid for this layout: divisors of gbs / dp, at most the space's limit."""
    return [m for m in divisors(ctx.gbs // layout.dp) if m <= ctx.space.max_micro_batch]


def _search_layout(
    ctx: SearchContext, layout: Layout, cutoff: float = math.inf
) -> tuple[list[Candidate], Priced | None, bool]:
    """Fitting candidates of one layout (one per micro-batch), the cheapest job's price if none fit,
    and whether micro-batches were skipped because even without recompute they are slower than
    ``cutoff`` (the k-th best step time found so far)."""
    out: list[Candidate] = []
    plain_first = skipped = False
    for mbs in _micro_batches(ctx, layout):
        if ctx.seconds(ctx.job(layout, mbs, NO_RECOMPUTE)) > cutoff:
            skipped, plain_first = True, False
            continue
        job = _best_at(ctx, layout, mbs, plain_first)
        if job is None:
            break
        plain_first = not resolve_policy(job).kind.recomputes
        out.append(ctx.candidate(layout, job))
    if out or skipped:
        return out, None, skipped and not out
    return out, ctx.price(ctx.job(layout, 1, FULL_RECOMPUTE)), False


def _family(layout: Layout) -> str:
    parts = [f"tp{layout.tp}", f"pp{layout.pp}"]
    if layout.cp > 1:
        parts.append(f"cp{layout.cp}")
    if layout.ep > 1:
        parts.append(f"ep{layout.ep}")
    return " ".join(parts)


def _rejections(failed: list[tuple[Layout, Priced]], excluded: tuple[Excluded, ...], limit: int) -> tuple[RejectedFamily, ...]:
    groups: dict[str, list[tuple[Layout, Priced]]] = {}
    for layout, priced in failed:
        groups.setdefault(_family(layout), []).append((layout, priced))
    out = []
    for family, members in groups.items():
        layout, priced = min(members, key=lambda m: m[1].at_least)
        stage = priced.estimate.stages[priced.estimate.peak_stage]
        states = stage.parameters_bytes + stage.gradients_bytes + stage.optimizer_bytes
        what = "model states alone" if states > limit else "even with full recompute and micro-batch 1"
        figure = "" if priced.reserved is not None else " allocated"
        out.append(RejectedFamily(
            family=family, layouts=len(members), min_reserved_bytes=priced.reserved,
            min_allocated_bytes=priced.allocated, states_bytes=states,
            reason=f"{what}: {priced.at_least / GiB:.1f} GiB{figure} > {limit / GiB:.1f} GiB ({layout.label})",
        ))
    counts: dict[tuple[str, str], int] = {}
    for ex in excluded:
        counts[(ex.family, ex.reason)] = counts.get((ex.family, ex.reason), 0) + 1
    out += [RejectedFamily(family=f, layouts=n, reason=r) for (f, r), n in counts.items()]
    return tuple(sorted(out, key=_least))


def _least(family: RejectedFamily) -> tuple[bool, int]:
    """Estimated families first, by the least memory their cheapest member needs (reserved, else allocated)."""
    if family.min_reserved_bytes is not None:
        return False, family.min_reserved_bytes
    return family.min_allocated_bytes is None, family.min_allocated_bytes or 0


def fit(
    model: ModelSpec | str,
    *,
    gpus: int,
    gpu: GPU | str = "h100-80gb",
    seq: int | None = None,
    gbs: int | None = None,
    framework: FrameworkName | None = None,
    precision: PrecisionName | None = None,
    margin: float = FIT_MARGIN,
    fragmentation: float = DEFAULT_FRAGMENTATION,
    space: SearchSpace | None = None,
    top: int | None = None,
    progress: ProgressCallback | None = None,
    base: Job | None = None,
) -> FitResult:
    """The layouts x micro-batches x recompute settings of ``model`` that fit ``gpus`` GPUs, fastest first.

    With ``top=None`` every fitting (layout, micro-batch) is returned. With ``top=k`` the search is
    a branch and bound that returns at least the k fastest exactly: layouts are visited in order of
    their best possible step time (no recompute), and a layout or micro-batch whose best possible
    time is slower than the k-th candidate found so far is not estimated (``layouts_pruned``).

    Example::

        >>> from memplan.fit import fit
        >>> result = fit("llama-3.1-8b", gpus=8, gpu="h100-80gb", seq=4096)
        >>> result.best.reserved_bytes <= result.limit_bytes
        True
        >>> result.best.layout.sharding_label
        'dist-opt'

    A candidate fits when its predicted peak *reserved* memory (the estimator's allocated peak
    with ``fragmentation``) is at most the GPU's usable memory times ``1 - margin``.
    Raises :class:`FitError` (a ConfigError) when an argument is invalid or no layout can use
    ``gpus``; :class:`NoFitError` when none fits: its message says the least memory found and from
    how many GPUs the model would fit, and its ``result`` is the FitResult with the rejected families.
    ``base`` is the job every candidate starts from (optimizer, attention, dtypes, MoE settings...;
    default ``Job()``): the search replaces its layout, sharding, micro-batch and recompute, and
    ``seq``, ``gbs``, ``framework``, ``precision`` default to the base's.

    Known limitations: the step-time model's (see :mod:`memplan.fit.steptime`); the search
    space's placement rules (:class:`SearchSpace`).
    """
    base = base or Job()
    seq = base.batch.seq_length if seq is None else seq
    gbs = base.batch.global_batch_size if gbs is None else gbs
    framework = base.framework if framework is None else framework
    precision = base.precision.name if precision is None else precision
    ctx = make_context(model, gpus, gpu, seq, gbs, framework, precision, margin, fragmentation, space, base)
    start = time.perf_counter()
    layouts, excluded = enumerate_layouts(ctx.model, gpus, seq=seq, framework=framework, space=ctx.space)
    usable = [lay for lay in layouts if ctx.gbs % lay.dp == 0]
    excluded += tuple(Excluded(family=_family(lay), reason=f"--gbs {ctx.gbs} is not a multiple of dp={lay.dp}")
                      for lay in layouts if ctx.gbs % lay.dp)
    if not usable and layouts:
        dps = sorted({lay.dp for lay in layouts})
        raise FitError("--gbs", f"must be a multiple of the data-parallel size of some layout on {gpus} GPUs "
                       f"(dp in {', '.join(map(str, dps))})", ctx.gbs)
    if not usable:
        reasons = "; ".join(sorted({f"{e.family}: {e.reason}" for e in excluded})[:6])
        raise FitError("--gpus", f"no parallel layout of {ctx.model.name} can use {gpus} GPUs ({reasons})", gpus)
    if top is not None and top < 1:
        raise FitError("--top", "must be at least 1", top)
    bounds: dict[Layout, float] = {}
    if top is not None:
        for lay in usable:
            bounds[lay] = min((ctx.seconds(ctx.job(lay, m, NO_RECOMPUTE)) for m in _micro_batches(ctx, lay)), default=math.inf)
        usable.sort(key=bounds.__getitem__)
    candidates: list[Candidate] = []
    failed: list[tuple[Layout, Priced]] = []
    fastest: list[float] = []  # max-heap (negated) of the `top` best step times so far
    pruned = 0
    for index, layout in enumerate(usable):
        cutoff = -fastest[0] if top is not None and len(fastest) >= top else math.inf
        if bounds.get(layout, 0.0) > cutoff:
            pruned = len(usable) - index  # visited in bound order: every later layout is slower
            break
        try:
            found, cheapest, skipped = _search_layout(ctx, layout, cutoff)
        except ConfigError as exc:
            excluded += (Excluded(family=_family(layout), reason=str(exc)),)
            continue
        candidates += found
        pruned += skipped
        for cand in found if top is not None else ():
            heapq.heappush(fastest, -cand.step.total_s)
            if len(fastest) > top:  # type: ignore[operator]
                heapq.heappop(fastest)
        if cheapest is not None:
            failed.append((layout, cheapest))
        if progress is not None:
            progress(index + 1, len(usable))
    if progress is not None:
        progress(len(usable), len(usable))
    candidates.sort(key=lambda c: (c.step.total_s, c.reserved_bytes, c.label))
    result = FitResult(
        model=ctx.model.name, gpu=ctx.gpu.name, gpus=gpus, seq_length=seq, global_batch_size=ctx.gbs,
        framework=framework, margin=margin, limit_bytes=ctx.limit, usable_bytes=ctx.gpu.usable_bytes,
        candidates=tuple(candidates), rejected=_rejections(failed, excluded, ctx.limit),
        layouts_searched=len(usable), estimates=ctx.estimates, seconds=time.perf_counter() - start,
        exhaustive=top is None, layouts_pruned=pruned,
    )
    if not candidates:
        raise no_fit_error(ctx, failed, result)
    return result
