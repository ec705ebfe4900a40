"""``memplan trace``: run a training step of a model on fake tensors and report every allocation.

Registered on :data:`memplan.cli.app` when ``"trace"`` is in ``COMMAND_MODULES``. Imports no torch
at module level (the CLI imports this module at start-up); the work happens in
:mod:`memplan.trace`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from memplan.commands.common import (
    EXIT_ERROR,
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
from memplan.dataset.options import dataset_options

__all__ = ["trace_command"]

_RUN, _OUT = "Run", "Output"

_EPILOG = """\
Examples:

  memplan trace gpt2 --seq 1024 --mbs 4 --precision fp32 --device cpu

  memplan trace llama-3.1-8b --seq 2048 --precision bf16 -o llama.mptrace --plot llama.png

  memplan trace path/to/config.json --compare-estimate --json

  memplan trace llama-3.1-8b --fsdp 8 --seq 4096

  memplan trace llama-3.2-1b --tp 2 --recompute full --framework torchtitan

  memplan trace --script train.py:make_job --device cuda

Sizes are GiB = 2^30 bytes. Exit codes: 0 ok, 1 unsupported model/operator or failing script, 2 invalid input.
"""


def _progress(enabled: bool) -> Any:
    def say(message: str) -> None:
        if enabled:
            typer.secho(f"memplan trace: {message} ...", err=True, dim=True)

    return say


@app.command("trace", cls=_Command, epilog=_EPILOG)
@job_options()
@dataset_options()
def trace_command(
    model: Annotated[str | None, typer.Argument(help="Preset name or path to a Hugging Face config.json / its folder "
                                                "(omit with --script).", show_default=False, metavar="MODEL")] = None,
    script: Annotated[str | None, option("--script", help="FILE.py:FUNCTION returning (model, batch, optimizer, loss_fn); FUNCTION(ctx) receives the job these flags describe (docs/trace.md).", panel=_RUN, metavar="FILE:FUNC")] = None,
    device: Annotated[str, option("--device", help="cuda: account as the CUDA caching allocator would; cpu: as a CPU run. (default: cuda)", panel=_RUN)] = "cuda",
    iterations: Annotated[int, option("--iterations", help="Training iterations to run. (default: 2)", panel=_RUN)] = 2,
    hf_args: Annotated[str | None, option("--hf-args", help=HF_ARGS_HELP, panel=_RUN, metavar="FILE")] = None,
    peft_config: Annotated[str | None, option("--peft-config", help=PEFT_CONFIG_HELP, panel=_RUN, metavar="FILE")] = None,
    torchtitan: Annotated[str | None, option("--torchtitan", help="Trace torchtitan's own model, parallelize and optimizer code for this training TOML (needs torchtitan 0.2.x: pip install 'memplan\\[torchtitan]'); the file is the job, only --gpus may stand beside it.", panel=_RUN, metavar="FILE.toml")] = None,
    torchtitan_config: Annotated[str | None, option("--torchtitan-config", help=TORCHTITAN_CONFIG_HELP + " Traces MODEL's Hugging Face modules under that job, not torchtitan's model code.", panel=_RUN, metavar="FILE")] = None,
    moe_routing: Annotated[str, option("--moe-routing", help="balanced: static, evenly balanced MoE routing; error: refuse data-dependent routing. (default: balanced)", panel=_RUN)] = "balanced",
    output: Annotated[str | None, option("-o", "--output", help="Write the trace (binary; gzip JSON lines for a .jsonl or .jsonl.gz path; see memplan.events).", panel=_OUT, metavar="FILE")] = None,
    snapshot: Annotated[str | None, option("--snapshot", help="Write a PyTorch memory-snapshot pickle (pytorch.org/memory_viz).", panel=_OUT, metavar="FILE")] = None,
    plot: Annotated[str | None, option("--plot", help="Write a PNG of live memory by category over the op index.", panel=_OUT, metavar="PNG")] = None,
    top: Annotated[int, option("--top", help="Modules listed in the by-module breakdown. (default: 10)", panel=_OUT)] = 10,
    compare_estimate: Annotated[bool, option("--compare-estimate", help="Also run memplan estimate on the same job and show both, category by category.", panel=_OUT)] = False,
    json_output: Annotated[bool, option("--json", help="Print the summary as JSON (nothing else on stdout).", panel=_OUT)] = False,
    debug: Annotated[bool, option("--debug", help="Show the full traceback of any failure.", panel=_OUT)] = False,
    job_flags: dict[str, Any] | None = None,
    dataset_flags: dict[str, Any] | None = None,
) -> None:
    """Trace a training step of MODEL on fake tensors: peak memory by category, module and phase.

    Runs forward, backward and optimizer.step() for --iterations iterations with no weights and
    no GPU, recording every storage allocation and free with its bytes, operator, module, phase
    and category. The job flags are memplan estimate's; the framework is hf unless given.
    """
    with handle_errors(), _unexpected(debug):
        from memplan.errors import ConfigError
        from memplan.trace.api import trace_job
        from memplan.trace.setup import trace_setup

        if sum(x is not None for x in (model, script, torchtitan)) != 1:
            raise ConfigError("MODEL", "give exactly one of MODEL, --script FILE.py:FUNCTION or --torchtitan FILE.toml")
        if top < 0:
            raise ConfigError("--top", "must be >= 0", top)
        if compare_estimate and script is not None:
            raise ConfigError("--compare-estimate", "needs a MODEL preset or config.json (not --script)")
        for flag, path in (("--output", output), ("--snapshot", snapshot), ("--plot", plot)):
            check_output_path(flag, path)
        if plot is not None:
            _require_matplotlib()
        if torchtitan is not None:
            result, comparison, settings = _trace_torchtitan(torchtitan, job_flags or {}, (hf_args, peft_config,
                                                             torchtitan_config), device, iterations, moe_routing,
                                                             top, compare_estimate)
            _write_outputs(result, output, snapshot, plot)
            _render(result, comparison, json_output, settings)
            return
        base, settings = _dialect_job(model, job_flags or {}, hf_args, peft_config, torchtitan_config)
        setup = trace_setup(base, **(job_flags or {}), device=device, iterations=iterations, moe_routing=moe_routing)
        if dataset_flags:
            _trace_dataset(model, setup, dataset_flags, (hf_args, peft_config, torchtitan_config), json_output,
                           (output, snapshot, plot, compare_estimate))
            return
        target: Any = model if script is None else _load_script(script, setup)
        result = trace_job(target, setup, top=top, progress=_progress(True))
        settings = settings + _traced_compile_settings(setup)
        comparison = None
        if compare_estimate:
            from memplan.trace.compare import compare_with_estimate

            comparison = compare_with_estimate(model or "", setup, result.summary)
        _write_outputs(result, output, snapshot, plot)
    _render(result, comparison, json_output, settings)


def _trace_torchtitan(path: str, flags: dict[str, Any], dialects: tuple[str | None, ...], device: str,
                     iterations: int, moe_routing: str, top: int, compare_estimate: bool) -> tuple[Any, Any, Any]:
    """``--torchtitan FILE``: torchtitan's own code for the job in the file (:mod:`memplan.trace.runners.torchtitan`)."""
    from memplan.errors import ConfigError
    from memplan.trace.api import trace_job
    from memplan.trace.runners.torchtitan_setup import torchtitan_setup

    if any(d is not None for d in dialects):
        raise ConfigError("--torchtitan", "the TOML is the whole job: leave out --hf-args, --peft-config and "
                          "--torchtitan-config")
    target, setup, settings = torchtitan_setup(path, flags, device=device, iterations=iterations,
                                               moe_routing=moe_routing)
    result = trace_job(target, setup, top=top, progress=_progress(True))
    comparison = None
    if compare_estimate:
        from memplan.trace.compare import compare_with_estimate

        comparison = compare_with_estimate(target.model_spec, setup, result.summary)
    return result, comparison, settings


