"""The estimator: per-GPU memory of every pipeline stage of a training job. Pure Python, no torch.

:func:`estimate` builds the job's context once (:mod:`memplan.estimate.context`), then for every
pipeline stage runs the mechanics, enters their contributions in the stage's ledger and takes its
peak (:mod:`memplan.estimate.stage`); the highest stage is the job's peak. The assumptions are the
job's setting (:mod:`memplan.estimate.run_notes`) and the sentences of the contributions themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from memplan.errors import JobConfigError
from memplan.estimate.context import RunContext, rank_routed_factor, run_context, stage_context
from memplan.estimate.layer_costs import layer_costs
from memplan.estimate.layout import pipeline_layout
from memplan.estimate.memo import Same
from memplan.estimate.result import Estimate, StageEstimate
from memplan.estimate.compiled import compile_settings
from memplan.estimate.run_notes import run_notes
from memplan.estimate.stage import StageParts, simulate_stage, stage_parts
from memplan.gpus import GPU
from memplan.job import Job
from memplan.jobcheck import validate_job_for_model
from memplan.profiles import get_profile
from memplan.profiles.defaults import default_settings
from memplan.profiles.framework import FrameworkProfile
from memplan.profiles.unwrapped_fsdp import unwrapped
from memplan.profiles.zero_engine import engine_profile, zero_engine
from memplan.model.spec import ModelSpec
from memplan.peft.params import FinetuneParams
from memplan.settings import InputSetting

__all__ = ["DEFAULT_FRAGMENTATION", "Estimate", "estimate", "layer_activation_costs", "rank_routed_factor",
           "simulated_stage_reserved"]

#: The CUDA caching allocator hands out whole segments (2 MiB granularity, allocator source
#: c10/cuda/CUDACachingAllocator.cpp kLargeBuffer/kRoundLarge) and freed blocks cannot always be
#: reused for differently sized requests. Without a trace, memplan assumes this fraction of the
#: reserved memory is lost: the middle of the 5-30% reported for LLM training (DeepSeek-V3
#: memory analysis; STAlloc). ``memplan alloc`` replaces it by a simulated figure.
DEFAULT_FRAGMENTATION = 0.10

#: How the reserved figure is made: ``fixed`` (the stated fragmentation over the peak allocated) or
#: ``simulated`` (the allocator simulator on the estimate's schedule, :mod:`memplan.estimate.reserved_sim`).
RESERVED_MODES = ("fixed", "simulated")


def estimate(
    model: ModelSpec,
    job: Job | None = None,
    *,
    gpu: GPU | None = None,
    fragmentation: float = DEFAULT_FRAGMENTATION,
    settings: Iterable[InputSetting] = (),
    reserved: str | None = None,
) -> Estimate:
    """Estimate the per-GPU memory of training ``model`` as ``job`` describes.

    Example::

        >>> from memplan import estimate, load_model, Job, Parallelism
        >>> est = estimate(load_model("llama-3.1-8b"), Job(parallel=Parallelism(world_size=8)))
        >>> est.peak_allocated_bytes > 0
        True

    ``settings``: what the input files the job was read from said (:class:`~memplan.settings.InputSetting`);
    the result carries them, and ``Estimate.unmodelled_settings`` lists those memplan does not model.

    Assumptions are listed in ``Estimate.assumptions``. Known limitations: the activation terms
    follow fused kernels (Megatron/TE) or PyTorch reference modules (``kernels="eager"``
    profiles); other custom kernels save different tensors. The reserved memory is the peak allocated
    over ``1 - fragmentation`` (``fixed``) or the caching-allocator simulator's peak over the estimate's
    allocation schedule (``simulated``); ``reserved`` overrides the job's ``--reserved`` (``auto``: the
    framework profile's ``default_reserved``).
    """
    job, runs_on, moved = _on_engine(job or Job())
    if not 0.0 <= fragmentation < 1.0:
        raise JobConfigError("--fragmentation", "must be in [0, 1)", fragmentation)
    reserved = reserved_mode(job, reserved)
    stages, notes, peak, counts, framework, compiled = _stages(
        Same(model), job, fragmentation, reserved == "simulated", runs_on)
    return Estimate(
        model=model.name,
        framework=framework,
        stages=stages,
        peak_allocated_bytes=peak.peak_allocated_bytes,
        peak_reserved_bytes=peak.peak_reserved_bytes,
        peak_stage=peak.stage,
        fragmentation=fragmentation if reserved == "fixed" else _simulated_share(peak),
        assumptions=notes if moved is None else (moved, *notes),
        total_parameters=model.total_parameters,
        trainable_params=counts.trainable if counts is not None else model.total_parameters,
        frozen_params=counts.frozen if counts is not None else 0,
        job=job,
        gpu=gpu,
        settings=default_settings(get_profile(framework).unmodelled_defaults, job, tuple(settings)) + compiled,
    )


def _on_engine(job: Job) -> tuple[Job, FrameworkProfile | None, str | None]:
    """(``job`` as its framework runs it, the profile of the engine that runs its ZeRO stage, the sentence saying
    so); ``job``, None, None where it runs as given (:mod:`memplan.profiles.unwrapped_fsdp`: ``--fsdp`` over one
    rank where the framework does not wrap there; :mod:`memplan.profiles.zero_engine`)."""
    if job.sharding.fsdp != "none":  # --fsdp over one rank where the framework does not wrap there
        runs, moved = unwrapped(job)
        if moved is not None:
            return runs, None, moved
    runs, moved = zero_engine(job)
    return runs, (engine_profile(job.framework) if moved else None), moved


def reserved_mode(job: Job, reserved: str | None = None) -> str:
    """How ``job``'s reserved memory is made: ``reserved`` when given (the library's override), else the
    job's ``--reserved``, else (``auto``) its framework profile's ``default_reserved``, but ``fixed`` under
    pipeline parallelism: no witness checks the simulator's schedule of a pipeline stage (docs/benchmarks.md)."""
    mode = reserved if reserved is not None else job.reserved
    if mode == "auto":
        runs = zero_engine(job)[0] if job.sharding.zero else job  # the engine that runs a ZeRO stage decides
        mode = "fixed" if job.parallel.pp > 1 else get_profile(runs.framework).default_reserved
    if mode not in RESERVED_MODES:
        raise JobConfigError("--reserved", f"must be one of {', '.join(RESERVED_MODES)}", mode)
    return mode


