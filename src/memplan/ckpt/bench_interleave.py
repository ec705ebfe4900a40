"""The benchmark interleaved step by step: every timed variant takes its step i before any takes step i+1.

On a machine shared with other processes, the load changes from minute to minute: runs made one
after another (even in a rotated order) see different loads. Here every variant has its own model,
optimizer and judge in one process, and the variants take turns step by step (the order rotated
every step), so each step of each variant runs within seconds of the same step of the others; a
variant's time is the sum of its own steps (memplan's seeding included, run before its first step).

Which static policies are timed is decided first, by memory only: each of ``full``, ``half`` and
``sac`` takes one training step on the longest batch under the judge; a policy whose peak exceeds
the budget (2 % slack) cannot be used for this run and is reported as not fitting, not timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memplan.ckpt.bench_meter import StepMeter
from memplan.ckpt.bench_setup import (
    MEMPLAN,
    BenchConfig,
    LiveRecord,
    RecomputeCounter,
    Run,
    longest_step_peak,
    plan_letters,
    prepare_variant,
    seed_memplan,
)

__all__ = ["fitting_statics", "lane_run", "make_lane", "run_interleaved", "seed_lane", "timed_step"]


def fitting_statics(cfg: BenchConfig, init: dict[str, torch.Tensor], longest: torch.Tensor, budget: int,
                    candidates: Sequence[str]) -> dict[str, int]:
    """Peak of one step on the longest batch (AdamW moments allocated) for each static candidate."""
    return {variant: longest_step_peak(variant, cfg, init, longest, budget) for variant in candidates}


@dataclass
class _Lane:
    """One variant's model, optimizer, judge and what it accumulated."""

    variant: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    judge: StepMeter
    counter: RecomputeCounter
    live: LiveRecord = field(default_factory=LiveRecord)
    seconds: float = 0.0
    cpu: float = 0.0
    steps: list[float] = field(default_factory=list)


def make_lane(variant: str, cfg: BenchConfig, init: dict[str, torch.Tensor], budget: int) -> _Lane:
    """A variant's model (prepared), AdamW and judge."""
    model = prepare_variant(variant, cfg, init, budget)
    return _Lane(variant=variant, model=model, opt=torch.optim.AdamW(model.parameters(), lr=cfg.lr),
                 judge=StepMeter(), counter=RecomputeCounter(model))


def _timed(lane: _Lane, fn: Callable[[], Any]) -> float:
    t0, c0 = time.perf_counter(), time.process_time()
    with lane.judge:
        fn()
    wall = time.perf_counter() - t0
    lane.seconds += wall
    lane.cpu += time.process_time() - c0
    return wall


def seed_lane(lane: _Lane, cfg: BenchConfig) -> None:
    """memplan's seeding (timed, judged, counted in the lane's seconds); nothing for a static variant."""
    if lane.variant in MEMPLAN:
        def seed() -> None:
            lane.judge.start(lane.model, None)
            seed_memplan(lane.model, cfg, lane.judge, lane.live)
        _timed(lane, seed)


def timed_step(lane: _Lane, batch: torch.Tensor) -> float:
    """One training step of the lane (forward, backward, AdamW), timed and judged; its wall seconds."""
    wall = _timed(lane, lambda: _train_step(lane, batch))
    lane.steps.append(wall)
    return wall


def _train_step(lane: _Lane, batch: torch.Tensor) -> None:
    lane.judge.start(lane.model, lane.opt)
    lane.judge.peak = lane.judge.live_bytes
    loss = lane.model(input_ids=batch, labels=batch).loss
    loss.backward()
    lane.opt.step()
    lane.opt.zero_grad(set_to_none=True)
    lane.live.losses.append(float(loss.detach()))
    lane.live.peaks.append(lane.judge.peak)
    ctl = getattr(lane.model, "memplan_ckpt", None)
    if ctl is not None and ctl.last is not None:
        lane.live.plans.append(plan_letters([ctl.last[1].mode(j) for j in range(ctl.n_blocks)]))


def run_interleaved(cfg: BenchConfig, variants: Sequence[str], init: dict[str, torch.Tensor],
                    batches: Sequence[torch.Tensor], budget: int,
                    say: Callable[[str], None] = lambda _m: None) -> tuple[Run, ...]:
    """Every variant in ``variants`` (plain loops: static policies and ``plain``), step by step, one process."""
    lanes = [make_lane(v, cfg, init, budget) for v in variants]
    for lane in lanes:
        seed_lane(lane, cfg)
    for i, batch in enumerate(batches):
        order = lanes[i % len(lanes):] + lanes[:i % len(lanes)]
        for lane in order:
            timed_step(lane, batch)
        if (i + 1) % 6 == 0:
            say(f"step {i + 1}/{len(batches)}: " + ", ".join(f"{ln.variant} {ln.seconds:.0f} s" for ln in lanes))
    return tuple(lane_run(lane, batches) for lane in lanes)


def lane_run(lane: _Lane, batches: Sequence[torch.Tensor], step_faults: Sequence[int] = (),
             host_memory: str = "") -> Run:
    """The record of a lane that has taken every step."""
    ctl = getattr(lane.model, "memplan_ckpt", None)
    stats = ctl.stats() if ctl is not None else None
    if ctl is not None:
        ctl.release_meter()
    return Run(
        variant=lane.variant, rep=0, wall_s=lane.seconds, warmup_s=lane.live.warmup_s,
        tokens=sum(b.numel() for b in batches), losses=tuple(lane.live.losses), peaks=tuple(lane.live.peaks),
        warmup_peak=lane.live.warmup_peak, recomputed_forwards=lane.counter.backward,
        probe_forwards=stats.probe_forwards if stats else 0, sheltered_steps=stats.sheltered_steps if stats else 0,
        misses=stats.misses if stats else 0, optimizer_states=stats.optimizer_states if stats else "",
        cpu_s=lane.cpu, seed_s=lane.live.seed_s, seed_cpu_s=lane.live.seed_cpu_s,
        selective_forwards=stats.selective_forwards if stats else 0,
        explored_steps=stats.explored_steps if stats else 0, metered_steps=stats.metered_steps if stats else 0,
        step_s=tuple(lane.steps), step_faults=tuple(step_faults), host_memory=stats.host_memory if stats else host_memory,
        step_plans=tuple(lane.live.plans),
    )