def _dialect_job(model: str | None, flags: dict[str, Any], hf_args: str | None,
                 peft_config: str | None, torchtitan_config: str | None = None) -> tuple[Any, tuple[Any, ...]]:
    """The job ``--hf-args`` / ``--peft-config`` / ``--torchtitan-config`` describe (None without
    them) and their settings."""
    if hf_args is None and peft_config is None and torchtitan_config is None:
        return None, ()
    from dataclasses import replace

    from memplan.errors import ConfigError
    from memplan.inputs import JobRequest, load_job
    from memplan.job import Job
    from memplan.trace.setup import DEFAULT_TRACE_FRAMEWORK

    if model is None:
        raise ConfigError("--hf-args/--peft-config/--torchtitan-config", "need a MODEL (not --script)")
    base = Job(framework=DEFAULT_TRACE_FRAMEWORK) if flags.get("framework") is None else Job()
    loaded = load_job(JobRequest(model=model, flags=flags, hf_args=hf_args, peft_config=peft_config,
                                 torchtitan_config=torchtitan_config), base=base)
    # MODEL's Hugging Face modules are traced (and priced), not torchtitan's own model code
    return replace(loaded.job, torchtitan_model=False), loaded.settings


def _trace_dataset(model: str | None, setup: Any, flags: dict[str, Any], dialects: tuple[str | None, ...],
                   json_output: bool, others: tuple[Any, ...]) -> None:
    """``--dataset``: every distinct step shape of the dataset traced; the per-step peaks."""
    from memplan.dataset.traced import trace_dataset
    from memplan.errors import ConfigError

    if model is None:
        raise ConfigError("--dataset", "needs a MODEL preset or config.json (not --script or --torchtitan)")
    if any(others):
        raise ConfigError("--dataset", "traces many steps; -o, --snapshot, --plot and --compare-estimate trace one")
    section = trace_dataset(model, setup, flags, dialects,  # type: ignore[arg-type]
                            progress=_progress(not json_output))
    if json_output:
        _print_json({"model": model, "device": setup.device, "dataset": section})
        return
    gib = 1 << 30
    worst = section["worst_step_shape"]
    typer.echo(f"{section['examples']} examples, {section['steps']} steps (--batching {section['batching']}), "
               f"{section['distinct_shapes']} distinct shapes traced on {setup.device}")
    typer.echo(f"worst step #{section['worst_step']}: {worst['batch_size']} x {worst['seq_length']}, peak "
               f"{section['worst_peak_allocated_bytes'] / gib:.3f} GiB")


