"""``memplan fit``: which layouts fit, the largest micro-batch / sequence, and GPU sharing.

A thin client: parse the flags, call :mod:`memplan.fit`, render rich tables or JSON. Nothing heavy
is imported at module level (rich inside the renderers, matplotlib only for ``--plot``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from memplan.commands.common import (
    HF_ARGS_HELP,
    PEFT_CONFIG_HELP,
    TORCHTITAN_CONFIG_HELP,
    app,
    check_output_path,
    handle_errors,
    job_options,
    option,
    print_unmodelled,
)
from memplan.commands.common import Command as _Command
from memplan.commands.common import print_json as _print_json
from memplan.commands.common import print_rich as _print
from memplan.errors import ConfigError

if TYPE_CHECKING:
    from memplan.fit.results import FitResult
    from memplan.job import Job
    from memplan.model.spec import ModelSpec

_SEARCH, _LAYOUT, _OUT = "Search", "Layout for --max-mbs / --max-seq", "Output"
_METHODS = "Fine-tuning methods"

_EPILOG = """\
Examples:

  memplan fit llama-3.1-70b --gpus 64 --gpu h100-80gb --seq 8192 --gbs 512

  memplan fit deepseek-v3 --gpus 1024 --gpu h100-80gb --top 5 --json

  memplan fit llama-3.1-8b --gpus 8 --max-mbs --tp 2 --sequence-parallel --distributed-optimizer --recompute selective

  memplan fit llama-3.1-8b --gpus 8 --max-seq --plot seq.png

  memplan fit --colocate job1.yaml job2.yaml --gpu h100-80gb:3g.40gb

  memplan fit llama-3.1-8b --gpu rtx-4090 --methods --seq 2048

  memplan fit llama-3.1-8b --gpu rtx-4090 --peft lora --quantize-base nf4 --framework hf --max-seq

