"""Typed, frozen results of ``memplan fit``: candidates, rejected families, limits, colocation."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memplan.errors import ConfigError, MemplanError
from memplan.fit.space import Layout
from memplan.fit.steptime import StepTime
from memplan.job import Job
from memplan.policies import resolve_policy

#: Default share of the GPU's usable memory the search keeps free (``--margin``). The estimator
#: is within 5% of Megatron's measured peaks on 36 of 44 reference runs and mostly below them
#: (docs/accuracy.md); load imbalance and allocator spikes come on top of the assumed 10%
#: fragmentation. A layout predicted to use more than 95% of the GPU is too risky to recommend.
FIT_MARGIN = 0.05


def memory_limit(usable_bytes: int, margin: float = FIT_MARGIN) -> int:
    """Bytes a process may reserve on a GPU with ``usable_bytes``, keeping ``margin`` of it free."""
    return int(usable_bytes * (1.0 - margin))


def fits_memory(reserved_bytes: int, usable_bytes: int, margin: float = FIT_MARGIN) -> bool:
    """The fit filter of ``memplan fit``: predicted reserved memory within the margin."""
    return reserved_bytes <= memory_limit(usable_bytes, margin)


class FitError(ConfigError):
    """The request is invalid or leaves nothing to search, e.g. no layout can use the GPUs (CLI exit code 2).

    A valid request that no layout fits is not bad input: that is :class:`NoFitError`.
    """


def recompute_label(job: Job) -> str:
    rc = job.recompute
    if resolve_policy(job).kind.checkpoints_layers and rc.method == "block" and rc.num_layers is not None:
        return f"full x{rc.num_layers}/chunk"
    return rc.mode


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A job that fits: its layout, micro-batch, recompute, memory and predicted speed."""

    layout: Layout
    job: Job
    #: Predicted peak reserved bytes of the highest pipeline stage (what is compared to the GPU).
    reserved_bytes: int
    allocated_bytes: int
    peak_stage: int
    #: Limit minus reserved (bytes left under the margin).
    headroom_bytes: int
    step: StepTime

    @property
    def label(self) -> str:
        return f"{self.layout.label} mbs{self.job.batch.micro_batch_size} rc-{recompute_label(self.job)}"

    def to_dict(self) -> dict[str, Any]:
        par = self.job.parallel
        return {
            "label": self.label,
            "tp": par.tp, "pp": par.pp, "vpp": par.vpp, "cp": par.cp, "ep": par.ep,
            "etp": par.expert_tp, "dp": par.data_parallel,
            "first_stage_layers": par.first_stage_layers, "last_stage_layers": par.last_stage_layers,
            "sharding": self.layout.sharding_label,
            "micro_batch_size": self.job.batch.micro_batch_size,
            "global_batch_size": self.job.batch.global_batch_size,
            "recompute": recompute_label(self.job),
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "peak_stage": self.peak_stage,
            "headroom_bytes": self.headroom_bytes,
            "step_time_s": self.step.total_s,
            "tokens_per_s": self.step.tokens_per_s,
            "mfu": self.step.mfu,
            "step": self.step.to_dict(),
            "job": asdict(self.job),
        }


@dataclass(frozen=True, kw_only=True)
class RejectedFamily:
    """Layouts sharing TP/PP/CP/EP that were left out, with the reason."""

    family: str
    #: Layouts of the family that were left out.
    layouts: int
    reason: str
    #: Predicted peak reserved bytes of the member needing the least (micro-batch 1, full recompute), if
    #: estimated; None also when the reserved figure is the allocator simulator's and that member's peak
    #: allocated alone exceeds the limit (its schedule is not simulated: reserved is at least the allocated).
    min_reserved_bytes: int | None = None
    #: That member's peak allocated bytes, if estimated.
    min_allocated_bytes: int | None = None
    #: Model states (weights, gradients, optimizer) of that member's peak stage.
    states_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class FitResult:
    """What ``fit`` found: every fitting candidate, fastest first, and what was rejected."""

    model: str
    gpu: str
    gpus: int
    seq_length: int
    global_batch_size: int
    framework: str
    margin: float
    #: Bytes a GPU may reserve: usable x (1 - margin).
    limit_bytes: int
    usable_bytes: int
    candidates: tuple[Candidate, ...]
    rejected: tuple[RejectedFamily, ...]
    layouts_searched: int
    estimates: int
    seconds: float
    #: True: every fitting (layout, micro-batch) is listed; False: a top-k search that proved its
    #: k fastest and skipped layouts that could not beat them.
    exhaustive: bool = True
    #: Layouts (or all their micro-batches) skipped by the top-k bound.
    layouts_pruned: int = 0

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def to_dict(self, *, top: int | None = None) -> dict[str, Any]:
        shown = self.candidates if top is None else self.candidates[:top]
        return {
            "model": self.model, "gpu": self.gpu, "gpus": self.gpus, "seq_length": self.seq_length,
            "global_batch_size": self.global_batch_size, "framework": self.framework,
            "margin": self.margin, "limit_bytes": self.limit_bytes, "usable_bytes": self.usable_bytes,
            "fitting": len(self.candidates), "layouts_searched": self.layouts_searched,
            "estimates": self.estimates, "seconds": self.seconds,
            "exhaustive": self.exhaustive, "layouts_pruned": self.layouts_pruned,
            "candidates": [c.to_dict() for c in shown],
            "rejected": [r.to_dict() for r in self.rejected],
        }


class NoFitError(MemplanError):
    """A valid request that no layout fits (CLI exit code 1): "nothing fits" is a result, not bad input.

    The message says the least memory found and from how many GPUs the model would fit; ``hint``
    is that suggestion alone. ``result`` is the search's :class:`FitResult`, without candidates, whose
    ``rejected`` families say why each was left out (``memplan fit --json`` prints it).
    """

    def __init__(self, message: str, *, result: FitResult, hint: str = "") -> None:
        self.result = result
        self.hint = hint
        super().__init__(f"{message}; {hint}" if hint else message)
