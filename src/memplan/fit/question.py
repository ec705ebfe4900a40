"""One ``memplan fit`` question and its answer: the JSON document ``--json`` prints, and whether it is a "no".

``memplan fit`` and ``POST /v1/fit`` (:mod:`memplan.serve`) both call :func:`answer`, so the same
question gets the same document from either. A question is a model, the job flags the user gave
(:mod:`memplan.jobflags`), the dialect files and fit's own settings; it asks one of three things:
which layouts fit (the default), the largest micro-batch or sequence of one layout (``max_mbs`` /
``max_seq``), or which fine-tuning methods fit one GPU (``methods``). Colocation is
:func:`memplan.fit.colocate`.

Example::

    >>> from memplan.fit.question import FitQuestion, answer
    >>> reply = answer(FitQuestion(model="llama-3.1-8b", flags={"gpus": 8}, gpu="h100-80gb"))
    >>> reply.document["best"]["layout"]["tp"] >= 1, reply.failure is None
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from memplan.errors import ConfigError
from memplan.fit.results import FIT_MARGIN
from memplan.job import Job
from memplan.model.spec import ModelSpec

__all__ = ["METHOD_FLAGS", "SEARCHED_FLAGS", "FitAnswer", "FitQuestion", "answer"]

#: Job flags the layout search chooses itself: given without max_mbs/max_seq they are refused
#: (never silently replaced by the search's choice).
SEARCHED_FLAGS = ("dp", "tp", "pp", "vpp", "cp", "ep", "etp", "sequence_parallel", "first_stage_layers",
                  "last_stage_layers", "zero", "fsdp", "fsdp_shard_size", "distributed_optimizer", "mbs",
                  "recompute", "recompute_method", "recompute_layers", "recompute_modules", "memory_budget",
                  "offload_optimizer",
                  "optimizer_offload_fraction", "offload_params", "partition_activations", "cpu_checkpointing",
                  "contiguous_checkpoints")

#: What ``methods`` chooses itself for each method: refused when given (never silently replaced).
METHOD_FLAGS = ("recompute", "recompute_method", "recompute_layers", "recompute_modules", "memory_budget",
                "partition_activations",
                "cpu_checkpointing", "contiguous_checkpoints", "peft", "trainable", "quantize_base", "gbs",
                "tp", "pp", "vpp", "cp", "ep", "etp")


@dataclass(frozen=True, kw_only=True)
class FitQuestion:
    """What ``memplan fit MODEL`` is asked (everything but ``--colocate`` and ``--plot``)."""

    #: Preset name, config.json path or Hub id.
    model: str
    #: Job flag values by :attr:`memplan.jobflags.JobFlag.name`, as given.
    flags: Mapping[str, Any] = field(default_factory=dict)
    gpu: str = "h100-80gb"
    margin: float = FIT_MARGIN
    gpus_per_node: int = 8
    job_file: str | None = None
    hf_args: str | None = None
    peft_config: str | None = None
    torchtitan_config: str | None = None
    max_mbs: bool = False
    max_seq: bool = False
    methods: bool = False
    #: Candidates listed (None: every one, and every rejected family).
    top: int | None = 10

    @property
    def dialects(self) -> bool:
        return self.hf_args is not None or self.peft_config is not None or self.torchtitan_config is not None

    def loaded(self, flags: Mapping[str, Any], job_file: str | None = None) -> Any:
        """The job the flags, the job file and the dialect files describe (:func:`memplan.inputs.load_job`)."""
        from memplan.inputs import JobRequest, load_job

        return load_job(JobRequest(model=self.model, flags=flags, job_file=job_file, hf_args=self.hf_args,
                                   peft_config=self.peft_config, torchtitan_config=self.torchtitan_config))


@dataclass(frozen=True)
class FitAnswer:
    """The answer: the JSON document, and the one-line "no" when nothing fits (the CLI exits 1 then).

    The document's ``failure`` field holds the same sentence (null when something fits).
    """

    document: dict[str, Any]
    #: None when something fits; else why not, in one sentence.
    failure: str | None = None
    #: The typed result (FitResult, Limit or MethodsResult) the document was made from.
    result: Any = None
    #: The layout's job (max_mbs / max_seq only).
    job: Job | None = None
    #: What the dialect files said (:class:`~memplan.settings.InputSetting`), for the "not modelled" line.
    settings: tuple[Any, ...] = ()


#: Called as the layout search advances: (layouts done, layouts in all).
Progress = Callable[[int, int], None]


def answer(question: FitQuestion, *, progress: Progress | None = None) -> FitAnswer:
    """Answer ``question``; bad input raises :class:`~memplan.errors.ConfigError` naming the flag."""
    if question.top is not None and question.top < 1:
        raise ConfigError("--top", "must be at least 1", question.top)
    if not 0.0 <= question.margin < 1.0:
        raise ConfigError("--margin", "must be in [0, 1)", question.margin)
    if question.gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", "must be at least 1", question.gpus_per_node)
    flags = dict(question.flags)
    if question.methods or question.max_mbs or question.max_seq:
        _refuse_search_settings(question, "--methods" if question.methods else
                                "--max-mbs" if question.max_mbs else "--max-seq")
    if question.methods:
        return _methods(question, flags)
    if flags.get("gpus") is None:
        if not (question.max_mbs or question.max_seq):
            raise ConfigError("--gpus", "is required: the number of GPUs to lay the job out on")
        flags["gpus"] = 1
    if question.max_mbs or question.max_seq:
        return _limits(question, flags)
    if question.job_file is not None:
        raise ConfigError("--job", "needs --max-mbs or --max-seq")
    return _search_answer(question, flags, progress)


def search_options(top: int | None, show_all: bool, gpus_per_node: int) -> tuple[tuple[str, Any], ...]:
    """``--top``, ``--all`` and ``--gpus-per-node``, the options only the layout search reads, as (flag, value): the
    value None or False where not given or given its default (which restates the search's own)."""
    default = FitQuestion(model="")
    return (("--top", top if top not in (None, default.top) else None), ("--all", show_all),
            ("--gpus-per-node", gpus_per_node if gpus_per_node != default.gpus_per_node else None))


def _refuse_search_settings(question: FitQuestion, mode: str) -> None:
    """The layout search's options given with a question that runs no search (``mode``): each refused instead of
    dropped."""
    for flag, value in search_options(question.top, question.top is None, question.gpus_per_node):
        if value not in (None, False):
            raise ConfigError(flag, f"applies to the layout search only; {mode} searches no layouts", value)


def _search_answer(question: FitQuestion, flags: dict[str, Any], progress: Progress | None) -> FitAnswer:
    from memplan.fit.results import NoFitError
    from memplan.jobflags import job_flags
    from memplan.model import load_model
    from memplan.settings import settings_dict

    searched = [f for f in job_flags() if f.name in SEARCHED_FLAGS and f.name in flags]
    if searched:
        raise ConfigError(searched[0].flag, "is chosen by the layout search; to fix a layout use --max-mbs or "
                          "--max-seq (or memplan estimate)", flags[searched[0].name])
    read: tuple[Any, ...] = ()
    if question.dialects:
        loaded = question.loaded(flags)
        model, base, read, gpus = loaded.model, loaded.job, loaded.settings, flags.pop("gpus")
    else:
        gpus = flags.pop("gpus")
        from memplan.inputs import default_seq_within_positions
        from memplan.jobcheck import check_seq_positions

        model = load_model(question.model)
        base = default_seq_within_positions(_base_job(flags), model, flags)
        check_seq_positions(base, model)
    if base.recompute.partition_activations or base.recompute.cpu_checkpointing:
        # the search builds its own recompute settings, which would drop these
        raise ConfigError("activation_checkpointing", "is not searched by memplan fit (its layouts set their own "
                          "recompute); to price it, fix the layout with --max-mbs or --max-seq, or use memplan "
                          "estimate", "partition_activations / cpu_checkpointing")
    failure = None
    try:
        result = _search(model, gpus, base, question, top=question.top, progress=progress, gbs=flags.get("gbs"))
    except NoFitError as exc:  # a result, not bad input
        result, failure = exc.result, str(exc)
    document = result.to_dict(top=question.top)
    for shown, candidate in zip(document["candidates"], result.candidates, strict=False):
        shown["native"] = candidate_native(model, base, candidate.job)
    return FitAnswer({**document, "failure": failure, **settings_dict(read)}, failure, result, settings=read)


def candidate_native(model: ModelSpec, base: Job, job: Job) -> dict[str, Any] | None:
    """A fitting job in the base job's framework's own settings (:mod:`memplan.frameworks.native_fix`): what to
    change in the user's launch, its config or its TOML to run it."""
    from memplan.estimate.layout import pipeline_layout
    from memplan.frameworks.native_fix import native_change
    from memplan.profiles.framework import get_profile

    stages = pipeline_layout(model.num_layers, job.parallel, 1, get_profile(job.framework).pipeline_split)
    native = native_change(base, job, rank_layers=[stage.num_layers for stage in stages])
    return None if native is None else native.to_dict()


def _base_job(flags: Mapping[str, Any]) -> Job:
    """The job the search starts from: the flags it does not choose (--gbs is checked per layout)."""
    from memplan.jobflags import build_job

    return build_job({k: v for k, v in flags.items() if k != "gbs"})


def _search(model: ModelSpec, gpus: int, base: Job, question: FitQuestion, *, top: int | None,
            progress: Progress | None = None, gbs: int | None = None) -> Any:
    from memplan.fit.search import fit
    from memplan.fit.space import SearchSpace

    return fit(model, gpus=gpus, gpu=question.gpu, gbs=gbs if gbs is not None else base.batch.global_batch_size,
               margin=question.margin, space=SearchSpace(gpus_per_node=question.gpus_per_node), top=top,
               progress=progress, base=base)


def _layout_job(model: ModelSpec, question: FitQuestion, flags: dict[str, Any]) -> Job:
    """The job whose limits are searched: a job file and/or the flags, or the best fitting layout."""
    if question.job_file is not None or question.dialects or any(name in flags for name in SEARCHED_FLAGS) \
            or flags["gpus"] == 1:
        # One GPU has one layout: the flags' job (its recompute and micro-batch as given).
        return question.loaded(flags, question.job_file).job
    base = _base_job({k: v for k, v in flags.items() if k != "gpus"})
    best = _search(model, flags["gpus"], base, question, top=1, gbs=flags.get("gbs")).best
    assert best is not None
    return best.job


def _limits(question: FitQuestion, flags: dict[str, Any]) -> FitAnswer:
    from memplan.fit.limits import max_micro_batch, max_seq_length
    from memplan.model import load_model
    from memplan.settings import settings_dict

    if question.max_mbs and question.max_seq:
        raise ConfigError("--max-mbs", "cannot be combined with --max-seq (search one at a time)")
    model = load_model(question.model)
    job = _layout_job(model, question, flags)
    read = question.loaded(flags, question.job_file).settings if question.dialects else ()
    search = max_micro_batch if question.max_mbs else max_seq_length
    limit = search(model, job, gpu=question.gpu, margin=question.margin)
    failure = None if limit.best else f"no {limit.quantity.replace('_', ' ')} fits this layout on {limit.gpu}"
    return FitAnswer({**limit.to_dict(), "job": asdict(job), "failure": failure, **settings_dict(read)}, failure, limit,
                     job, read)


def _methods(question: FitQuestion, flags: dict[str, Any]) -> FitAnswer:
    from memplan.fit.methods import compare_methods, methods_base_job
    from memplan.gpus import get_gpu
    from memplan.jobflags import build_job, job_flags
    from memplan.model import load_model

    for flag, value in (("--max-mbs", question.max_mbs), ("--max-seq", question.max_seq),
                        ("--job", question.job_file)):
        if value not in (None, False):
            raise ConfigError(flag, "cannot be combined with --methods (it compares methods at one --seq/--mbs)",
                              value)
    chosen = [f for f in job_flags() if f.name in METHOD_FLAGS and f.name in flags]
    if chosen:
        raise ConfigError(chosen[0].flag, "is chosen by --methods for each method (it compares what trains and "
                          "gradient checkpointing on one GPU); drop it", flags[chosen[0].name])
    gpu = get_gpu(question.gpu)
    model = load_model(question.model)
    base = build_job({"gpus": 1, **flags}, base=methods_base_job(gpu))
    result = compare_methods(model, gpu=gpu, base=base, margin=question.margin)
    failure = None
    if result.best is None:
        failure = (f"no fine-tuning method fits {model.name} on {gpu.name} at sequence {result.seq_length}, "
                   f"micro-batch {result.micro_batch_size}")
    return FitAnswer({**result.to_dict(), "failure": failure}, failure, result)
