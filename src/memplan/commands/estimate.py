"""``memplan estimate``, ``memplan models`` and ``memplan gpus``: the estimator and its catalogues.

A thin client: the job options come from the Job's declarations (:func:`job_options`), the input
dialects are resolved by :func:`memplan.inputs.load_job`, the maths is :func:`memplan.estimate`
and the tables are :mod:`memplan.report.text`.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from memplan.commands.common import (
    HF_ARGS_HELP,
    PEFT_CONFIG_HELP,
    TORCHTITAN_CONFIG_HELP,
    Command,
    app,
    check_output_path,
    handle_errors,
    job_options,
    option,
    print_json,
    print_rich,
    print_unmodelled,
)
from memplan.dataset.options import dataset_options

__all__ = ["estimate_command", "gpus_command", "models_command"]

_OUT = "Inputs and output"

_EPILOG = """\
Examples:

  memplan estimate llama-3.1-8b --gpus 8 --gpu h100-80gb

  memplan estimate llama-3.1-70b --gpus 64 --tp 8 --pp 4 --distributed-optimizer --gbs 512

  memplan estimate path/to/config.json --framework torchtitan --fsdp full --gpus 16

  memplan estimate --megatron-args train_args.sh --gpus 128 --json

  memplan estimate mistral-7b --gpus 8 --deepspeed-config ds_config.json --explain

  memplan estimate meta-llama/Llama-3.2-3B --hf-args training_args.json --peft-config adapter_config.json

  memplan estimate --torchtitan-config llama3_8b.toml --gpus 64

  memplan estimate --job llama-70b.yaml --seq 16384 --save-job llama-70b-16k.yaml

  memplan estimate deepseek-v3 --gpus 1024 --tp 2 --pp 16 --ep 8 --fp8 hybrid --mtp-layers 1

  memplan estimate ./my-model --dataset train.jsonl --messages-field messages --mbs 4 --gpu a100-40gb

