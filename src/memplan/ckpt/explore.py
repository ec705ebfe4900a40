"""Whole-step arms: the planner's plan, or every block under the compute-bound level, chosen by measured steps.

The planner prices options block by block (:mod:`memplan.ckpt.optimes`), but on a CPU what keeping
blocks costs is paid partly outside them: on the benchmark's VM, a 4 x 1,021-token step keeping
every block took 16–20 s of CPU and the same step with every block under per-op checkpointing
(matrix multiplies' and attention's outputs saved) 15.4–15.6 s, while each block on its own ran
faster kept. Fresh memory faulted in by the head, the loss and the optimizer is the likely cause;
a per-block clock cannot see it, a whole-step clock can.

So each planned step runs one of two **arms**: ``plan`` (the planner's choice) or ``compute`` (every
block at the compute-bound level, level 0 — the static per-op policy a user would write — when it
fits the budget by the same phase model). Each step's seconds (process CPU time on CPU, wall time
elsewhere) divided by the roofline seconds of the model's blocks at its size are recorded per arm.
Near a size (within :data:`~memplan.ckpt.optimes.NEAR_OCTAVES`; each arm priced by the median of its
:data:`CLOSEST` measurements nearest the size), the arm measured faster runs; an
arm not measured near the size yet runs once first (``plan`` before ``compute``): the first steps
of each arm at each scale are the exploration, inside every timing. ``compute`` is not explored at
a size below one where it was already measured not faster (its relative price falls with size). When the plan already runs
every block at level 0, or level 0 does not fit, there is nothing to choose.

The ``compute`` arm is the static per-op SAC policy made one of the candidate plans: it runs only
where it was *measured* faster, by more than :data:`PREFER_PLAN` of the plan's seconds — a tie goes
to the plan, which recomputes fewer block forwards. On by default (``auto_checkpoint(...,
step_arms=False)`` turns it off): with freed host memory kept (:mod:`memplan.ckpt.hostmem`), keeping
and per-op SAC cost about the same on the benchmark's CPU, so only a measurement can tell which is
faster at a size (docs/ckpt.md, "Issue 29 follow-up 4").
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from memplan.ckpt.optimes import near
from memplan.ckpt.planner import BlockOption, CheckpointPlan, peak_of_options

if TYPE_CHECKING:
    from memplan.ckpt.controller import CheckpointController

__all__ = ["ARMS", "PREFER_PLAN", "StepArms", "choose_arm", "step_clock"]

ARMS = ("plan", "compute")
_COMPUTE = "sac0"
#: The compute arm runs only where its measured seconds are below the plan's by more than this share.
PREFER_PLAN = 0.03
#: An arm's price at a size is the median of its this many measurements nearest that size.
CLOSEST = 3


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock a step is timed with: process CPU seconds on CPU (robust to a shared machine), else wall."""
    return time.process_time if device.type == "cpu" else time.perf_counter


@dataclass(kw_only=True)
class StepArms:
    """Per arm: (size, step seconds per roofline second) of the real steps it ran."""

    seen: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def observe(self, arm: str, size: int, normalised: float) -> None:
        if normalised > 0:
            self.seen.setdefault(arm, []).append((size, normalised))

    def median(self, arm: str, size: int) -> float | None:
        """Median of the arm's :data:`CLOSEST` measurements nearest ``size`` in log-size (None: none near)."""
        close = sorted((abs(math.log2(s / size)), v) for s, v in self.seen.get(arm, ()) if near(size, s))
        return statistics.median(v for _, v in close[:CLOSEST]) if close else None

    def pick(self, size: int) -> str:
        """The arm to run at ``size``: an arm not measured near it first, else the faster one (ties: the plan)."""
        plan, compute = self.median("plan", size), self.median("compute", size)
        if plan is None:
            return "plan"
        if compute is None:
            return "plan" if self._lost_above(size) else "compute"
        return "compute" if compute < plan * (1.0 - PREFER_PLAN) else "plan"

    def _lost_above(self, size: int) -> bool:
        """Whether the compute arm was measured not faster at a larger size (then it is not explored here).

        Per-op SAC's cost is mostly per op (two dispatch modes), keeping's grows with the bytes kept:
        its relative price only falls as the batch grows, so a loss at a larger size predicts one here.
        """
        for s, _ in self.seen.get("compute", ()):
            plan, compute = self.median("plan", s), self.median("compute", s)
            if s > size and plan is not None and compute is not None and compute >= plan * (1.0 - PREFER_PLAN):
                return True
        return False


def _compute_plan(ctl: CheckpointController, plan: CheckpointPlan, upper: int, static: int,
                  grads: tuple[int, ...]) -> CheckpointPlan | None:
    """Every block at level 0, if every block has it and the step's predicted peak fits (else None)."""
    costs = ctl._block_costs(upper, grads)
    chosen: list[BlockOption] = []
    for cost in costs:
        option = next((o for o in cost.options() if o.mode == _COMPUTE), None)
        if option is None:
            return None
        chosen.append(option)
    step = ctl._step_cost(upper, static, ctl._extrapolation_margin(upper))
    peak = peak_of_options(costs, step, chosen)
    if peak > step.budget_bytes:
        return None
    return replace(plan, checkpoint=(True,) * len(chosen), modes=(_COMPUTE,) * len(chosen),
                   predicted_peak_bytes=peak, recompute_s=sum(o.cost_s for o in chosen), method="knapsack")


def choose_arm(ctl: CheckpointController, plan: CheckpointPlan, size: int, upper: int, static: int,
               grads: tuple[int, ...]) -> tuple[CheckpointPlan, str]:
    """The plan this step runs and its arm ("" when there was nothing to choose)."""
    n = ctl.n_blocks
    if not ctl.step_arms:
        return plan, ""
    if plan.method not in ("knapsack", "none") or not plan.fits or not all(ctl.ops.has(j) for j in range(n)):
        return plan, ""
    if all(plan.mode(j) == _COMPUTE for j in range(n)):
        return plan, ""
    compute = _compute_plan(ctl, plan, upper, static, grads)
    if compute is None:
        return plan, ""
    arm = ctl.arms.pick(size)
    if arm == "compute":
        ctl._count["explored"] += ctl.arms.median("compute", size) is None
        return compute, arm
    return plan, arm
