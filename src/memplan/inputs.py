"""Every input dialect → one ``(ModelSpec, Job)``: flags, job files, Megatron arguments, DeepSpeed
configs, Hugging Face TrainingArguments (``--hf-args``), PEFT adapter configs (``--peft-config``),
torchtitan training TOMLs (``--torchtitan-config``) and Hugging Face Hub model ids.

The commands (estimate, trace, fit, report) and the Python API describe a job with a
:class:`JobRequest` and call :func:`load_job`; nothing else turns user input into a Job. Precedence,
lowest to highest: the base job (``Job()``, or the trace's framework), the Megatron arguments, the
torchtitan TOML, the HF TrainingArguments (the DeepSpeed config they name applied within them), the DeepSpeed config of
``--deepspeed-config``, the PEFT config, then the flags — a job file's fields first, the flags typed
on the command line last. A job file's fields are flags (``--save-job`` writes the resolved values
beside the dialect files it names, which must reproduce the job), so they sit above every dialect
file; what the user typed wins over everything. With ``--hf-args`` and no ``--framework`` the
framework is ``hf``; with ``--torchtitan-config``, ``torchtitan``, and without MODEL its ``[model]
name``/``flavor`` names the preset. What the dialect files say and memplan does not model is listed in
:attr:`LoadedJob.settings` (:mod:`memplan.settings`). Example::

    >>> from memplan.inputs import JobRequest, load_job
    >>> loaded = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 8, "tp": 2}))
    >>> loaded.job.parallel.dp
    4

Errors are :class:`~memplan.errors.ConfigError` naming the flag or ``FILE: field``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import field, replace
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError, JobConfigError, UnsupportedError
from memplan.frozen import frozen_dataclass
from memplan.job import Job
from memplan.jobcheck import check_seq_positions, validate_job_for_model
from memplan.jobflags import CONDITIONS, build_job, check_conflicts
from memplan.model.spec import ModelSpec
from memplan.profiles import FINE_TUNING_FRAMEWORK
from memplan.settings import InputSetting, unmodelled

__all__ = ["JobRequest", "LoadedJob", "load_job"]


@frozen_dataclass(kw_only=True)
class JobRequest:
    """What the user gave to describe a job; ``None`` means not given."""

    #: Preset name, config.json path or folder (optional with Megatron arguments or a job file naming one).
    model: str | None = None
    #: Job flag values by :attr:`memplan.jobflags.JobFlag.name` (``None`` values are ignored).
    flags: Mapping[str, Any] = field(default_factory=dict)
    #: A YAML/JSON job file (``--job``).
    job_file: str | None = None
    #: A Megatron-LM launch command line or arguments mapping (``--megatron-args``).
    megatron_args: str | None = None
    #: A DeepSpeed JSON config (``--deepspeed-config``).
    deepspeed_config: str | None = None
    #: Hugging Face TrainingArguments: a to_json_string() JSON or a script command line (``--hf-args``).
    hf_args: str | None = None
    #: A PEFT ``adapter_config.json`` (``--peft-config``).
    peft_config: str | None = None
    #: A torchtitan training TOML (``--torchtitan-config``).
    torchtitan_config: str | None = None
    #: GPU name to check the fit against (``--gpu``).
    gpu: str | None = None
    #: Assumed allocator fragmentation (``--fragmentation``).
    fragmentation: float | None = None


@frozen_dataclass(kw_only=True)
class LoadedJob:
    """The model and job a request describes, with the request's other settings resolved."""

    model: ModelSpec
    job: Job
    #: The model as the user named it (preset, path), or None when it came from Megatron arguments.
    model_ref: str | None
    gpu: str | None = None
    fragmentation: float | None = None
    megatron_args: str | None = None
    deepspeed_config: str | None = None
    hf_args: str | None = None
    peft_config: str | None = None
    torchtitan_config: str | None = None
    #: What each field of the dialect files did (modelled, no memory effect, not modelled).
    settings: tuple[InputSetting, ...] = ()

    @property
    def unmodelled(self) -> tuple[InputSetting, ...]:
        """The settings the inputs gave that memplan does not model."""
        return unmodelled(self.settings)


