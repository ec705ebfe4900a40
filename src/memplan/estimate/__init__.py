"""The analytical estimator (pure Python; never imports torch)."""

from memplan.estimate.engine import DEFAULT_FRAGMENTATION, estimate
from memplan.estimate.result import Estimate, StageEstimate

__all__ = ["DEFAULT_FRAGMENTATION", "Estimate", "StageEstimate", "estimate"]
