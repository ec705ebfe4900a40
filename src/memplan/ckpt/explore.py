"""Measuring per-op SAC's price per block from whole steps, where the price can change a plan.

The planner prices each block's options — keep, per-op SAC (``sac0``: matrix multiplies' and
attention's outputs saved, the rest recomputed) and whole-block recompute (``full``) — and picks one
per block under the budget, least predicted seconds first (:mod:`memplan.ckpt.planner`). On a CPU
part of what keeping costs is paid outside the blocks (fresh memory faulted in by the head, the
loss and the optimizer), so a per-block clock misprices SAC against keeping; a whole-step clock
does not. Every planned step is therefore timed whole (process CPU seconds on CPU, wall time
elsewhere) and recorded with the share of the blocks it ran under SAC
(:class:`~memplan.ckpt.optimes.StepPrices`); where steps with and without SAC blocks were measured
near a size, SAC's price per block there is their difference per block (floored at zero), and it
replaces the per-block clock's price of ``sac0``.

**Exploration.** A price matters only where the budget makes the plan shed memory: with SAC never
priced below keeping, a plan that keeps every block is the best whatever SAC costs. So a planned
step whose plan sheds a block (SAC or whole recompute) at a size where no step with SAC blocks was
measured (within an octave) runs once with *every* block under SAC instead — when the phase model
says that fits the budget, margin included — and that step is the measurement (counted in
``stats().explored_steps``, inside every timing). A plan whose shed blocks all run under SAC
measures the price itself (only steps whose blocks were all kept or under SAC are samples: a whole
recompute or an offload has no term in the linear model). After that the planner's mixed plan runs: SAC only on the blocks that
must shed memory and where it is priced below a whole recompute.

``auto_checkpoint(..., step_arms=False)`` turns both off: no whole-step timing, no exploration;
SAC is then priced by the per-block clock (:mod:`memplan.ckpt.optimes`) or the roofline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from memplan.ckpt.planner import BlockOption, CheckpointPlan, peak_of_options

if TYPE_CHECKING:
    from memplan.ckpt.controller import CheckpointController

__all__ = ["SAC_MODE", "explore_sac", "sac_share", "step_clock"]

#: The per-op SAC option whose price whole steps measure (level 0: the compute-bound level).
SAC_MODE = "sac0"
#: The block modes of a step that is a whole-step sample (the linear model has a term for no other).
_SAMPLE_MODES = frozenset(("keep", SAC_MODE))


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock a step is timed with: process CPU seconds on CPU (robust to a shared machine), else wall."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def sac_share(modes: tuple[str, ...], roof: tuple[float, ...]) -> float | None:
    """Roofline share of the blocks under ``sac0`` (None: a block ran otherwise than kept or ``sac0``, so
    the step's seconds hold a price the linear model has no term for: not a sample)."""
    if not _SAMPLE_MODES.issuperset(modes):
        return None
    total = sum(roof) or 1.0
    return sum(r for m, r in zip(modes, roof) if m == SAC_MODE) / total


def _all_sac_plan(ctl: CheckpointController, plan: CheckpointPlan, upper: int, static: int,
                  grads: tuple[int, ...]) -> CheckpointPlan | None:
    """Every block under ``sac0``, if every block has it and the step's predicted peak fits (else None)."""
    costs = ctl._block_costs(upper, grads)
    chosen: list[BlockOption] = []
    for cost in costs:
        option = next((o for o in cost.options() if o.mode == SAC_MODE), None)
        if option is None:
            return None
        chosen.append(option)
    step = ctl._step_cost(upper, static, ctl._extrapolation_margin(upper))
    peak = peak_of_options(costs, step, chosen)
    if peak > step.budget_bytes:
        return None
    return replace(plan, checkpoint=(True,) * len(chosen), modes=(SAC_MODE,) * len(chosen),
                   predicted_peak_bytes=peak, recompute_s=sum(o.cost_s for o in chosen), method="knapsack")


def explore_sac(ctl: CheckpointController, plan: CheckpointPlan, size: int, upper: int, static: int,
                grads: tuple[int, ...]) -> tuple[CheckpointPlan, bool]:
    """The plan this step runs, and whether the step is timed whole (a :class:`StepPrices` sample)."""
    n = ctl.n_blocks
    if not ctl.step_arms:
        return plan, False
    if plan.method not in ("knapsack", "none") or not plan.fits or not all(ctl.ops.has(j) for j in range(n)):
        return plan, False
    modes = [plan.mode(j) for j in range(n)]
    if _SAMPLE_MODES.issuperset(modes) or ctl.ops.steps.measured(size):  # nothing to price, or it prices itself
        return plan, True
    explore = _all_sac_plan(ctl, plan, upper, static, grads)
    if explore is None:
        return plan, True
    ctl._count["explored"] += 1
    return explore, True
