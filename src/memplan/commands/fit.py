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

from memplan.commands.common import Command as _Command, app, handle_errors, print_json as _print_json, print_rich as _print
from memplan.errors import ConfigError

if TYPE_CHECKING:
    from memplan.fit.colocate import Colocation
    from memplan.fit.results import FitResult
    from memplan.job import Job
    from memplan.model.spec import ModelSpec

_SEARCH, _LAYOUT, _OUT = "Search", "Layout for --max-mbs / --max-seq", "Output"

_EPILOG = """\
Examples:

  memplan fit llama-3.1-70b --gpus 64 --gpu h100-80gb --seq 8192 --gbs 512

  memplan fit deepseek-v3 --gpus 1024 --gpu h100-80gb --top 5 --json

  memplan fit llama-3.1-8b --gpus 8 --max-mbs --tp 2 --recompute selective

  memplan fit llama-3.1-8b --gpus 8 --max-seq --plot seq.png

  memplan fit --colocate job1.yaml job2.yaml --gpu h100-80gb:3g.40gb

A layout fits when its predicted reserved memory is at most the GPU's usable memory minus
--margin. Sizes in GiB = 2^30 bytes. Exit codes: 0 ok, 1 nothing fits (the result, with the
rejected families, is still printed; with --json on stdout) or unsupported input, 2 invalid input.
"""


def _opt(*names: str, help: str, panel: str, metavar: str | None = None) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, metavar=metavar, show_default=False)


@app.command("fit", cls=_Command, epilog=_EPILOG)
def fit_command(
    args: Annotated[list[str] | None, typer.Argument(
        help="MODEL (preset or config.json), or with --colocate the job files.", show_default=False,
        metavar="MODEL | JOB_FILE...")] = None,
    gpus: Annotated[int | None, _opt("--gpus", help="Total GPUs to lay the job out on.", panel=_SEARCH)] = None,
    gpu: Annotated[str, _opt("--gpu", help="GPU (see `memplan gpus`), or GPU:MIG-PROFILE with --colocate. (default: h100-80gb)", panel=_SEARCH, metavar="NAME")] = "h100-80gb",
    seq: Annotated[int, _opt("--seq", help="Sequence length. (default: 4096)", panel=_SEARCH)] = 4096,
    gbs: Annotated[int | None, _opt("--gbs", help="Global batch size in sequences. (default: about 4 Mi tokens, a multiple of --gpus)", panel=_SEARCH)] = None,
    framework: Annotated[str, _opt("--framework", help="megatron|torchtitan|deepspeed|hf. (default: megatron)", panel=_SEARCH)] = "megatron",
    precision: Annotated[str, _opt("--precision", help="Precision word as in `memplan estimate`. (default: bf16-mixed)", panel=_SEARCH)] = "bf16-mixed",
    margin: Annotated[float | None, _opt("--margin", help="Share of usable GPU memory kept free. (default: 0.05)", panel=_SEARCH, metavar="F")] = None,
    gpus_per_node: Annotated[int, _opt("--gpus-per-node", help="GPUs per node: TP and EP stay within one. (default: 8)", panel=_SEARCH)] = 8,
    top: Annotated[int, _opt("--top", help="Candidates shown. (default: 10)", panel=_OUT)] = 10,
    show_all: Annotated[bool, _opt("--all", help="Show every fitting candidate and rejected family.", panel=_OUT)] = False,
    max_mbs: Annotated[bool, _opt("--max-mbs", help="Find the largest micro-batch that fits the layout.", panel=_LAYOUT)] = False,
    max_seq: Annotated[bool, _opt("--max-seq", help="Find the longest sequence that fits the layout.", panel=_LAYOUT)] = False,
    job: Annotated[str | None, _opt("--job", help="Job file giving the layout for --max-mbs / --max-seq.", panel=_LAYOUT, metavar="FILE")] = None,
    tp: Annotated[int | None, _opt("--tp", help="Layout: tensor-parallel size.", panel=_LAYOUT)] = None,
    pp: Annotated[int | None, _opt("--pp", help="Layout: pipeline-parallel size.", panel=_LAYOUT)] = None,
    vpp: Annotated[int | None, _opt("--vpp", help="Layout: virtual pipeline stages.", panel=_LAYOUT)] = None,
    cp: Annotated[int | None, _opt("--cp", help="Layout: context-parallel size.", panel=_LAYOUT)] = None,
    ep: Annotated[int | None, _opt("--ep", help="Layout: expert-parallel size.", panel=_LAYOUT)] = None,
    mbs: Annotated[int | None, _opt("--mbs", help="Layout: micro-batch (for --max-seq).", panel=_LAYOUT)] = None,
    recompute: Annotated[str | None, _opt("--recompute", help="Layout: none|selective|full.", panel=_LAYOUT)] = None,
    plot: Annotated[str | None, _opt("--plot", help="Write the memory curve of --max-mbs/--max-seq as a PNG.", panel=_OUT, metavar="FILE")] = None,
    colocate: Annotated[bool, _opt("--colocate", help="The arguments are job files: can they share one GPU?", panel=_SEARCH)] = False,
    json_output: Annotated[bool, _opt("--json", help="Print the result as JSON (nothing else on stdout).", panel=_OUT)] = False,
) -> None:
    """Find which parallel layouts of MODEL fit --gpus GPUs, fastest first (predicted step time).

    Also: --max-mbs / --max-seq find the largest micro-batch / sequence for one layout, and
    --colocate predicts whether several jobs can share one GPU or MIG slice.
    """
    from memplan.fit.results import FIT_MARGIN

    margin_value = FIT_MARGIN if margin is None else margin
    layout_flags = {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep, "mbs": mbs, "recompute": recompute}
    with handle_errors():
        names = list(args or [])
        if colocate:
            shared = _colocate(names, gpu, margin_value)
            if json_output:
                _print_json(shared.to_dict())
            else:
                from memplan.report.fit_text import colocation_table

                _print(colocation_table(shared))
            return
        if len(names) != 1:
            raise ConfigError("MODEL", "give exactly one model (or --colocate with job files)", " ".join(names) or None)
        if gpus is None:
            raise ConfigError("--gpus", "is required: the number of GPUs to lay the job out on")
        from memplan.model import load_model

        model = load_model(names[0])
        if max_mbs or max_seq:
            _limits(model, names[0], gpus, gpu, seq, gbs, framework, precision, margin_value, gpus_per_node,
                    job, layout_flags, max_mbs, max_seq, plot, json_output)
            return
        if plot is not None:
            raise ConfigError("--plot", "needs --max-mbs or --max-seq")
        from memplan.fit.results import NoFitError

        try:
            result = _search(model, gpus, gpu, seq, gbs, framework, precision, margin_value, gpus_per_node,
                             json_output, None if show_all else top)
        except NoFitError as exc:  # a result, not bad input: show it, then the error line (exit 1)
            _show_fit(exc.result, None if show_all else top, json_output)
            raise
    _show_fit(result, None if show_all else top, json_output)


