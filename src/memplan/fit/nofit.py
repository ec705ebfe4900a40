"""What to tell a user whose model fits no layout: the least memory found and where it would fit."""

from __future__ import annotations

from dataclasses import replace

from memplan.errors import ConfigError
from memplan.estimate.engine import estimate
from memplan.estimate.result import Estimate
from memplan.fit.context import FULL_RECOMPUTE, Priced, SearchContext, default_global_batch
from memplan.fit.results import FitResult, NoFitError
from memplan.fit.space import Layout, enumerate_layouts
from memplan.units import GiB

#: Largest GPU count tried when telling how many GPUs a model that fits nowhere would need.
MAX_SUGGESTED_GPUS = 2**17


def _total_reserved(est: Estimate) -> int:
    """Reserved bytes over every GPU of the job (each stage has world / pp GPUs)."""
    par = est.job.parallel
    return sum(s.peak_reserved_bytes for s in est.stages) * (par.world_size // par.pp)


def _total_at_least(priced: Priced) -> int:
    """Over every GPU of the job, the reserved bytes, or (the simulated mode, whose other stages the search
    does not simulate) the allocated bytes: a lower bound either way."""
    if not priced.simulated:
        return _total_reserved(priced.estimate)
    par = priced.estimate.job.parallel
    return sum(s.peak_allocated_bytes for s in priced.estimate.stages) * (par.world_size // par.pp)


def _smallest_fitting_world(ctx: SearchContext) -> tuple[int, Estimate] | None:
    """The smallest whole-node GPU count above ``ctx.world`` at which some layout fits."""
    gpn = ctx.space.gpus_per_node
    world = ctx.world * 2 if ctx.world >= gpn else gpn
    while world <= MAX_SUGGESTED_GPUS:
        sub = replace(ctx, world=world, gbs=default_global_batch(world, ctx.seq), estimates=0, cache={}, times={})
        layouts, _ = enumerate_layouts(ctx.model, world, seq=ctx.seq, framework=ctx.framework, space=ctx.space)
        # Most model-parallel layouts first: they hold the least per GPU.
        for layout in sorted(layouts, key=lambda lay: -(lay.tp * lay.pp * lay.ep * lay.cp)):
            job = sub.job(layout, 1, FULL_RECOMPUTE)
            try:
                fits = sub.fits(job)
            except ConfigError:
                continue
            if fits:
                return world, estimate(ctx.model, job, fragmentation=ctx.fragmentation)
        world *= 2
    return None


def no_fit_error(
    ctx: SearchContext, failed: list[tuple[Layout, Priced]], result: FitResult
) -> NoFitError:
    """The error for a model that fits no layout: least memory found, where it would fit, and ``result``.

    Under the simulated reserved mode a job whose allocated alone exceeds the limit is not simulated, so its
    figure is the allocated one, said as such (reserved is at least that)."""
    layout, priced = min(failed, key=lambda m: m[1].at_least)
    total = min(_total_at_least(p) for _, p in failed)
    figure = "reserved" if priced.reserved is not None else "allocated (reserved is at least that)"
    text = (
        f"fits no layout on {ctx.world} x {ctx.gpu.name}: the smallest per-GPU peak is "
        f"{priced.at_least / GiB:.1f} GiB {figure} ({layout.label}, full recompute, micro-batch 1) "
        f"against {ctx.limit / GiB:.1f} GiB allowed ({ctx.gpu.usable_bytes / GiB:.1f} GiB usable minus "
        f"{100 * (1 - ctx.limit / ctx.gpu.usable_bytes):.0f}% margin); "
        f"it needs at least {total / GiB:,.0f} GiB{' allocated' if priced.simulated else ''} over all GPUs"
    )
    found = _smallest_fitting_world(ctx)
    if found is not None:
        world, fit_est = found
        hint = (f"it fits on {world} x {ctx.gpu.name} ({fit_est.peak_reserved_bytes / GiB:.1f} GiB per GPU with "
                f"tp{fit_est.job.parallel.tp} pp{fit_est.job.parallel.pp} ep{fit_est.job.parallel.ep}, full recompute, "
                f"{_total_reserved(fit_est) / GiB:,.0f} GiB in total): try --gpus {world}")
    else:
        hint = (f"no GPU count up to {MAX_SUGGESTED_GPUS:,} fits with the layouts of the '{ctx.framework}' "
                "profile; try another --framework (megatron has TP/PP/EP), a shorter --seq or a larger GPU")
    return NoFitError(f"{ctx.model.name} {text}", result=result, hint=hint)
