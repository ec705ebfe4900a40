"""The state one ``fit`` search shares between its parts: the request, validated, and an estimate cache.

:mod:`memplan.fit.search` (the search) and :mod:`memplan.fit.nofit` (what to say when nothing
fits) both work on a :class:`SearchContext`; neither imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from memplan.estimate.engine import estimate
from memplan.estimate.result import Estimate
from memplan.fit.hardware import Hardware, hardware_for
from memplan.fit.results import Candidate, FitError, memory_limit
from memplan.fit.space import Layout, SearchSpace
from memplan.fit.steptime import step_time
from memplan.gpus import GPU, get_gpu
from memplan.job import Batch, FrameworkName, Job, Parallelism, Precision, PrecisionName, Recompute
from memplan.model.spec import ModelSpec

__all__ = [
    "DEFAULT_TOKENS_PER_STEP",
    "FULL_RECOMPUTE",
    "NO_RECOMPUTE",
    "SELECTIVE_RECOMPUTE",
    "SearchContext",
    "default_global_batch",
    "make_context",
]

#: Tokens per optimizer step when ``gbs`` is not given (4 Mi tokens, the order of magnitude of
#: LLM pre-training batches); rounded up to a multiple of the GPU count.
DEFAULT_TOKENS_PER_STEP = 2**22


def default_global_batch(gpus: int, seq: int) -> int:
    """``ceil(4 Mi tokens / seq)`` sequences, at least one per GPU, rounded up to a multiple of ``gpus``."""
    seqs = max(gpus, -(-DEFAULT_TOKENS_PER_STEP // seq))
    return -(-seqs // gpus) * gpus


@dataclass
class SearchContext:
    """Everything a layout's search needs; counts estimates."""

    model: ModelSpec
    world: int
    gpu: GPU
    hardware: Hardware
    seq: int
    gbs: int
    framework: FrameworkName
    precision: PrecisionName
    limit: int
    fragmentation: float
    space: SearchSpace
    #: What every searched job keeps (optimizer, attention, dtypes, MoE routing...): the search
    #: replaces only its layout, sharding, micro-batch and recompute.
    base: Job = field(default_factory=Job)
    estimates: int = 0
    cache: dict[Job, Estimate] = field(default_factory=dict)

    def job(self, layout: Layout, mbs: int, recompute: Recompute) -> Job:
        return replace(
            self.base, parallel=layout.parallelism(self.world), sharding=layout.sharding,
            batch=Batch(micro_batch_size=mbs, seq_length=self.seq, global_batch_size=self.gbs),
            precision=replace(self.base.precision, name=self.precision), recompute=recompute,
            framework=self.framework,
        )

    def estimate(self, job: Job) -> Estimate:
        if job not in self.cache:
            self.estimates += 1
            self.cache[job] = estimate(self.model, job, fragmentation=self.fragmentation)
        return self.cache[job]

    def fits(self, job: Job) -> bool:
        return self.estimate(job).peak_reserved_bytes <= self.limit

    def seconds(self, job: Job) -> float:
        """Predicted step time of ``job`` (no estimate needed)."""
        return step_time(self.model, job, self.hardware, gpus_per_node=self.space.gpus_per_node).total_s

    def candidate(self, layout: Layout, job: Job) -> Candidate:
        est = self.estimate(job)
        return Candidate(
            layout=layout, job=job, reserved_bytes=est.peak_reserved_bytes,
            allocated_bytes=est.peak_allocated_bytes, peak_stage=est.peak_stage,
            headroom_bytes=self.limit - est.peak_reserved_bytes,
            step=step_time(self.model, job, self.hardware, gpus_per_node=self.space.gpus_per_node),
        )


#: The recompute settings the search tries at every micro-batch (block recompute is built per layout).
FULL_RECOMPUTE = Recompute(mode="full")
NO_RECOMPUTE = Recompute()
SELECTIVE_RECOMPUTE = Recompute(mode="selective")



def make_context(
    model: ModelSpec | str, gpus: int, gpu: GPU | str, seq: int, gbs: int | None, framework: FrameworkName,
    precision: PrecisionName, margin: float, fragmentation: float, space: SearchSpace | None,
    base: Job | None = None,
) -> SearchContext:
    """The search context of one ``fit`` call, with every argument validated (a FitError names the flag)."""
    if isinstance(model, str):
        from memplan.model import load_model

        model = load_model(model)
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    Parallelism(world_size=gpus)  # validates --gpus
    Batch(seq_length=seq, global_batch_size=gbs)  # validates --seq / --gbs
    Job(framework=framework, precision=Precision(name=precision))  # validates the words
    if not 0.0 <= margin < 1.0:
        raise FitError("--margin", "must be in [0, 1)", margin)
    space = space or SearchSpace()
    if space.gpus_per_node < 1:
        raise FitError("--gpus-per-node", "must be at least 1", space.gpus_per_node)
    try:
        hw = hardware_for(gpu_spec.name)
    except KeyError:
        raise FitError("--gpu", "has no step-time data (see memplan.fit.steptime.HARDWARE)", gpu_spec.name) from None
    return SearchContext(
        model=model, world=gpus, gpu=gpu_spec, hardware=hw, seq=seq,
        gbs=gbs if gbs is not None else default_global_batch(gpus, seq), framework=framework,
        precision=precision, limit=memory_limit(gpu_spec.usable_bytes, margin),
        fragmentation=fragmentation, space=space, base=base or Job(),
    )
