"""``--compare-estimate``: the analytical estimator on the same model and job, next to the trace.

The estimator runs with the ``hf`` framework profile (autocast mixed precision, fp32 gradients,
``F.cross_entropy`` on fp32 logits), which is what a Hugging Face model trained by the HF Trainer
or a plain PyTorch loop does. Each row pairs a trace category with an estimator field:

* parameters, gradients, optimizer states: the trace's highest live requested bytes of that
  category (they are steady; the estimator counts elements, not allocator rounding), against ``parameters_bytes``, ``gradients_bytes``, ``optimizer_bytes``;
* activations: the trace's highest live activation bytes (reached when the backward starts),
  against ``forward_activations_bytes`` (everything saved for backward when the forward ends);
* logits: highest live bytes (what the forward leaves saved for the backward, in the loss and the
  output head) against ``saved_logits_bytes`` (the same at the start of the backward);
* communication: highest live bytes against ``communication_bytes``;
* peak: the trace's peak allocated against ``peak_allocated_bytes`` less ``workspace_bytes``
  (cuBLAS / Transformer Engine workspaces are allocated inside the libraries, which fake tensors
  never run, so no trace contains them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.trace.options import TraceOptions
from memplan.trace.summary import TraceSummary

__all__ = ["Comparison", "ComparisonRow", "compare_with_estimate", "estimate_job"]


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

    def row(self, category: str) -> ComparisonRow:
        return next(r for r in self.rows if r.category == category)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [r.to_dict() for r in self.rows], "assumptions": list(self.assumptions)}


def estimate_job(options: TraceOptions) -> Any:
    """The :class:`memplan.job.Job` the estimator sees for ``options`` (hf profile)."""
    from memplan.job import Batch, Job, Optimizer, Parallelism, Precision, Recompute, Sharding

    return Job(
        parallel=Parallelism(world_size=options.world_size, tp=options.tp),
        sharding=Sharding(fsdp="full" if options.fsdp > 1 else "none"),
        batch=Batch(micro_batch_size=options.mbs, seq_length=options.seq),
        precision=Precision(name=options.precision),
        optimizer=Optimizer(name=options.optimizer, momentum=options.momentum,
                            implementation=options.resolved_optimizer_impl),  # type: ignore[arg-type]
        recompute=Recompute(mode=options.recompute),
        attention=options.attention, dropout=options.dropout, framework="hf",
    )


_PAIRS = (
    ("parameter", "parameters_bytes"),
    ("gradient", "gradients_bytes"),
    ("optimizer_state", "optimizer_bytes"),
    ("activation", "activations_bytes"),
    ("logits", "logits_bytes"),
    ("communication", "communication_bytes"),
)


#: Categories read at the loss rather than at the estimator's peak.
_AT_LOSS = {"activation": "forward_activations_bytes", "logits": "saved_logits_bytes"}


def compare_with_estimate(model: str, options: TraceOptions, summary: TraceSummary) -> Comparison:
    """Run ``memplan.estimate`` for ``model`` and ``options`` and pair it with ``summary``.

    Activations and logits are compared with what the estimator keeps for the backward when the
    forward ends, whatever phase its peak falls in.
    """
    from memplan.estimate.engine import estimate
    from memplan.model import load_model

    spec, job = load_model(model), estimate_job(options)
    result = estimate(spec, job)
    stage = result.stages[0]
    rows = [ComparisonRow(category, summary.max_requested_by_category.get(category, 0),
                          int(getattr(stage, _AT_LOSS.get(category, field))))
            for category, field in _PAIRS]
    # Library workspaces are allocated by the kernels, which a fake-tensor trace never runs.
    workspace = result.stages[0].workspace_bytes if len(result.stages) == 1 else 0
    rows.append(ComparisonRow("peak allocated", summary.peak_allocated_bytes, result.peak_allocated_bytes - workspace))
    return Comparison(tuple(rows), tuple(result.assumptions))