def _given(flags: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flags.items() if v is not None}


def _merged(request: JobRequest) -> tuple[dict[str, Any], Path | None]:
    """The request's values with the job file's underneath (flags and explicit settings win)."""
    explicit = {"model": request.model, "megatron_args": request.megatron_args,
                "deepspeed_config": request.deepspeed_config, "hf_args": request.hf_args,
                "peft_config": request.peft_config, "torchtitan_config": request.torchtitan_config,
                "gpu": request.gpu,
                "fragmentation": request.fragmentation, **request.flags}
    explicit = _given(explicit)
    if request.job_file is None:
        return explicit, None
    from memplan.jobfile import load_job_file

    return {**load_job_file(request.job_file), **explicit}, Path(request.job_file)


def load_job(request: JobRequest, *, base: Job | None = None) -> LoadedJob:
    """Resolve ``request`` into a validated model and job (see the module docstring for precedence).

    ``base`` replaces ``Job()`` underneath everything (``memplan trace`` passes its framework).
    """
    values, job_file = _merged(request)
    try:
        return _load(values, base)
    except ConfigError as exc:
        if job_file is None:
            raise
        from memplan.jobfile import in_file

        raise in_file(exc, job_file) from None


def _check(values: Mapping[str, Any]) -> None:
    fragmentation = values.get("fragmentation")
    if fragmentation is not None and not 0.0 <= fragmentation < 1.0:
        raise ConfigError("--fragmentation", "must be in [0, 1)", fragmentation)
    gpu = values.get("gpu")
    if gpu is not None:
        from memplan.gpus import resolve_device

        resolve_device(gpu)  # a GPU, or GPU:MIG-PROFILE (a job file for fit --colocate)


def _conditions(values: Mapping[str, Any], job: Job) -> dict[str, Any]:
    """``values`` with the conditions a dialect file set (``peft: lora`` from a PEFT config) added,
    so that ``--lora-rank`` beside ``--peft-config`` is not refused as lacking ``--peft``."""
    from memplan.jobflags import job_flags

    default, out = Job(), dict(values)
    for flag in job_flags():
        if flag.name in CONDITIONS and flag.name not in out \
                and flag.read(job) != flag.read(default):
            out[flag.name] = flag.read(job)
    return out


def _keep_accumulation(values: Mapping[str, Any], job: Job) -> dict[str, Any]:
    """``values`` with ``gbs`` set so that a typed ``--mbs`` over a dialect file keeps the file's
    micro-batches per step (its gradient accumulation) instead of contradicting its batch size."""
    out = dict(values)
    if "gbs" in out or "mbs" not in out or job.batch.global_batch_size is None:
        return out
    out["gbs"] = job.num_microbatches * int(out["mbs"]) * job.parallel.data_parallel
    return out