def _simulated_share(peak: StageEstimate) -> float:
    """The share of the peak stage's simulated reserved memory that holds no live tensor."""
    if peak.peak_reserved_bytes <= 0:
        return 0.0
    return round(1.0 - peak.peak_allocated_bytes / peak.peak_reserved_bytes, 4)


@lru_cache(maxsize=128)
def _stages(model_key: Same, job: Job, fragmentation: float, simulate: bool = False,
            runs_on: FrameworkProfile | None = None) -> tuple[
        tuple[StageEstimate, ...], tuple[str, ...], StageEstimate, FinetuneParams | None, str,
        tuple[InputSetting, ...]]:
    """(stages, assumption sentences, the peak stage, fine-tuning counts, framework, and under
    ``--compile`` the compiled parts priced as eager (:func:`~memplan.estimate.compiled.compile_settings`))
    of ``job``.

    A pure function of immutable inputs (a frozen model spec, compared by identity, and a frozen
    ``Job``, by value), so it is memoised: a caller that estimates the same job again (a loop, the
    server, ``fit`` revisiting a candidate) gets the same figures without the walk; a job that
    fails validation raises every time (exceptions are not memoised). ``runs_on``: the profile a job moved to another
    framework's ZeRO engine runs under (:func:`memplan.profiles.zero_engine.engine_profile`; None: its own)."""
    run, parts = _stage_parts(model_key, job, fragmentation, runs_on)
    notes = run_notes(run)
    stages = []
    for stage, stage_notes, inputs in parts:
        if simulate:
            stage, stage_notes = simulate_stage(stage, stage_notes, inputs)
        stages.append(stage)
        notes += stage_notes
    peak = max(stages, key=lambda s: (s.peak_allocated_bytes, -s.stage))
    if not simulate:
        notes.append(f"reserved = allocated / (1 - {fragmentation:.2f}) rounded to 2 MiB segments "
                     "(assumed allocator fragmentation)")
    compiled = compile_settings(run) if job.compile else ()
    return tuple(stages), tuple(dict.fromkeys(notes)), peak, run.counts, run.profile.name, compiled


def simulated_stage_reserved(model: ModelSpec, job: Job, stage: int,
                             fragmentation: float = DEFAULT_FRAGMENTATION) -> int:
    """Pipeline stage ``stage``'s simulated peak reserved bytes: what :func:`estimate` with
    ``reserved="simulated"`` gives for that stage of ``job``, without simulating the other stages (``fit``
    needs only the peak stage's figure: :attr:`Estimate.peak_reserved_bytes` is the reserved of the stage
    with the highest allocated, the same stage under either mode). Right after the job's fixed estimate
    the stage's figures are not built again (:func:`_stage_parts`)."""
    runs, runs_on, _ = _on_engine(job)
    _, parts = _stage_parts(Same(model), runs, fragmentation, runs_on)
    figures, notes, inputs = next(part for part in parts if part[0].stage == stage)
    return simulate_stage(figures, notes, inputs)[0].peak_reserved_bytes


@lru_cache(maxsize=8)
def _stage_parts(model_key: Same, job: Job, fragmentation: float, runs_on: FrameworkProfile | None = None) -> tuple[
        RunContext, tuple[tuple[StageEstimate, list[str], StageParts], ...]]:
    """The job's context and per pipeline stage its fixed figures, their sentences and what its
    reserved-memory schedule is built from. Memoised for a few jobs only (a stage's parts hold its ledger
    and layer walk): ``fit`` prices a job's fixed figures, then simulates the peak stage of the same job."""
    model = model_key.obj
    assert isinstance(model, ModelSpec)
    validate_job_for_model(job, model)
    run = run_context(model, job, fragmentation, runs_on)
    layouts = pipeline_layout(model.num_layers, job.parallel, job.num_microbatches, run.profile.pipeline_split)
    return run, tuple(stage_parts(stage_context(run, layout)) for layout in layouts)


def layer_activation_costs(model: ModelSpec, job: Job, index: int) -> tuple[int, int, int]:
    """(bytes kept under the job's recompute, bytes kept without recompute, backward transient) of
    decoder layer ``index`` for one micro-batch on one rank: the per-layer figures the estimate sums (a ``--zero`` job
    on the engine that runs it, as :func:`estimate` prices it)."""
    runs, runs_on, _ = _on_engine(job)
    return layer_costs(run_context(model, runs, DEFAULT_FRAGMENTATION, runs_on), model.layers[index], index)[:3]

