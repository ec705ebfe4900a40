"""A paired bootstrap interval of one variant's speed over another's, from one step-interleaved run.

In a step-interleaved run (:mod:`memplan.ckpt.bench_interleave`) every variant takes step ``i`` on
the same batch within seconds of the others, so the steps are pairs. The ratio of speeds is the
other variant's total seconds over this one's (memplan's seeding, a one-off cost, added whole);
resampling the step pairs with replacement gives its spread: how far a ratio from a single
repetition may be from the one the same batches would give on a quiet machine. Reported beside
the median verdict, never instead of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from memplan.ckpt.bench_setup import Run

__all__ = ["RESAMPLES", "paired_interval"]

#: Bootstrap resamples (fixed seed: the same runs give the same interval).
RESAMPLES = 2000


def paired_interval(ours: Run, other: Run, *, level: float = 0.95, seed: int = 0) -> dict[str, float] | None:
    """``other``'s seconds over ``ours`` (above 1: ``ours`` faster) with a bootstrap interval over the
    step pairs; None without per-step times for both (runs not interleaved step by step)."""
    a, b = np.asarray(ours.step_s, dtype=float), np.asarray(other.step_s, dtype=float)
    if len(a) == 0 or len(a) != len(b):
        return None
    a_seed, b_seed = ours.seed_s, other.seed_s
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(RESAMPLES, len(a)))
    ratios = (b[idx].sum(axis=1) + b_seed) / (a[idx].sum(axis=1) + a_seed)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return {"ratio": float((b.sum() + b_seed) / (a.sum() + a_seed)), "low": float(low), "high": float(high),
            "level": level, "steps": len(a)}