A layout fits when its predicted reserved memory is at most the GPU's usable memory minus
--margin. Sizes in GiB = 2^30 bytes. Exit codes: 0 ok, 1 nothing fits (the result, with the
rejected families, is still printed; with --json on stdout) or unsupported input, 2 invalid input.
"""


#: Job flags the layout search chooses itself: given without --max-mbs/--max-seq they are refused
#: (never silently replaced by the search's choice).
SEARCHED_FLAGS = ("dp", "tp", "pp", "vpp", "cp", "ep", "etp", "sequence_parallel", "first_stage_layers",
                  "last_stage_layers", "zero", "fsdp", "fsdp_shard_size", "distributed_optimizer", "mbs",
                  "recompute", "recompute_method", "recompute_layers", "recompute_modules", "memory_budget",
                  "offload_optimizer",
                  "optimizer_offload_fraction", "offload_params", "partition_activations", "cpu_checkpointing",
                  "contiguous_checkpoints")


@app.command("fit", cls=_Command, epilog=_EPILOG)
@job_options()
def fit_command(
    args: Annotated[list[str] | None, typer.Argument(
        help="MODEL (preset or config.json), or with --colocate the job files.", show_default=False,
        metavar="MODEL | JOB_FILE...")] = None,
    gpu: Annotated[str, option("--gpu", help="GPU (see `memplan gpus`), or GPU:MIG-PROFILE with --colocate. (default: h100-80gb)", panel=_SEARCH, metavar="NAME")] = "h100-80gb",
    margin: Annotated[float | None, option("--margin", help="Share of usable GPU memory kept free. (default: 0.05)", panel=_SEARCH, metavar="F")] = None,
    gpus_per_node: Annotated[int, option("--gpus-per-node", help="GPUs per node: TP and EP stay within one. (default: 8)", panel=_SEARCH)] = 8,
    colocate: Annotated[bool, option("--colocate", help="The arguments are job files: can they share one GPU?", panel=_SEARCH)] = False,
    max_mbs: Annotated[bool, option("--max-mbs", help="Find the largest micro-batch that fits one layout (the layout flags, --job, or the best found).", panel=_LAYOUT)] = False,
    max_seq: Annotated[bool, option("--max-seq", help="Find the longest sequence that fits one layout.", panel=_LAYOUT)] = False,
    methods: Annotated[bool, option("--methods", help="Compare full fine-tuning, full with 8-bit AdamW, LoRA and QLoRA, each with and without gradient checkpointing, on one --gpu at --seq/--mbs: which fit, fastest first (hf profile unless --framework).", panel=_METHODS)] = False,
    job_file: Annotated[str | None, option("--job", help="Job file giving the layout for --max-mbs / --max-seq.", panel=_LAYOUT, metavar="FILE")] = None,
    hf_args: Annotated[str | None, option("--hf-args", help=HF_ARGS_HELP + " The search still chooses layout, micro-batch and recompute.", panel=_SEARCH, metavar="FILE")] = None,
    peft_config: Annotated[str | None, option("--peft-config", help=PEFT_CONFIG_HELP, panel=_SEARCH, metavar="FILE")] = None,
    torchtitan_config: Annotated[str | None, option("--torchtitan-config", help=TORCHTITAN_CONFIG_HELP + " The search still chooses layout, micro-batch and recompute.", panel=_SEARCH, metavar="FILE")] = None,
    plot: Annotated[str | None, option("--plot", help="Write the memory curve of --max-mbs/--max-seq as a PNG.", panel=_OUT, metavar="FILE")] = None,
    top: Annotated[int, option("--top", help="Candidates shown. (default: 10)", panel=_OUT)] = 10,
    show_all: Annotated[bool, option("--all", help="Show every fitting candidate and rejected family.", panel=_OUT)] = False,
    json_output: Annotated[bool, option("--json", help="Print the result as JSON (nothing else on stdout).", panel=_OUT)] = False,
    job_flags: dict[str, Any] | None = None,
) -> None:
    """Find which parallel layouts of MODEL fit --gpus GPUs, fastest first (predicted step time).

    The job flags are memplan estimate's: the search keeps them and chooses the layout, sharding,
    micro-batch and recompute. --max-mbs / --max-seq find the largest micro-batch / sequence of one
    layout, and --colocate predicts whether several jobs can share one GPU or MIG slice. --methods
    compares fine-tuning methods (full, 8-bit AdamW, LoRA, QLoRA; with and without checkpointing) on
    one GPU. --gpus defaults to 1 for --max-mbs, --max-seq and --methods.
    """
    from memplan.fit.results import FIT_MARGIN

    flags, shown = dict(job_flags or {}), None if show_all else top
    settings = _Settings(gpu=gpu, margin=FIT_MARGIN if margin is None else margin, gpus_per_node=gpus_per_node,
                         hf_args=hf_args, peft_config=peft_config, torchtitan_config=torchtitan_config)
    with handle_errors():
        check_output_path("--plot", plot)
        names = list(args or [])
        if colocate:
            if settings.dialects:
                raise ConfigError("--colocate", "takes job files; name hf-args / peft-config inside them")
            return _colocate(names, settings, json_output)
        if len(names) != 1:
            raise ConfigError("MODEL", "give exactly one model (or --colocate with job files)", " ".join(names) or None)
        if methods:
            return _methods(names[0], flags, settings, json_output,
                            others={"--max-mbs": max_mbs, "--max-seq": max_seq, "--plot": plot, "--job": job_file})
        if flags.get("gpus") is None:
            if not (max_mbs or max_seq):
                raise ConfigError("--gpus", "is required: the number of GPUs to lay the job out on")
            flags["gpus"] = 1
        if max_mbs or max_seq:
            return _limits(names[0], flags, job_file, settings, max_mbs, max_seq, plot, json_output)
        for flag, value in (("--plot", plot), ("--job", job_file)):
            if value is not None:
                raise ConfigError(flag, "needs --max-mbs or --max-seq")
        _search_command(names[0], flags, settings, shown, json_output)


@dataclass(frozen=True)
class _Settings:
    """fit's own settings beside the job: where it must fit and how the search places ranks."""

    gpu: str
    margin: float
    gpus_per_node: int
    hf_args: str | None = None
    peft_config: str | None = None
    torchtitan_config: str | None = None

    @property
    def dialects(self) -> bool:
        return self.hf_args is not None or self.peft_config is not None or self.torchtitan_config is not None

    def loaded(self, model_ref: str, flags: dict[str, Any], job_file: str | None = None) -> Any:
        """The job the flags, the job file and the dialect files describe (:func:`memplan.inputs.load_job`)."""
        from memplan.inputs import JobRequest, load_job

        return load_job(JobRequest(model=model_ref, flags=flags, job_file=job_file, hf_args=self.hf_args,
                                   peft_config=self.peft_config, torchtitan_config=self.torchtitan_config))


