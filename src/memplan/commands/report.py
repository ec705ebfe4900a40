"""``memplan report``: one self-contained HTML file (per-stage breakdown, fit table, timeline, segments).

The timeline and the segment view come from ``--trace`` (a memplan trace or a CUDA memory
snapshot, see :mod:`memplan.report.trace_data`) or as plain JSON files: ``--timeline`` holds ``[[op_index, {"category": bytes, ...}], ...]`` and
``--segments`` holds ``[{"address": int, "size": int, "blocks": [{"offset": int, "size": int,
"allocated": bool, "category": str}]}, ...]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.commands.common import (
    HF_ARGS_HELP,
    PEFT_CONFIG_HELP,
    TORCHTITAN_CONFIG_HELP,
    app,
    check_output_path,
    handle_errors,
    job_options,
)
from memplan.commands.common import Command as _Command
from memplan.commands.common import print_unmodelled as _print_unmodelled
from memplan.dataset.options import dataset_options
from memplan.errors import ConfigError

_JOB, _OUT = "Job (or --job FILE)", "Report"

_EPILOG = """\
Examples:

  memplan report llama-3.1-70b --gpus 64 --tp 8 --pp 2 --gbs 512 --gpu h100-80gb -o report.html

  memplan report --job llama-70b.yaml --fit -o report.html

  memplan report llama-3.1-8b --gpus 8 -o report.html --json

  memplan report llama-3.1-8b --gpus 8 --timeline timeline.json --segments segments.json -o report.html

  memplan trace gpt2 --seq 1024 -o gpt2.mptrace && memplan report gpt2 --trace gpt2.mptrace -o report.html

