"""The paired bootstrap interval of a step-interleaved benchmark run."""

from __future__ import annotations

import numpy as np
import pytest

from memplan.ckpt.bench_paired import paired_interval
from memplan.ckpt.bench_setup import Run


def _run(variant: str, steps: list[float], seed_s: float = 0.0) -> Run:
    return Run(variant=variant, rep=0, wall_s=sum(steps) + seed_s, warmup_s=0.0, tokens=100, losses=(), peaks=(),
               warmup_peak=0, recomputed_forwards=0, seed_s=seed_s, step_s=tuple(steps))


def test_the_interval_brackets_the_ratio_and_counts_the_seeding() -> None:
    rng = np.random.default_rng(1)
    base = rng.uniform(0.5, 5.0, size=48)
    ours = _run("plain", list(base * 0.97), seed_s=1.0)
    other = _run("sac", list(base * rng.uniform(0.95, 1.05, size=48)))
    iv = paired_interval(ours, other)
    assert iv is not None and iv["steps"] == 48
    assert iv["low"] < iv["ratio"] < iv["high"]
    assert iv["ratio"] == pytest.approx(sum(other.step_s) / (sum(ours.step_s) + 1.0))


def test_identical_pairs_give_a_point_and_unpaired_runs_none() -> None:
    steps = [1.0, 2.0, 3.0]
    iv = paired_interval(_run("plain", steps), _run("sac", steps))
    assert iv is not None and iv["low"] == iv["high"] == iv["ratio"] == 1.0
    assert paired_interval(_run("plain", []), _run("sac", [])) is None
    assert paired_interval(_run("plain", steps), _run("sac", steps[:2])) is None
