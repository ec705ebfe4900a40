"""``memplan fit``: which layouts fit, the largest micro-batch / sequence, and GPU sharing.

A thin client: parse the flags, call :mod:`memplan.fit`, render rich tables or JSON. Nothing heavy
is imported at module level (rich inside the renderers, matplotlib only for ``--plot``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
from memplan.dataset.options import dataset_options
from memplan.errors import ConfigError

if TYPE_CHECKING:
    from memplan.fit.question import FitAnswer, FitQuestion

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


@app.command("fit", cls=_Command, epilog=_EPILOG)
@job_options()
@dataset_options(emit=True)
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
    dataset_flags: dict[str, Any] | None = None,
) -> None:
    """Find which parallel layouts of MODEL fit --gpus GPUs, fastest first (predicted step time).

    The job flags are memplan estimate's: the search keeps them and chooses the layout, sharding,
    micro-batch and recompute. --max-mbs / --max-seq find the largest micro-batch / sequence of one
    layout, and --colocate predicts whether several jobs can share one GPU or MIG slice. --methods
    compares fine-tuning methods (full, 8-bit AdamW, LoRA, QLoRA; with and without checkpointing) on
    one GPU. --gpus defaults to 1 for --max-mbs, --max-seq and --methods.
    """
    from memplan.fit.question import FitQuestion, answer, search_options
    from memplan.fit.results import FIT_MARGIN

    with handle_errors():
        check_output_path("--plot", plot)
        names = list(args or [])
        # what only the layout search reads, and the other questions
        search = search_options(top, show_all, gpus_per_node)
        modes = (("--max-mbs", max_mbs), ("--max-seq", max_seq), ("--methods", methods), ("--job", job_file))
        if colocate:
            if hf_args is not None or peft_config is not None or torchtitan_config is not None:
                raise ConfigError("--colocate", "takes job files; name hf-args / peft-config inside them")
            _refuse_with_colocate(job_flags, dataset_flags)
            _refuse_unused("--colocate (it fits the job files as they are)", (*modes, ("--plot", plot), *search))
            return _colocate(names, gpu, FIT_MARGIN if margin is None else margin, json_output)
        if len(names) != 1:
            raise ConfigError("MODEL", "give exactly one model (or --colocate with job files)", " ".join(names) or None)
        if dataset_flags:
            from memplan.dataset.fitting import fit_dataset_answer

            _refuse_unused("--dataset (it searches the batching, micro-batch and recompute of the job's layout)",
                           (*modes, ("--torchtitan-config", torchtitan_config), *search))

            check_output_path("--emit", (dataset_flags.get("emit") or (None, None))[1])
            document, shown = fit_dataset_answer(names[0], dict(job_flags or {}), dataset_flags, gpu=gpu,
                                                 margin=margin, hf_args=hf_args, peft_config=peft_config, plot=plot)
            return _print_json(document) if json_output else _print(*shown)
        if plot is not None and (methods or not (max_mbs or max_seq)):
            raise ConfigError("--plot", "cannot be combined with --methods (it compares methods at one --seq/--mbs)"
                              if methods else "needs --max-mbs or --max-seq", plot)
        question = FitQuestion(model=names[0], flags=dict(job_flags or {}), gpu=gpu,
                               margin=FIT_MARGIN if margin is None else margin, gpus_per_node=gpus_per_node,
                               job_file=job_file, hf_args=hf_args, peft_config=peft_config,
                               torchtitan_config=torchtitan_config, max_mbs=max_mbs, max_seq=max_seq,
                               methods=methods, top=None if show_all else top)
        callback, stop = _progress(not json_output and not (max_mbs or max_seq or methods))
        try:
            reply = answer(question, progress=callback)
        finally:
            stop()
        if plot is not None and reply.result is not None:
            from memplan.fit.limits import plot_limit

            plot_limit(reply.result, plot)
        _show(reply, question, plot, json_output)
        if reply.failure is not None:  # a result, not bad input: shown above, then the error line (exit 1)
            from memplan.errors import MemplanError

            raise MemplanError(reply.failure)


def _show(reply: FitAnswer, question: FitQuestion, plot: str | None, json_output: bool) -> None:
    """The answer as JSON (exactly ``reply.document``) or as tables."""
    if json_output:
        _print_json(reply.document)
        return
    from memplan.report import fit_text

    if question.methods:
        _print(*fit_text.methods_renderables(reply.result))
    elif question.max_mbs or question.max_seq:
        _print(*fit_text.limit_renderables(reply.result, reply.job, plot))
    else:
        _print(*fit_text.fit_renderables(reply.result, question.top))
        _print(*fit_text.native_renderables(reply.document))
    print_unmodelled(reply.settings)


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


def _refuse_with_colocate(job_flags: dict[str, Any] | None, dataset_flags: dict[str, Any] | None) -> None:
    """--colocate reads every job from its file: a job flag or a dataset flag beside it is refused (it would change
    none of the jobs), never dropped."""
    from memplan.jobflags import job_flags as all_job_flags

    spelled = {f.name: f.flag for f in all_job_flags()}
    for name, value in (job_flags or {}).items():
        raise ConfigError(spelled.get(name, f"--{name.replace('_', '-')}"),
                          "is a job setting; with --colocate each job file gives its own", value)
    for name, value in (dataset_flags or {}).items():
        raise ConfigError(f"--{name.replace('_', '-')}", "does not apply with --colocate (it fits job files)", value)


def _refuse_unused(mode: str, options: tuple[tuple[str, Any], ...]) -> None:
    """An option the question ``mode`` does not read is refused, never dropped."""
    for flag, value in options:
        if value not in (None, False):
            raise ConfigError(flag, f"does not apply with {mode}", value)


def _colocate(files: list[str], gpu: str, margin: float, json_output: bool) -> None:
    from memplan.fit.colocate import SharedJob, colocate
    from memplan.inputs import JobRequest, load_job

    if not files:
        raise ConfigError("--colocate", "needs one or more job files")
    jobs = []
    for path in files:
        jobs.append(SharedJob.from_loaded(Path(path).name, load_job(JobRequest(job_file=path))))
    shared = colocate(jobs, gpu=gpu, margin=margin)
    if json_output:
        _print_json(shared.to_dict())
        return
    from memplan.report.fit_text import colocation_table

    _print(colocation_table(shared))
