"""The state one ``fit`` search shares between its parts: the request, validated, and an estimate cache.

:mod:`memplan.fit.search` (the search) and :mod:`memplan.fit.nofit` (what to say when nothing
fits) both work on a :class:`SearchContext`; neither imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from memplan.estimate.engine import estimate, reserved_mode, simulated_stage_reserved
from memplan.estimate.result import Estimate
from memplan.fit.hardware import Hardware, hardware_for
from memplan.fit.results import Candidate, FitError, memory_limit
from memplan.fit.space import Layout, SearchSpace
from memplan.fit.steptime import StepTime, step_time
from memplan.gpus import GPU, get_gpu
from memplan.job import Batch, FrameworkName, Job, Parallelism, Precision, PrecisionName, Recompute
from memplan.model.spec import ModelSpec

__all__ = [
    "DEFAULT_TOKENS_PER_STEP",
    "FULL_RECOMPUTE",
    "NO_RECOMPUTE",
    "SELECTIVE_RECOMPUTE",
    "Priced",
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


@dataclass(frozen=True)
class Priced:
    """What the search knows of one job's memory.

    ``estimate`` is the job's estimate with the fixed reserved figure (its allocated figures, per stage and at
    the peak stage, are those of every reserved mode). ``reserved`` is the peak reserved bytes that
    :func:`~memplan.estimate.estimate` gives for the job in its own reserved mode, or None when that is the
    simulator's and the peak allocated alone already exceeds the limit: the job cannot fit whatever the
    allocator does (reserved >= allocated), so its schedule is not simulated."""

    estimate: Estimate
    reserved: int | None
    #: Whether ``reserved`` is (or would be) the allocator simulator's, not ``estimate``'s fixed figure.
    simulated: bool = False

    @property
    def allocated(self) -> int:
        return self.estimate.peak_allocated_bytes

    @property
    def at_least(self) -> int:
        """The peak reserved bytes, or where they were not simulated the allocated bytes (a lower bound)."""
        return self.allocated if self.reserved is None else self.reserved


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
    cache: dict[Job, Priced] = field(default_factory=dict)
    #: Predicted step times of the jobs met so far (the search asks again for some: a candidate's, the
    #: no-recompute bound of its micro-batch).
    times: dict[Job, StepTime] = field(default_factory=dict)

    def job(self, layout: Layout, mbs: int, recompute: Recompute) -> Job:
        return replace(
            self.base, parallel=layout.parallelism(self.world), sharding=layout.sharding,
            batch=Batch(micro_batch_size=mbs, seq_length=self.seq, global_batch_size=self.gbs),
            precision=self._precision, recompute=recompute, framework=self.framework,
        )

    @cached_property
    def _precision(self) -> Precision:
        """The searched jobs' precision: the base's with the requested name (made once per search)."""
        return replace(self.base.precision, name=self.precision)

    def price(self, job: Job) -> Priced:
        """The job's memory, priced once per search. In the simulated reserved mode the fixed estimate comes
        first, and only the peak stage of a job whose peak allocated is within the limit is simulated (the
        same figure :func:`~memplan.estimate.estimate` gives: it reports the reserved of that stage)."""
        priced = self.cache.get(job)  # a job hashes all its settings: once per look-up
        if priced is None:
            self.estimates += 1
            fixed = estimate(self.model, job, fragmentation=self.fragmentation, reserved="fixed")
            reserved: int | None = fixed.peak_reserved_bytes
            simulated = reserved_mode(job) == "simulated"
            if simulated:
                reserved = None if fixed.peak_allocated_bytes > self.limit else simulated_stage_reserved(
                    self.model, job, fixed.peak_stage, self.fragmentation)
            priced = self.cache[job] = Priced(fixed, reserved, simulated)
        return priced

    def fits(self, job: Job) -> bool:
        reserved = self.price(job).reserved
        return reserved is not None and reserved <= self.limit

    def step(self, job: Job) -> StepTime:
        """Predicted step time of ``job`` (no estimate needed)."""
        time = self.times.get(job)
        if time is None:
            time = self.times[job] = step_time(self.model, job, self.hardware, gpus_per_node=self.space.gpus_per_node)
        return time

    def seconds(self, job: Job) -> float:
        """Predicted seconds per step of ``job``."""
        return self.step(job).total_s

    def candidate(self, layout: Layout, job: Job) -> Candidate:
        """A fitting job as a candidate (its figures those :func:`~memplan.estimate.estimate` gives)."""
        priced = self.price(job)
        assert priced.reserved is not None, "only a job that fits is a candidate"
        return Candidate(
            layout=layout, job=job, reserved_bytes=priced.reserved,
            allocated_bytes=priced.allocated, peak_stage=priced.estimate.peak_stage,
            headroom_bytes=self.limit - priced.reserved,
            step=self.step(job),
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