The file needs no network: styles, scripts and charts (SVG) are inline.
Exit codes: 0 ok, 1 unsupported input, 2 invalid input.
"""


def _opt(*names: str, help: str, panel: str, metavar: str | None = None) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, metavar=metavar, show_default=False)


@app.command("report", cls=_Command, epilog=_EPILOG)
@job_options()
@dataset_options()
def report_command(
    model: Annotated[str | None, typer.Argument(help="Preset name or config.json (optional with --job).",
                                                show_default=False, metavar="MODEL")] = None,
    output: Annotated[str, _opt("-o", "--output", help="HTML file to write.", panel=_OUT, metavar="FILE")] = "report.html",
    job_file: Annotated[str | None, _opt("--job", help="Job file (fields as memplan estimate's flags).", panel=_JOB, metavar="FILE")] = None,
    hf_args: Annotated[str | None, _opt("--hf-args", help=HF_ARGS_HELP, panel=_JOB, metavar="FILE")] = None,
    peft_config: Annotated[str | None, _opt("--peft-config", help=PEFT_CONFIG_HELP, panel=_JOB, metavar="FILE")] = None,
    torchtitan_config: Annotated[str | None, _opt("--torchtitan-config", help=TORCHTITAN_CONFIG_HELP, panel=_JOB, metavar="FILE")] = None,
    gpu: Annotated[str | None, _opt("--gpu", help="GPU to check the fit against. (default: h100-80gb)", panel=_JOB, metavar="NAME")] = None,
    with_fit: Annotated[bool, _opt("--fit", help="Also search the layouts that fit (memplan fit) and add the table.", panel=_OUT)] = False,
    trace_file: Annotated[str | None, _opt("--trace", help="A memplan trace (memplan trace -o) or a CUDA memory snapshot: adds the timeline by category and the simulated allocator's segments at peak reserved.", panel=_OUT, metavar="FILE")] = None,
    timeline: Annotated[str | None, _opt("--timeline", help="JSON memory timeline by category (plain data).", panel=_OUT, metavar="FILE")] = None,
    segments: Annotated[str | None, _opt("--segments", help="JSON allocator segments (plain data).", panel=_OUT, metavar="FILE")] = None,
    title: Annotated[str | None, _opt("--title", help="Page title. (default: memplan report: MODEL)", panel=_OUT)] = None,
    json_output: Annotated[bool, _opt("--json", help="Print what was written as JSON (file, size, the estimate's peak, "
                                      "the sections' sizes, input settings; nothing else on stdout).", panel=_OUT)] = False,
    job_flags: dict[str, Any] | None = None,
    dataset_flags: dict[str, Any] | None = None,
) -> None:
    """Write one self-contained, offline HTML report of a training job's memory.

    MODEL (or --job) adds the per-stage estimate and, with --fit, the fit table; --trace alone makes
    a report of a trace or snapshot without an estimate.
    """
    with handle_errors():
        from memplan.report.html import write_html

        check_output_path("-o", output)
        if with_fit and model is None and job_file is None:
            raise ConfigError("--fit", "needs a MODEL or --job to search layouts for")
        est = fit_result = None
        read: tuple[Any, ...] = ()
        if model is not None or job_file is not None or trace_file is None or job_flags or torchtitan_config:
            est, fit_result, read = _estimate(model, job_file, gpu, job_flags or {}, with_fit,
                                              (hf_args, peft_config, torchtitan_config))
        timeline_data, segment_data = _read_timeline(timeline), _read_segments(segments)
        if trace_file is not None:
            timeline_data, segment_data = _trace_views(trace_file, timeline_data, segment_data)
        name = est.model if est is not None else Path(trace_file or "").name
        notes = [f"Not modelled: {s.source} {s.key} = {s.value!r}: {s.note}" for s in read
                 if s.effect == "not-modelled"]
        extra: list[str] = []
        if dataset_flags:
            from memplan.dataset.options import report_dataset

            est, section = report_dataset(model, job_file, gpu, job_flags or {}, dataset_flags,
                                          (hf_args, peft_config, torchtitan_config))
            extra.append(section)
        write_html(output, title=title or f"memplan report: {name}", estimate=est, fit=fit_result,
                   timeline=timeline_data, segments=segment_data, notes=notes, extra_sections=extra)
    if json_output:
        typer.echo(json.dumps(_written(output, est, fit_result, timeline_data, segment_data, extra, read), indent=2))
        return
    typer.echo(f"wrote {output}")
    _print_unmodelled(read)


def _written(output: str, est: Any, fit_result: Any, timeline: Any, segments: Any, extra: list[str],
             read: tuple[Any, ...]) -> dict[str, Any]:
    """``--json``: the file written and what it holds."""
    from memplan.settings import settings_dict

    return {
        "output": str(Path(output).resolve()), "bytes": Path(output).stat().st_size,
        "model": est.model if est is not None else None,
        "peak_allocated_bytes": est.peak_allocated_bytes if est is not None else None,
        "peak_reserved_bytes": est.peak_reserved_bytes if est is not None else None,
        "stages": len(est.stages) if est is not None else 0,
        "fit_candidates": len(fit_result.candidates) if fit_result is not None else None,
        "timeline_points": len(timeline or ()), "segments": len(segments or ()), "extra_sections": len(extra),
        **settings_dict(read),
    }


def _estimate(model: str | None, job_file: str | None, gpu: str | None, flags: dict[str, Any],
              with_fit: bool, dialects: tuple[str | None, str | None, str | None]) -> tuple[Any, Any, tuple[Any, ...]]:
    """The estimate of the job (and the fit search from it), and the input settings read."""
    from memplan.estimate.engine import DEFAULT_FRAGMENTATION, estimate
    from memplan.gpus import get_gpu
    from memplan.inputs import JobRequest, load_job

    loaded = load_job(JobRequest(model=model, flags=flags, job_file=job_file, gpu=gpu, hf_args=dialects[0],
                                 peft_config=dialects[1], torchtitan_config=dialects[2]))
    gpu_spec = get_gpu((loaded.gpu or "h100-80gb").split(":", 1)[0])
    fragmentation = DEFAULT_FRAGMENTATION if loaded.fragmentation is None else loaded.fragmentation
    est = estimate(loaded.model, loaded.job, gpu=gpu_spec, fragmentation=fragmentation, settings=loaded.settings)
    if not with_fit:
        return est, None, est.settings
    from memplan.fit.search import fit

    return est, fit(loaded.model, gpus=loaded.job.parallel.world_size, gpu=gpu_spec, top=20, base=loaded.job), \
        est.settings


def _trace_views(path: str, timeline: Any, segments: Any) -> tuple[Any, Any]:
    """The timeline by category and the simulated allocator's segments at peak reserved of a trace."""
    import os

    from memplan.alloc import load_trace_or_snapshot
    from memplan.report.trace_data import category_timeline, peak_segments

    if not os.path.isfile(path):
        raise ConfigError("--trace", "must be an existing trace or snapshot file", path)
    traced, settings = load_trace_or_snapshot(path)
    return timeline or category_timeline(traced), segments or peak_segments(traced, settings)


def _read_json(path: str, flag: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(flag, f"cannot read the file ({exc.strerror})", path) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(flag, f"is not valid JSON ({exc.msg} at line {exc.lineno})", path) from None


def _read_timeline(path: str | None) -> list[tuple[int, dict[str, int]]] | None:
    if path is None:
        return None
    data = _read_json(path, "--timeline")
    out = []
    try:
        for op, values in data:
            out.append((int(op), {str(k): int(v) for k, v in values.items()}))
    except (TypeError, ValueError, AttributeError):
        raise ConfigError("--timeline", "must be a list of [op_index, {category: bytes}] pairs", path) from None
    if not out:
        raise ConfigError("--timeline", "holds no points", path)
    return out


def _read_segments(path: str | None) -> list[dict[str, Any]] | None:
    if path is None:
        return None
    data = _read_json(path, "--segments")
    if not isinstance(data, list) or not all(isinstance(s, dict) and {"address", "size"} <= s.keys() for s in data):
        raise ConfigError("--segments", "must be a list of {address, size, blocks} objects", path)
    for seg in data:
        for block in seg.get("blocks", []):
            if not isinstance(block, dict) or not {"offset", "size"} <= block.keys():
                raise ConfigError("--segments", "each block needs offset and size", path)
    return data
