"""``memplan doctor``: why a job ran out of GPU memory and the cheapest verified fix.

A thin client of :func:`memplan.doctor.diagnose`: the inputs are sorted by their first bytes (a
pickle is a snapshot, a gzip, binary-trace or ``memplan-trace`` file a trace, any other text an OOM message or
a log holding one, ``-`` the message on stdin); the job comes from the usual job options
(:func:`job_options`, resolved by :func:`memplan.inputs.load_job`).
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from memplan.commands.common import (
    HF_ARGS_HELP,
    PEFT_CONFIG_HELP,
    TORCHTITAN_CONFIG_HELP,
    Command,
    app,
    handle_errors,
    job_options,
    option,
    print_json,
    print_rich,
)
from memplan.errors import ConfigError
from memplan.events import BINARY_MAGIC

__all__ = ["doctor_command", "sort_inputs"]

_OUT = "Inputs and output"
_EPILOG = """\
Examples:

  memplan doctor train.log

  python train.py 2>&1 | tail -n 40 | memplan doctor -

  memplan doctor oom_snapshot.pickle train.log

  memplan doctor step.mptrace --gpu h100-80gb

  memplan doctor train.log --model llama-3.1-8b --gpus 8 --mbs 4 --seq 4096

Inputs: an OOM message (a log file, or - for stdin), a snapshot pickle
(torch.cuda.memory._dump_snapshot) or a memplan trace, and a job (MODEL flags or --job)
for fixes that change the job. All sizes are GiB = 2^30 bytes.
Exit codes: 0 a diagnosis was made, 1 unsupported input, 2 invalid input.
"""


def sort_inputs(paths: list[str], stdin: Any = None) -> tuple[str | None, str | None, str | None]:
    """(message text, snapshot path, trace path) from the INPUT arguments; two of a kind is an error."""
    message = snapshot = trace = None
    for path in paths:
        if path == "-":
            kind, value = "message", (stdin or sys.stdin).read()
        else:
            if not os.path.isfile(path):
                raise ConfigError("INPUT", "must be an existing file or - for stdin", path)
            with open(path, "rb") as handle:
                head = handle.read(64)
            if head[:1] == b"\x80" or path.endswith((".pickle", ".pkl")):
                kind, value = "snapshot", path
            elif head[:2] == b"\x1f\x8b" or head[:4] == BINARY_MAGIC[:4] or head.lstrip().startswith(b'{"format"'):
                kind, value = "trace", path
            else:
                kind = "message"
                with open(path, encoding="utf-8", errors="replace") as text:
                    value = text.read()
        if kind == "message":
            if message is not None:
                raise ConfigError("INPUT", "may name one OOM message (a log file or -)", path)
            message = value
        elif kind == "snapshot" or kind == "trace":
            if snapshot is not None or trace is not None:
                raise ConfigError("INPUT", "may name one snapshot or trace", path)
            snapshot, trace = (value, None) if kind == "snapshot" else (None, value)
    return message, snapshot, trace


@app.command("doctor", cls=Command, epilog=_EPILOG)
@job_options()
def doctor_command(
    inputs: Annotated[list[str] | None, typer.Argument(
        help="An OOM message log (or - for stdin), a snapshot pickle, a memplan trace (any order).",
        show_default=False, metavar="INPUT...")] = None,
    model: Annotated[str | None, option("--model", help="The job's model (preset, config.json, Hub id) for job "
                                        "fixes.", panel=_OUT, metavar="MODEL")] = None,
    gpu: Annotated[str | None, option("--gpu", help="GPU (see `memplan gpus`): capacity without a message, and "
                                      "step-time prices.", panel=_OUT, metavar="NAME")] = None,
    capacity: Annotated[str | None, option("--capacity", help="Memory the allocator may use, e.g. 78GiB (default: "
                                           "the message's reserved + free, else the GPU's).", panel=_OUT,
                                           metavar="BYTES")] = None,
    alloc_conf: Annotated[str | None, option("--alloc-conf", help="The PYTORCH_CUDA_ALLOC_CONF the run used "
                                             "(default: the snapshot's recorded one).", panel=_OUT,
                                             metavar="CONF")] = None,
    job_file: Annotated[str | None, option("--job", help="YAML/JSON job file (flags typed here win).", panel=_OUT,
                                           metavar="FILE")] = None,
    megatron_args: Annotated[str | None, option("--megatron-args", help="Megatron-LM launch command line file.",
                                                panel=_OUT, metavar="FILE")] = None,
    deepspeed_config: Annotated[str | None, option("--deepspeed-config", help="DeepSpeed JSON config.", panel=_OUT,
                                                   metavar="FILE")] = None,
    hf_args: Annotated[str | None, option("--hf-args", help=HF_ARGS_HELP, panel=_OUT, metavar="FILE")] = None,
    peft_config: Annotated[str | None, option("--peft-config", help=PEFT_CONFIG_HELP, panel=_OUT,
                                              metavar="FILE")] = None,
    torchtitan_config: Annotated[str | None, option("--torchtitan-config", help=TORCHTITAN_CONFIG_HELP, panel=_OUT,
                                                    metavar="FILE")] = None,
    json_output: Annotated[bool, option("--json", help="Print the report as JSON (verdict, evidence, findings, "
                                        "fixes).", panel=_OUT)] = False,
    job_flags: dict[str, Any] | None = None,
) -> None:
    """Why it ran out of GPU memory (demand, fragmentation, memory outside PyTorch, a leak, a spike) and
    the cheapest fix, each verified by replaying the allocator or re-estimating the job."""
    with handle_errors():
        from memplan.doctor import diagnose
        from memplan.doctor.inputs import alloc_conf_settings, capacity_bytes

        message, snapshot, trace = sort_inputs(list(inputs or []))
        dialects = (job_file, megatron_args, deepspeed_config, hf_args, peft_config, torchtitan_config)
        loaded = None
        if model is not None or job_flags or any(d is not None for d in dialects):
            from memplan.inputs import JobRequest, load_job

            loaded = load_job(JobRequest(model=model, flags=job_flags or {}, job_file=job_file, gpu=gpu,
                                         megatron_args=megatron_args, deepspeed_config=deepspeed_config,
                                         hf_args=hf_args, peft_config=peft_config,
                                         torchtitan_config=torchtitan_config))
        if message is None and snapshot is None and trace is None and loaded is None:
            raise ConfigError("INPUT", "give an OOM message (file or -), a snapshot or trace, or a job", None)
        report = diagnose(message, snapshot=snapshot, trace=trace, job=loaded, gpu=gpu,
                          capacity_bytes=capacity_bytes(capacity, field="--capacity"),
                          settings=alloc_conf_settings(alloc_conf))
    if json_output:
        print_json(report.to_json())
        return
    print_rich(report)
