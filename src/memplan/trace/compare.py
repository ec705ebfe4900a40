"""``--compare-estimate``: the analytical estimator on the same model and job, next to the trace.

The estimator runs on the very :class:`~memplan.job.Job` the trace ran, so both use the same
framework profile (``hf`` unless given: autocast mixed precision, fp32 gradients,
``F.cross_entropy`` on fp32 logits, the profile's optimizer implementation). Each row is one
memory category (:data:`COMPARED`) at its highest over the step in both engines — the trace's
highest live requested bytes (no allocator rounding: the estimator counts elements) against
:meth:`StageEstimate.highest_by_category` (states are steady; activations when the newest forward
ends; logits as the loss saves them for the backward) — and the last row compares the peaks
allocated, less the estimate's cuBLAS / Transformer Engine workspaces (allocated inside the
libraries, which fake tensors never run, so no trace contains them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.categories import MemoryCategory
from memplan.job import Job
from memplan.model.spec import ModelSpec
from memplan.trace.setup import TraceSetup
from memplan.trace.core.summary import TraceSummary

__all__ = ["COMPARED", "Comparison", "ComparisonRow", "compare_with_estimate", "estimate_job"]


@dataclass(frozen=True)
class ComparisonRow:
    """One category: traced bytes, estimated bytes."""

    category: str
    traced_bytes: int
    estimated_bytes: int

    @property
    def difference_bytes(self) -> int:
        """Estimated minus traced (positive: the estimator predicts more)."""
        return self.estimated_bytes - self.traced_bytes

    @property
    def relative(self) -> float | None:
        """Difference relative to the traced bytes (None when nothing was traced)."""
        return self.difference_bytes / self.traced_bytes if self.traced_bytes else None

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "traced_bytes": self.traced_bytes,
                "estimated_bytes": self.estimated_bytes, "difference_bytes": self.difference_bytes,
                "relative": self.relative}


@dataclass(frozen=True)
class Comparison:
    """The trace against the estimator, row by row."""

    rows: tuple[ComparisonRow, ...]
    assumptions: tuple[str, ...]
    #: The framework profile the estimator priced the job with (the trace's ``--framework``).
    framework: str = "hf"

    def row(self, category: str) -> ComparisonRow:
        return next(r for r in self.rows if r.category == category)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [r.to_dict() for r in self.rows], "assumptions": list(self.assumptions)}


def estimate_job(options: TraceSetup) -> Job:
    """The job the estimator sees: the very Job the trace ran (same framework profile, same defaults)."""
    return options.job


#: The categories compared, each at its highest over the step in both engines.
COMPARED = (
    MemoryCategory.PARAMETER,
    MemoryCategory.GRADIENT,
    MemoryCategory.OPTIMIZER_STATE,
    MemoryCategory.MASTER_WEIGHT,
    MemoryCategory.ACTIVATION,
    MemoryCategory.LOGITS,
    MemoryCategory.COMMUNICATION,
)


def compare_with_estimate(model: str | ModelSpec, options: TraceSetup, summary: TraceSummary) -> Comparison:
    """Run ``memplan.estimate`` on the traced job and pair it with ``summary``, category by category.

    Each category is compared at its highest over the step in both engines
    (:meth:`~memplan.estimate.result.StageEstimate.highest_by_category` against the trace's
    ``max_requested_by_category``): activations when the newest forward ends, logits as saved for
    the backward, whatever phase the peak falls in. The peak row compares the peaks themselves.
    """
    from memplan.estimate.engine import estimate
    from memplan.model import load_model

    spec = model if isinstance(model, ModelSpec) else load_model(model)
    job = estimate_job(options)
    result = estimate(spec, job)
    highest = result.stages[0].highest_by_category()
    rows = [ComparisonRow(category.value, summary.max_requested_by_category.get(category.value, 0), highest[category])
            for category in COMPARED]
    # Library workspaces are allocated by the kernels, which a fake-tensor trace never runs.
    workspace = result.stages[0].workspace_bytes if len(result.stages) == 1 else 0
    rows.append(ComparisonRow("peak allocated", summary.peak_allocated_bytes, result.peak_allocated_bytes - workspace))
    return Comparison(tuple(rows), tuple(result.assumptions), job.framework)