def _load(values: dict[str, Any], base: Job | None) -> LoadedJob:
    _check(values)
    spec: ModelSpec | None = None
    megatron_args, deepspeed_config = values.get("megatron_args"), values.get("deepspeed_config")
    hf_args, peft_config = values.get("hf_args"), values.get("peft_config")
    torchtitan_config = values.get("torchtitan_config")
    dialects = hf_args is not None or deepspeed_config is not None or peft_config is not None \
        or torchtitan_config is not None
    settings: list[InputSetting] = []
    if megatron_args is not None:
        load_launch = _lazy("memplan.frameworks.megatron_args", "load_megatron_launch", "--megatron-args")
        spec, base, read = load_launch(megatron_args, gpus=values.get("gpus") or 1)
        settings += read
    if not dialects:  # a typed flag's condition may come from the base job (--megatron-args' --recompute-granularity)
        check_conflicts(values if base is None else _conditions(values, base))
    model_ref = values.get("model")
    model_given = model_ref is not None
    if model_ref is None and megatron_args is None and torchtitan_config is not None:
        model_ref = _lazy("memplan.frameworks.torchtitan_config", "torchtitan_model",
                          "--torchtitan-config")(torchtitan_config)
    if model_ref is None and megatron_args is None and hf_args is not None:
        model_ref = _lazy("memplan.frameworks.hf_args", "hf_args_model", "--hf-args")(hf_args)
    if model_ref is not None:
        from memplan.model import load_model

        spec = load_model(model_ref)
    if spec is None:
        raise ConfigError("MODEL", "is required (a preset name, a config.json path or a Hugging Face Hub id) "
                          "unless --megatron-args, --hf-args (model_name_or_path) or a job file names one")
    job = _starting_job(values, base) if dialects else build_job(values, base)
    if torchtitan_config is not None:
        apply_tt = _lazy("memplan.frameworks.torchtitan_config", "apply_torchtitan_config", "--torchtitan-config")
        job, read = apply_tt(torchtitan_config, job, model=spec, model_given=model_given, typed=values)
        settings += read
    if hf_args is not None:
        apply_hf = _lazy("memplan.frameworks.hf_args", "apply_hf_args", "--hf-args")
        job, read = apply_hf(hf_args, job)
        settings += read
    if deepspeed_config is not None:
        apply = _lazy("memplan.frameworks.deepspeed_config", "load_deepspeed_config", "--deepspeed-config")
        job, read = apply(deepspeed_config, job)
        settings += read
    if peft_config is not None:
        apply_peft = _lazy("memplan.frameworks.peft_config", "apply_peft_config", "--peft-config")
        job, read = apply_peft(peft_config, job, model_ref=model_ref, model=spec)
        settings += read
    if dialects:
        check_conflicts(_conditions(values, job))
        job = build_job(_keep_accumulation(values, job), job)
    job = _fine_tuning_framework(job, values, base, megatron_args)
    job = default_seq_within_positions(job, spec, values)
    validate_job_for_model(job, spec)
    check_seq_positions(job, spec)
    return LoadedJob(model=spec, job=job, model_ref=model_ref, gpu=values.get("gpu"),
                     fragmentation=values.get("fragmentation"), megatron_args=megatron_args,
                     deepspeed_config=deepspeed_config, hf_args=hf_args, peft_config=peft_config,
                     torchtitan_config=torchtitan_config, settings=tuple(settings))


def default_seq_within_positions(job: Job, spec: ModelSpec, values: Mapping[str, Any]) -> Job:
    """A model with a learned position table (GPT-2: 1,024 rows) cannot take the default --seq 4096: when no
    input gave a sequence length, it is the table's size (an explicit one past it is refused)."""
    default = Job().batch.seq_length
    if "seq" in values or spec.position_embedding != "learned" or job.batch.seq_length != default \
            or default <= spec.max_position_embeddings:
        return job
    return replace(job, batch=replace(job.batch, seq_length=spec.max_position_embeddings))


def _starting_job(values: Mapping[str, Any], base: Job | None) -> Job:
    """The job the dialect files are applied to: the typed flags over ``base``. A dialect file names its
    own framework, so a typed flag that the starting job's framework refuses (``--recompute torchtitan-sac``
    before a DeepSpeed config says ``deepspeed``) waits: the flags are applied again, and checked, over
    the dialects' job."""
    from memplan.jobflags import job_flags

    names = {flag.flag: flag.name for flag in job_flags()}
    pending = dict(values)
    while True:
        try:
            return build_job(pending, base)
        except JobConfigError as exc:
            name = names.get(exc.field)
            if name is None or pending.pop(name, None) is None:
                raise


def _fine_tuning_framework(job: Job, values: Mapping[str, Any], base: Job | None,
                           megatron_args: str | None) -> Job:
    """A PEFT or quantized-base job with no framework named anywhere is a Hugging Face one (peft and
    bitsandbytes run in HF Trainer / TRL / plain PyTorch loops), not the Megatron default."""
    named = "framework" in values or base is not None or megatron_args is not None
    tuned = job.finetune.peft_kind.adapters or job.finetune.quant_kind.quantizes
    if named or not tuned or job.framework != Job().framework:
        return job
    return replace(job, framework=FINE_TUNING_FRAMEWORK)


def _lazy(module: str, name: str, flag: str) -> Any:
    """Import ``module.name`` on first use; a build without it gets a clear error, not a traceback."""
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise UnsupportedError(f"{flag} is not available in this build of memplan ({module} is missing)") from None
