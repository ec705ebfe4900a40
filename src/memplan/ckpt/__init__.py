"""Input-aware activation checkpointing under a memory budget (after Mimose).

``auto_checkpoint(model, budget)`` predicts each block's activation memory from the batch's size
and checkpoints, per batch, only the blocks that batch needs to fit the budget; a step that misses
anyway is redone with every block checkpointed. See ``docs/ckpt.md``.
"""

try:
    import numpy  # noqa: F401  (the predictors' least-squares fits)
    import torch  # noqa: F401
except ImportError as _missing:
    from memplan.errors import MissingDependencyError

    raise MissingDependencyError(_missing.name or "torch", feature="memplan ckpt", extra="ckpt") from None

from memplan.ckpt.blocks import find_blocks
from memplan.ckpt.controller import CheckpointController
from memplan.ckpt.errors import BatchTooLargeError, CkptError
from memplan.ckpt.meter import CpuMeter, CudaMeter, MemoryMeter, OutOfBudgetError, make_meter
from memplan.ckpt.planner import BlockCost, CheckpointPlan, StepCost, plan_greedy, plan_knapsack
from memplan.ckpt.predictor import QuadraticFit, fit_quadratic
from memplan.ckpt.stats import CkptStats
from memplan.ckpt.wrapper import auto_checkpoint, controller_of, remove_checkpointing

__all__ = [
    "BatchTooLargeError",
    "BlockCost",
    "CheckpointController",
    "CheckpointPlan",
    "CkptError",
    "CkptStats",
    "CpuMeter",
    "CudaMeter",
    "MemoryMeter",
    "OutOfBudgetError",
    "QuadraticFit",
    "StepCost",
    "auto_checkpoint",
    "controller_of",
    "find_blocks",
    "fit_quadratic",
    "make_meter",
    "plan_greedy",
    "plan_knapsack",
    "remove_checkpointing",
]