def _require_matplotlib() -> None:
    """``--plot`` needs matplotlib: say so before the trace runs, not after."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from memplan.errors import MissingDependencyError

        raise MissingDependencyError("matplotlib", feature="--plot (the timeline PNG)", extra="plot")


def _load_script(spec: str, setup: Any) -> Any:
    from memplan.trace.script import check_script_flags, load_script_function

    function = load_script_function(spec)
    check_script_flags(function, setup)
    return function


def _write_outputs(result: Any, output: str | None, snapshot: str | None, plot: str | None) -> None:
    from memplan.errors import ConfigError

    import os

    def wrote(what: str, path: str) -> None:  # on stderr: stdout stays the summary (or the --json document)
        typer.secho(f"wrote {what} {path} ({os.path.getsize(path):,} bytes)", err=True)

    try:
        if output:
            from memplan.events import write_trace

            write_trace(result.trace, output)
            wrote(f"the trace ({len(result.trace.events):,} events) to", output)
        if snapshot:
            from memplan.trace.snapshot import write_snapshot

            write_snapshot(result.trace, snapshot)
            wrote("the snapshot to", snapshot)
        if plot:
            from memplan.trace.plot import plot_timeline

            plot_timeline(result.trace, plot, title=f"memplan trace {result.model}")
            wrote("the plot to", plot)
    except OSError as exc:
        raise ConfigError("output file", f"cannot be written ({exc.strerror})", exc.filename) from None


def _traced_compile_settings(setup: Any) -> tuple[Any, ...]:
    """``--compile`` under a framework that compiles the whole model: the tracer compiles the decoder layers
    only, and says so (never silent)."""
    from memplan.profiles import get_profile
    from memplan.settings import InputSetting

    from memplan.estimate.compiled_loss import job_compiles_loss

    profile = get_profile(setup.job.framework)
    if not setup.job.compile or profile.compile_scope != "model":
        return ()
    parts = ("the embedding, final norm and head" if job_compiles_loss(setup.job, profile) and setup.job.loss in
             ("auto", "fp32-logits", "chunked") else "the embedding, final norm, head and loss")
    return (InputSetting(source="--compile", key="compiled model", value=True, effect="not-modelled",
                         note=f"the decoder layers (and a compiled loss) run as the partitioner's graphs; {parts}, "
                              "which the framework compiles too, are traced eagerly"),)


def _render(result: Any, comparison: Any, json_output: bool, settings: tuple[Any, ...] = ()) -> None:
    if json_output:
        from memplan.settings import settings_dict

        data = {**result.to_dict(), **settings_dict(settings)}
        if comparison is not None:
            data["compare_estimate"] = comparison.to_dict()
        _print_json(data)
        return
    from rich.console import Console

    from memplan.report.trace_text import render_comparison, render_compiled, render_summary

    console = Console(highlight=False)
    console.print(render_summary(result.model, result.summary))
    if result.compiled_layers:
        console.print()
        console.print(render_compiled(result.compiled_layers))
    if comparison is not None:
        console.print()
        console.print(render_comparison(comparison))
    print_unmodelled(settings)


@contextmanager
def _unexpected(debug: bool) -> Iterator[None]:
    """Turn a non-memplan exception into one line and exit 1 unless ``--debug`` asks for the traceback."""
    from memplan.errors import MemplanError, MissingDependencyError

    try:
        yield
    except (MemplanError, typer.Exit, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, ModuleNotFoundError) and exc.name in ("torch", "transformers", "numpy"):
            raise MissingDependencyError(exc.name, feature="memplan trace", extra="trace") from None
        first = (str(exc).strip().splitlines() or [""])[0]
        typer.secho(f"error: trace failed: {type(exc).__name__}: {first} (rerun with --debug for the traceback)",
                    fg="red", err=True)
        sys.stderr.flush()
        raise typer.Exit(EXIT_ERROR) from None