def _show_fit(result: FitResult, shown: int | None, json_output: bool) -> None:
    if json_output:
        _print_json(result.to_dict(top=shown))
        return
    from memplan.report.fit_text import fit_renderables

    _print(*fit_renderables(result, shown))


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


def _search(model: ModelSpec, gpus: int, gpu: str, seq: int, gbs: int | None, framework: str, precision: str,
            margin: float, gpus_per_node: int, quiet: bool, top: int | None = 1) -> FitResult:
    from memplan.fit.search import fit
    from memplan.fit.space import SearchSpace

    callback, stop = _progress(not quiet)
    try:
        return fit(model, gpus=gpus, gpu=gpu, seq=seq, gbs=gbs, framework=framework,  # type: ignore[arg-type]
                   precision=precision, margin=margin,  # type: ignore[arg-type]
                   space=SearchSpace(gpus_per_node=gpus_per_node), top=top, progress=callback)
    finally:
        stop()


def _layout_job(model: ModelSpec, model_ref: str, gpus: int, gpu: str, seq: int, gbs: int | None, framework: str,
                precision: str, margin: float, gpus_per_node: int, job_file: str | None,
                flags: dict[str, Any]) -> Job:
    """The job whose limits are searched: a job file, the layout flags, or the best fitting layout."""
    from memplan.inputs import JobRequest, load_job
    from memplan.jobflags import build_job

    given = {k: v for k, v in flags.items() if v is not None}
    if job_file is not None:
        return load_job(JobRequest(model=model_ref, flags={**given, "gpus": gpus}, job_file=job_file)).job
    if given:
        dp_ranks = gpus // max(1, (given.get("tp") or 1) * (given.get("pp") or 1) * (given.get("cp") or 1))
        values = {"gpus": gpus, "seq": seq, "gbs": gbs, "framework": framework, "precision": precision,
                  "sequence_parallel": (given.get("tp") or 1) > 1,
                  "distributed_optimizer": framework == "megatron" and dp_ranks > 1, **given}
        return build_job(values)
    best = _search(model, gpus, gpu, seq, gbs, framework, precision, margin, gpus_per_node, True).best
    assert best is not None
    return best.job


def _limits(model: ModelSpec, model_ref: str, gpus: int, gpu: str, seq: int, gbs: int | None, framework: str,
            precision: str, margin: float, gpus_per_node: int, job_file: str | None, flags: dict[str, Any],
            max_mbs: bool, max_seq: bool, plot: str | None, json_output: bool) -> None:
    from memplan.fit.limits import max_micro_batch, max_seq_length, plot_limit

    if max_mbs and max_seq:
        raise ConfigError("--max-mbs", "cannot be combined with --max-seq (search one at a time)")
    job = _layout_job(model, model_ref, gpus, gpu, seq, gbs, framework, precision, margin, gpus_per_node,
                      job_file, flags)
    search = max_micro_batch if max_mbs else max_seq_length
    limit = search(model, job, gpu=gpu, margin=margin)
    if plot is not None:
        plot_limit(limit, plot)
    if json_output:
        from dataclasses import asdict

        _print_json({**limit.to_dict(), "job": asdict(job)})
        return
    from memplan.report.fit_text import limit_renderables

    _print(*limit_renderables(limit, job, plot))


def _colocate(files: list[str], gpu: str, margin: float) -> Colocation:
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
    return colocate(jobs, gpu=gpu, margin=margin)