def _search_command(model_ref: str, flags: dict[str, Any], settings: _Settings, shown: int | None,
                    json_output: bool) -> None:
    from memplan.fit.results import NoFitError
    from memplan.jobflags import job_flags
    from memplan.model import load_model

    searched = [f for f in job_flags() if f.name in SEARCHED_FLAGS and f.name in flags]
    if searched:
        raise ConfigError(searched[0].flag, "is chosen by the layout search; to fix a layout use --max-mbs or "
                          "--max-seq (or memplan estimate)", flags[searched[0].name])
    read: tuple[Any, ...] = ()
    if settings.dialects:
        loaded = settings.loaded(model_ref, flags)
        model, base, read, gpus = loaded.model, loaded.job, loaded.settings, flags.pop("gpus")
    else:
        gpus = flags.pop("gpus")
        model, base = load_model(model_ref), _base_job(flags)
    if base.recompute.partition_activations or base.recompute.cpu_checkpointing:
        # the search builds its own recompute settings, which would drop these
        raise ConfigError("activation_checkpointing", "is not searched by memplan fit (its layouts set their own "
                          "recompute); to price it, fix the layout with --max-mbs or --max-seq, or use memplan "
                          "estimate", "partition_activations / cpu_checkpointing")
    try:
        result = _search(model, gpus, base, settings, quiet=json_output, top=shown)
    except NoFitError as exc:  # a result, not bad input: show it, then the error line (exit 1)
        _show_fit(exc.result, shown, json_output, read)
        raise
    _show_fit(result, shown, json_output, read)


def _base_job(flags: dict[str, Any]) -> Job:
    """The job the search starts from: the flags it does not choose (--gbs is checked per layout)."""
    from memplan.jobflags import build_job

    return build_job({k: v for k, v in flags.items() if k != "gbs"})


def _show_fit(result: FitResult, shown: int | None, json_output: bool, read: tuple[Any, ...] = ()) -> None:
    if json_output:
        from memplan.settings import settings_dict

        _print_json({**result.to_dict(top=shown), **settings_dict(read)})
        return
    from memplan.report.fit_text import fit_renderables

    _print(*fit_renderables(result, shown))
    print_unmodelled(read)


def _progress(enabled: bool) -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    """A progress callback that shows a bar on stderr only once the work has taken over a second."""
    if not enabled:
        return None, lambda: None
    start = time.perf_counter()
    shown: list[Any] = []  # the rich Progress and its task id, once started

    def update(done: int, total: int) -> None:
        if not shown:
            if time.perf_counter() - start < 1.0:
                return
            from rich.console import Console
            from rich.progress import Progress

            bar = Progress(console=Console(stderr=True), transient=True)
            bar.start()
            shown.extend([bar, bar.add_task("searching layouts", total=total)])
        shown[0].update(shown[1], completed=done)

    def stop() -> None:
        if shown:
            shown[0].stop()

    return update, stop


def _search(model: ModelSpec, gpus: int, base: Job, settings: _Settings, *, quiet: bool, top: int | None = 1,
            gbs: int | None = None) -> FitResult:
    from memplan.fit.search import fit
    from memplan.fit.space import SearchSpace

    callback, stop = _progress(not quiet)
    try:
        return fit(model, gpus=gpus, gpu=settings.gpu, gbs=gbs if gbs is not None else base.batch.global_batch_size,
                   margin=settings.margin, space=SearchSpace(gpus_per_node=settings.gpus_per_node), top=top,
                   progress=callback, base=base)
    finally:
        stop()


def _layout_job(model: ModelSpec, model_ref: str, flags: dict[str, Any], job_file: str | None,
                settings: _Settings) -> Job:
    """The job whose limits are searched: a job file and/or the flags, or the best fitting layout."""
    if job_file is not None or settings.dialects or any(name in flags for name in SEARCHED_FLAGS) \
            or flags["gpus"] == 1:
        # One GPU has one layout: the flags' job (its recompute and micro-batch as given).
        return settings.loaded(model_ref, flags, job_file).job
    gpus = flags["gpus"]
    base = _base_job({k: v for k, v in flags.items() if k != "gpus"})
    best = _search(model, gpus, base, settings, quiet=True, gbs=flags.get("gbs")).best
    assert best is not None
    return best.job


