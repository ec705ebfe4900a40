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

from memplan.cli import EXIT_ERROR, _Command, _print_json, app, handle_errors

__all__ = ["trace_command"]

_JOB, _RANKS, _OUT = "Job", "Simulated ranks", "Output"

_EPILOG = """\
Examples:

  memplan trace gpt2 --seq 1024 --mbs 4 --precision fp32 --device cpu

  memplan trace llama-3.1-8b --seq 2048 --precision bf16 -o llama.mptrace --plot llama.png

  memplan trace path/to/config.json --compare-estimate --json

  memplan trace llama-3.1-8b --fsdp 8 --seq 4096

  memplan trace --script train.py:make_job --device cuda

Sizes are GiB = 2^30 bytes. Exit codes: 0 ok, 1 unsupported model/operator or failing script, 2 invalid input.
"""


def _opt(*names: str, help: str, panel: str, metavar: str | None = None) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, metavar=metavar, show_default=False)


def _progress(enabled: bool) -> Any:
    def say(message: str) -> None:
        if enabled:
            typer.secho(f"memplan trace: {message} ...", err=True, dim=True)

    return say


@app.command("trace", cls=_Command, epilog=_EPILOG)
def trace_command(
    model: Annotated[str | None, typer.Argument(help="Preset name or path to a Hugging Face config.json / its folder "
                                                "(omit with --script).", show_default=False, metavar="MODEL")] = None,
    seq: Annotated[int, _opt("--seq", help="Sequence length in tokens. (default: 4096)", panel=_JOB)] = 4096,
    mbs: Annotated[int, _opt("--mbs", help="Micro-batch size. (default: 1)", panel=_JOB)] = 1,
    precision: Annotated[str, _opt("--precision", help="fp32|bf16|fp16|bf16-mixed|fp16-mixed. (default: bf16-mixed)", panel=_JOB)] = "bf16-mixed",
    optimizer: Annotated[str, _opt("--optimizer", help="adamw|adam|sgd. (default: adamw)", panel=_JOB)] = "adamw",
    optimizer_impl: Annotated[str, _opt("--optimizer-impl", help="auto|foreach|fused|for-loop; auto = foreach on cuda, for-loop on cpu. (default: auto)", panel=_JOB)] = "auto",
    momentum: Annotated[float, _opt("--momentum", help="SGD momentum. (default: 0)", panel=_JOB)] = 0.0,
    recompute: Annotated[str, _opt("--recompute", help="none|selective|full. (default: none)", panel=_JOB)] = "none",
    attention: Annotated[str, _opt("--attention", help="sdpa|eager. (default: sdpa)", panel=_JOB)] = "sdpa",
    dropout: Annotated[float, _opt("--dropout", help="Dropout probability set on the model config. (default: 0)", panel=_JOB)] = 0.0,
    device: Annotated[str, _opt("--device", help="cuda: account as the CUDA caching allocator would; cpu: as a CPU run. (default: cuda)", panel=_JOB)] = "cuda",
    iterations: Annotated[int, _opt("--iterations", help="Training iterations to run. (default: 2)", panel=_JOB)] = 2,
    moe_routing: Annotated[str, _opt("--moe-routing", help="balanced: static, evenly balanced MoE routing; error: refuse data-dependent routing. (default: balanced)", panel=_JOB)] = "balanced",
    script: Annotated[str | None, _opt("--script", help="FILE.py:FUNCTION returning (model, batch, optimizer, loss_fn).", panel=_JOB, metavar="FILE:FUNC")] = None,
    fsdp: Annotated[int, _opt("--fsdp", help="Simulated FSDP2 ranks (fully_shard per block + root). (default: 1)", panel=_RANKS)] = 1,
    tp: Annotated[int, _opt("--tp", help="Simulated tensor-parallel ranks (DTensor plan for Llama-style blocks). (default: 1)", panel=_RANKS)] = 1,
    output: Annotated[str | None, _opt("-o", "--output", help="Write the trace (gzip JSON lines, see memplan.events).", panel=_OUT, metavar="FILE")] = None,
    snapshot: Annotated[str | None, _opt("--snapshot", help="Write a PyTorch memory-snapshot pickle (pytorch.org/memory_viz).", panel=_OUT, metavar="FILE")] = None,
    plot: Annotated[str | None, _opt("--plot", help="Write a PNG of live memory by category over the op index.", panel=_OUT, metavar="PNG")] = None,
    top: Annotated[int, _opt("--top", help="Modules listed in the by-module breakdown. (default: 10)", panel=_OUT)] = 10,
    compare_estimate: Annotated[bool, _opt("--compare-estimate", help="Also run memplan estimate (hf profile) and show both.", panel=_OUT)] = False,
    json_output: Annotated[bool, _opt("--json", help="Print the summary as JSON (nothing else on stdout).", panel=_OUT)] = False,
    debug: Annotated[bool, _opt("--debug", help="Show the full traceback of any failure.", panel=_OUT)] = False,
) -> None:
    """Trace a training step of MODEL on fake tensors: peak memory by category, module and phase.

    Runs forward, backward and optimizer.step() for --iterations iterations with no weights and
    no GPU, recording every storage allocation and free with its bytes, operator, module, phase
    and category (parameter, gradient, optimizer_state, activation, logits, temporary, input, buffer).
    """
    with handle_errors(), _unexpected(debug):
        from memplan.errors import ConfigError

        if (model is None) == (script is None):
            raise ConfigError("MODEL", "give exactly one of MODEL or --script FILE.py:FUNCTION")
        if top < 0:
            raise ConfigError("--top", "must be >= 0", top)
        if compare_estimate and script is not None:
            raise ConfigError("--compare-estimate", "needs a MODEL preset or config.json (not --script)")
        from memplan.trace.api import trace_job
        from memplan.trace.options import TraceOptions

        options = TraceOptions(seq=seq, mbs=mbs, precision=precision, optimizer=optimizer,  # type: ignore[arg-type]
                               optimizer_impl=optimizer_impl, momentum=momentum, recompute=recompute,  # type: ignore[arg-type]
                               attention=attention, dropout=dropout, device=device, fsdp=fsdp, tp=tp,  # type: ignore[arg-type]
                               iterations=iterations, moe_routing=moe_routing)  # type: ignore[arg-type]
        target: Any = model
        if script is not None:
            from memplan.trace.script import load_script_function

            target = load_script_function(script)
        result = trace_job(target, options, top=top, progress=_progress(True))
        comparison = None
        if compare_estimate:
            from memplan.trace.compare import compare_with_estimate

            comparison = compare_with_estimate(model or "", options, result.summary)
        _write_outputs(result, output, snapshot, plot)
    _render(result, comparison, json_output)


def _write_outputs(result: Any, output: str | None, snapshot: str | None, plot: str | None) -> None:
    from memplan.errors import ConfigError

    try:
        if output:
            from memplan.events import write_trace

            write_trace(result.trace, output)
        if snapshot:
            from memplan.trace.snapshot import write_snapshot

            write_snapshot(result.trace, snapshot)
        if plot:
            from memplan.trace.plot import plot_timeline

            plot_timeline(result.trace, plot, title=f"memplan trace {result.model}")
    except OSError as exc:
        raise ConfigError("output file", f"cannot be written ({exc.strerror})", exc.filename) from None


def _render(result: Any, comparison: Any, json_output: bool) -> None:
    if json_output:
        data = result.to_dict()
        if comparison is not None:
            data["compare_estimate"] = comparison.to_dict()
        _print_json(data)
        return
    from rich.console import Console

    from memplan.trace.report import render_comparison, render_summary

    console = Console(highlight=False)
    console.print(render_summary(result.model, result.summary))
    if comparison is not None:
        console.print()
        console.print(render_comparison(comparison))


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
