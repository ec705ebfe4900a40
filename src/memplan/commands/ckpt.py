"""``memplan ckpt``: input-aware activation checkpointing — the benchmark and per-block profiles.

Registered on :data:`memplan.cli.app` when imported (listed in ``COMMAND_MODULES``). torch,
transformers and numpy are imported inside the commands only, so ``memplan estimate`` starts fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from memplan.commands.common import Command as _Command
from memplan.commands.common import check_output_path, command_group, handle_errors
from memplan.commands.common import print_json as _print_json
from memplan.commands.common import print_rich as _print
from memplan.errors import ConfigError

__all__ = ["ckpt_app"]

ckpt_app = command_group(
    "ckpt", "Input-aware activation checkpointing under a memory budget (Mimose): benchmark and profiles.")

_BENCH_EPILOG = """\
Examples:

  memplan ckpt bench                       # the full benchmark: 30M GPT-2, about 30 minutes of CPU

  memplan ckpt bench --quick               # a tiny model, seconds (a smoke test, targets not meant to be met)

  memplan ckpt bench --steps 24 --repeats 5 --json --output results.json

Variants: none / full (every block, HF activation checkpointing) in a plain loop; memplan's auto_checkpoint in a plain loop, with step(), and under an unchanged transformers.Trainer (against trainer-full). Memory by an independent whole-step meter. MiB = 2^20 bytes.

Exit codes: 0 ok, 1 error, 2 invalid input.
"""

_PROFILE_EPILOG = """\
Examples:

  memplan ckpt profile gpt2

  memplan ckpt profile path/to/config.json --sizes 128,256,512,1024 --batch 2

  memplan ckpt profile llama-3.2-1b --layers 1 --sizes 64,128,256 --json

Builds the model with transformers from its config (random weights, nothing downloaded) with --layers layers (identical blocks share predictors), runs one training step per size on CPU and prints each predictor; sizes s are tokens (batch x length).

Exit codes: 0 ok, 1 error, 2 invalid input.
"""


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value <= 0:
        raise ConfigError(flag, "must be a positive integer", value)


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(n <= 0 for n in sizes):
        raise ConfigError("--sizes", "must be comma-separated positive sequence lengths such as 64,128,256", text)
    return sizes


@ckpt_app.command("bench", cls=_Command, epilog=_BENCH_EPILOG)
def bench_command(
    quick: Annotated[bool, typer.Option("--quick", help="A tiny model and a few steps (seconds).")] = False,
    steps: Annotated[int | None, typer.Option("--steps", help="Training steps per run. (default: 24)", show_default=False)] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="Interleaved repetitions of the timed variants. (default: 3)", show_default=False)] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of lengths, tokens and weights. (default: 0)", show_default=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the full result as JSON (nothing else on stdout).")] = False,
    output: Annotated[str | None, typer.Option("--output", help="Also write the JSON result to this file.", metavar="FILE")] = None,
) -> None:
    """Benchmark memplan (plain loop, step(), Trainer) against full checkpointing on variable-length batches (CPU)."""
    with handle_errors():
        _positive(steps, "--steps")
        _positive(repeats, "--repeats")
        if seed is not None and not 0 <= seed < 2**63:
            raise ConfigError("--seed", "must be a non-negative integer below 2**63 (numpy and torch seeds)", seed)
        check_output_path("--output", output)
        from memplan.ckpt.bench import BenchConfig, run_bench, with_overrides

        base = BenchConfig.quick() if quick else BenchConfig()
        cfg = with_overrides(base, steps=steps, repeats=repeats, seed=seed)
        progress = None if json_output else (lambda msg: typer.echo(msg, err=True))
        result = run_bench(cfg, progress=progress)
        data = result.to_dict()
        if output is not None:
            Path(output).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if json_output:
        _print_json(data)
        return
    from memplan.report.ckpt_text import bench_tables

    _print(bench_tables(result))


@ckpt_app.command("profile", cls=_Command, epilog=_PROFILE_EPILOG)
def profile_command(
    model: Annotated[str, typer.Argument(help="Preset name (see `memplan models`) or a Hugging Face config.json / its folder.", metavar="MODEL")],
    sizes: Annotated[str, typer.Option("--sizes", help="Sequence lengths to measure, comma-separated.")] = "64,128,256,512",
    batch: Annotated[int, typer.Option("--batch", help="Sequences per batch.")] = 1,
    layers: Annotated[int, typer.Option("--layers", help="Layers to build (0: all; identical blocks share predictors).")] = 2,
    json_output: Annotated[bool, typer.Option("--json", help="Print the profile as JSON.")] = False,
) -> None:
    """Measure MODEL's per-block activation bytes and forward time at several sizes, and fit predictors."""
    with handle_errors():
        lengths = _parse_sizes(sizes)
        from memplan.ckpt.profile import profile_model

        result = profile_model(model, seq_lengths=lengths, batch_size=batch, layers=layers)
    if json_output:
        _print_json(result.to_dict())
        return
    from memplan.report.ckpt_text import profile_table

    _print(profile_table(result))