def _limits(model_ref: str, flags: dict[str, Any], job_file: str | None, settings: _Settings, max_mbs: bool,
            max_seq: bool, plot: str | None, json_output: bool) -> None:
    from memplan.fit.limits import max_micro_batch, max_seq_length, plot_limit
    from memplan.model import load_model

    if max_mbs and max_seq:
        raise ConfigError("--max-mbs", "cannot be combined with --max-seq (search one at a time)")
    model = load_model(model_ref)
    job = _layout_job(model, model_ref, flags, job_file, settings)
    read = settings.loaded(model_ref, flags, job_file).settings if settings.dialects else ()
    search = max_micro_batch if max_mbs else max_seq_length
    limit = search(model, job, gpu=settings.gpu, margin=settings.margin)
    if plot is not None:
        plot_limit(limit, plot)
    if json_output:
        from dataclasses import asdict

        from memplan.settings import settings_dict

        _print_json({**limit.to_dict(), "job": asdict(job), **settings_dict(read)})
    else:
        from memplan.report.fit_text import limit_renderables

        _print(*limit_renderables(limit, job, plot))
        print_unmodelled(read)
    if not limit.best:  # a result, not bad input: shown above, then the error line (exit 1)
        from memplan.errors import MemplanError

        raise MemplanError(f"no {limit.quantity.replace('_', ' ')} fits this layout on {limit.gpu}")


#: What --methods chooses itself for each method: refused when given (never silently replaced).
METHOD_FLAGS = ("recompute", "recompute_method", "recompute_layers", "recompute_modules", "memory_budget",
                "partition_activations",
                "cpu_checkpointing", "contiguous_checkpoints", "peft", "trainable", "quantize_base", "gbs",
                "tp", "pp", "vpp", "cp", "ep", "etp")


def _methods(model_ref: str, flags: dict[str, Any], settings: _Settings, json_output: bool,
             others: dict[str, Any]) -> None:
    from memplan.fit.methods import compare_methods, methods_base_job
    from memplan.gpus import get_gpu
    from memplan.jobflags import build_job, job_flags
    from memplan.model import load_model

    for flag, value in others.items():
        if value not in (None, False):
            raise ConfigError(flag, "cannot be combined with --methods (it compares methods at one --seq/--mbs)",
                              value)
    chosen = [f for f in job_flags() if f.name in METHOD_FLAGS and f.name in flags]
    if chosen:
        raise ConfigError(chosen[0].flag, "is chosen by --methods for each method (it compares what trains and "
                          "gradient checkpointing on one GPU); drop it", flags[chosen[0].name])
    gpu = get_gpu(settings.gpu)
    model = load_model(model_ref)
    base = build_job({"gpus": 1, **flags}, base=methods_base_job(gpu))
    result = compare_methods(model, gpu=gpu, base=base, margin=settings.margin)
    if json_output:
        _print_json(result.to_dict())
    else:
        from memplan.report.fit_text import methods_renderables

        _print(*methods_renderables(result))
    if result.best is None:  # a result, not bad input: shown above, then the error line (exit 1)
        from memplan.errors import MemplanError

        raise MemplanError(f"no fine-tuning method fits {model.name} on {gpu.name} at sequence "
                           f"{result.seq_length}, micro-batch {result.micro_batch_size}")


def _colocate(files: list[str], settings: _Settings, json_output: bool) -> None:
    from memplan.estimate.engine import DEFAULT_FRAGMENTATION
    from memplan.fit.colocate import SharedJob, colocate
    from memplan.inputs import JobRequest, load_job

    if not files:
        raise ConfigError("--colocate", "needs one or more job files")
    jobs = []
    for path in files:
        loaded = load_job(JobRequest(job_file=path))
        fragmentation = DEFAULT_FRAGMENTATION if loaded.fragmentation is None else loaded.fragmentation
        jobs.append(SharedJob(name=Path(path).name, model=loaded.model, job=loaded.job, fragmentation=fragmentation))
    shared = colocate(jobs, gpu=settings.gpu, margin=settings.margin)
    if json_output:
        _print_json(shared.to_dict())
        return
    from memplan.report.fit_text import colocation_table

    _print(colocation_table(shared))