All sizes are GiB = 2^30 bytes. Exit codes: 0 ok, 1 unsupported input, 2 invalid input.
"""


@app.command("estimate", cls=Command, epilog=_EPILOG)
@job_options()
@dataset_options(plot=True)
def estimate_command(
    model: Annotated[str | None, typer.Argument(
        help="Preset name (see `memplan models`), path to a Hugging Face config.json / its folder, or a "
        "Hub id ORG/NAME[@REV] (its config.json only, from the cache first). Optional with --megatron-args, --job, "
        "--torchtitan-config or --hf-args naming model_name_or_path.", show_default=False, metavar="MODEL")] = None,
    gpu: Annotated[str | None, option("--gpu", help="GPU to check the fit against (see `memplan gpus`).", panel=_OUT, metavar="NAME")] = None,
    fragmentation: Annotated[float | None, option("--fragmentation", help="Assumed allocator fragmentation fraction. (default: 0.10)", panel=_OUT, metavar="F")] = None,
    megatron_args: Annotated[str | None, option("--megatron-args", help="File with a Megatron-LM launch command line or args mapping.", panel=_OUT, metavar="FILE")] = None,
    deepspeed_config: Annotated[str | None, option("--deepspeed-config", help="DeepSpeed JSON config applied to the job.", panel=_OUT, metavar="FILE")] = None,
    hf_args: Annotated[str | None, option("--hf-args", help=HF_ARGS_HELP, panel=_OUT, metavar="FILE")] = None,
    peft_config: Annotated[str | None, option("--peft-config", help=PEFT_CONFIG_HELP, panel=_OUT, metavar="FILE")] = None,
    torchtitan_config: Annotated[str | None, option("--torchtitan-config", help=TORCHTITAN_CONFIG_HELP, panel=_OUT, metavar="FILE")] = None,
    job_file: Annotated[str | None, option("--job", help="YAML/JSON job file whose fields are these flags' names (flags typed here win).", panel=_OUT, metavar="FILE")] = None,
    save_job: Annotated[str | None, option("--save-job", help="Write the resolved job as a YAML/JSON job file.", panel=_OUT, metavar="FILE")] = None,
    explain: Annotated[bool, option("--explain", help="Also print the numbered assumptions.", panel=_OUT)] = False,
    json_output: Annotated[bool, option("--json", help="Print Estimate.to_dict() as JSON (nothing else on stdout).", panel=_OUT)] = False,
    job_flags: dict[str, Any] | None = None,
    dataset_flags: dict[str, Any] | None = None,
) -> None:
    """Estimate the per-GPU peak memory of training MODEL, for every pipeline stage.

    Prints a table per pipeline stage (GiB = 2^30 bytes): parameters, gradients, optimizer
    states, activations, logits, buffers, peak allocated and predicted reserved memory.
    """
    with handle_errors():
        from memplan.documents import estimate_document, estimate_loaded
        from memplan.inputs import JobRequest, load_job

        check_output_path("--save-job", save_job)
        loaded = load_job(JobRequest(model=model, flags=job_flags or {}, job_file=job_file, gpu=gpu,
                                     fragmentation=fragmentation, megatron_args=megatron_args,
                                     deepspeed_config=deepspeed_config, hf_args=hf_args,
                                     peft_config=peft_config, torchtitan_config=torchtitan_config))
        peaks = None
        if dataset_flags:
            from memplan.dataset.options import estimate_with_dataset

            check_output_path("--plot", dataset_flags.get("plot"))
            result, document, peaks = estimate_with_dataset(loaded, dataset_flags)
        elif json_output:
            result, document = estimate_document(loaded)
        else:  # the tables only: no JSON document to build
            result, document = estimate_loaded(loaded), None
        if save_job is not None:
            _save_job(loaded, save_job)
    if json_output:
        print_json(document)
        return
    from memplan.report.text import render_estimate

    print_rich(render_estimate(result, explain=explain))
    if peaks is not None:
        from memplan.dataset.render import render_peaks

        print_rich(render_peaks(peaks, document["dataset"].get("images")))
    elif result.fits is False and loaded.gpu is not None:
        _print_cheapest_fit(loaded)
    print_unmodelled(result.settings)


def _print_cheapest_fit(loaded: Any) -> None:
    """The cheapest change (or combination of changes) that makes a job fit, as ``memplan doctor`` verifies them."""
    from memplan.doctor.job_fixes import cheapest_fit
    from memplan.doctor.words import format_bytes
    from memplan.frameworks.native_fix import native_lines

    with handle_errors():
        fix = cheapest_fit(loaded, loaded.gpu)
    if fix is None:
        typer.secho("No change of the job (micro-batch, recompute, sharding, offload, chunked loss, up to three "
                    "of them together; LoRA/QLoRA with one) makes it fit; try more GPUs (memplan fit).", fg="yellow")
        return
    cost = f", step {100 * fix.cost:+.0f}%" if fix.step_time_s is not None and fix.base_step_time_s else ""
    typer.secho(f"To fit: {fix.setting} ({fix.action}: {format_bytes(fix.peak_bytes)} reserved within the "
                f"{format_bytes(fix.limit_bytes)} limit{cost}; the cheapest of memplan doctor's job fixes).",
                fg="green")
    for line in native_lines(fix.native):
        typer.secho(f"  {line}", fg="green" if not line.startswith("(") else None)


def _reloaded(path: Any) -> Any:
    """The Job of the job file at ``path`` as ``--job`` loads it (None when it does not load)."""
    from memplan.errors import ConfigError
    from memplan.inputs import JobRequest, load_job

    try:
        return load_job(JobRequest(job_file=str(path))).job
    except ConfigError:
        return None


def _save_job(loaded: Any, path: str) -> None:
    from memplan.jobfile import dump_job_file

    for name in dump_job_file(loaded.model_ref, loaded.job, path, gpu=loaded.gpu, fragmentation=loaded.fragmentation,
                              megatron_args=loaded.megatron_args, deepspeed_config=loaded.deepspeed_config,
                              hf_args=loaded.hf_args, peft_config=loaded.peft_config,
                              torchtitan_config=loaded.torchtitan_config, reload=_reloaded):
        typer.secho(f"warning: --save-job: {name} has no flag and was not written", fg="yellow", err=True)


@app.command("models", cls=Command, epilog="Examples:\n\n  memplan models\n\n  memplan models --json")
def models_command(
    json_output: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
) -> None:
    """List the shipped model presets (name, type, parameters, layers, hidden size, MoE)."""
    if json_output:
        from memplan.documents import models_document

        with handle_errors():
            print_json(models_document())
        return
    with handle_errors():
        from memplan.model import list_presets

        presets = list_presets()
    from memplan.report.text import presets_table

    print_rich(presets_table(presets))


@app.command("gpus", cls=Command, epilog="Examples:\n\n  memplan gpus\n\n  memplan gpus --json")
def gpus_command(
    json_output: Annotated[bool, typer.Option("--json", help="Print the catalogue as JSON.")] = False,
) -> None:
    """List the GPU catalogue: memory the driver reports and what PyTorch's allocator can use."""
    if json_output:
        from memplan.documents import gpus_document

        print_json(gpus_document())
        return
    from memplan.gpus import list_gpus
    from memplan.report.text import gpus_table

    print_rich(gpus_table(list_gpus()))
