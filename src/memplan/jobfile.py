"""Job files: a training job as YAML or JSON, with the same fields as ``memplan estimate``'s flags.

A job file is a flat mapping. Keys are the flag names without ``--`` (``sequence-parallel`` or
``sequence_parallel``), plus ``model``::

    # llama-70b.yaml
    model: llama-3.1-70b
    gpus: 64
    tp: 8
    pp: 2
    sequence-parallel: true
    distributed-optimizer: true
    seq: 8192
    gbs: 512
    recompute: selective
    gpu: h100-80gb

:func:`load_job_file` returns the values under the parameter names of the ``estimate`` command
(``JobOptions`` field names plus ``model``, ``gpu``, ``fragmentation``, ``megatron_args``,
``deepspeed_config``), so a command merges them under its own flags::

    given = {k: v for k, v in locals().items() if v is not None}
    values = {**load_job_file(path, overrides=given), **given}
    options = JobOptions.from_mapping(values)

Unknown fields, duplicated fields, values of the wrong type and settings that contradict each
other raise :class:`~memplan.errors.ConfigError` naming the file and the field (exit code 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from memplan.errors import ConfigError

__all__ = ["EXTRA_FIELDS", "dump_job_file", "job_file_fields", "load_job_file"]

#: Fields of a job file beyond the job flags (JobOptions), with their types.
EXTRA_FIELDS: dict[str, type] = {
    "model": str,
    "gpu": str,
    "fragmentation": float,
    "megatron_args": str,
    "deepspeed_config": str,
}
#: Fields holding paths, resolved relative to the job file's folder.
_PATH_FIELDS = ("megatron_args", "deepspeed_config")
#: (field, condition field, allowed values): the field only means something under those values.
_REQUIRES: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("recompute_method", "recompute", ("full",)),
    ("recompute_layers", "recompute", ("full",)),
    ("fsdp_shard_size", "fsdp", ("hybrid",)),
    ("momentum", "optimizer", ("sgd",)),
)


def job_file_fields() -> dict[str, type]:
    """Every field a job file may hold and its type (int, float, str or bool)."""
    from memplan.cli import JobOptions

    hints = typing.get_type_hints(JobOptions)
    out: dict[str, type] = {}
    for f in dataclasses.fields(JobOptions):
        kinds = [k for k in typing.get_args(hints[f.name]) if k is not type(None)] or [hints[f.name]]
        out[f.name] = kinds[0]
    out.update(EXTRA_FIELDS)
    return out


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that refuses a key given twice (YAML would silently keep the last)."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(str(key), "is given twice in the job file")
        seen.add(key)
    mapping: dict[Any, Any] = loader.construct_mapping(node, deep=deep)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _read(path: Path) -> dict[Any, Any]:
    from memplan.textfile import read_text_file

    text = read_text_file(path, field="--job")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text, object_pairs_hook=_unique_pairs)
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("--job", f"is not valid {'JSON' if path.suffix.lower() == '.json' else 'YAML'}: "
                          f"{str(exc).splitlines()[0]}", str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("--job", "must hold a mapping of field: value", str(path))
    return data


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(key, "is given twice in the job file")
        out[key] = value
    return out


def _check_type(name: str, value: Any, kind: type) -> Any:
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(name, f"must be {'a' if kind is not int else 'an'} {kind.__name__}", value)


def load_job_file(path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read and validate a job file; return ``{estimate parameter name: value}`` for the fields it sets.

    The values are checked by building the :class:`~memplan.job.Job` they describe (and, when the
    file names a model, by checking the layout against it), so an invalid file fails here with the
    field named, not later. ``overrides`` are values given on the command line that will replace
    the file's (``None`` values ignored): validation uses the merged job, the return value only the
    file's fields. Relative ``megatron-args`` / ``deepspeed-config`` paths are resolved against the
    file's folder.
    """
    file = Path(path)
    given = {k: v for k, v in (overrides or {}).items() if v is not None and k in job_file_fields()}
    try:
        raw = _read(file)
        values = _normalise(raw, file)
        _check_conflicts({**values, **given})
        _validate({**values, **given})
    except ConfigError as exc:
        if exc.field.startswith(f"{file}:") or exc.field == "--job":
            raise
        field = exc.field.removeprefix("--")
        raise ConfigError(f"{file}: {field}", exc.rule, exc.value, hint=_hint(exc)) from None
    return values


def _hint(exc: ConfigError) -> str:
    text = str(exc)
    return text.split("; ", 1)[1] if "; " in text else ""


def _normalise(raw: dict[Any, Any], file: Path) -> dict[str, Any]:
    fields = job_file_fields()
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in raw.items():
        name = str(key).strip().removeprefix("--").replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"did you mean {close[0].replace('_', '-')}?" if close else \
                "the fields are memplan estimate's flags without '--' (memplan estimate --help)"
            raise ConfigError(str(key), "is not a job-file field", hint=hint)
        if name in values:
            raise ConfigError(str(key), f"conflicts with '{spelled[name]}' (the same field spelled twice)")
        if value is None:
            continue
        values[name] = _check_type(str(key), value, fields[name])
        spelled[name] = str(key)
    for name in _PATH_FIELDS:
        if name in values and not Path(values[name]).is_absolute():
            values[name] = str(file.parent / values[name])
    return values


def _check_conflicts(values: dict[str, Any]) -> None:
    for name, condition, allowed in _REQUIRES:
        if name in values and values.get(condition) not in allowed:
            raise ConfigError(name.replace("_", "-"), f"only applies with {condition.replace('_', '-')}: {' or '.join(allowed)} "
                              f"(the file has {condition.replace('_', '-')}: {values.get(condition, 'not set')})",
                              values[name])


def _validate(values: dict[str, Any]) -> None:
    from memplan.cli import JobOptions, load_job_and_model
    from memplan.job import validate_job_for_model

    if "fragmentation" in values and not 0.0 <= values["fragmentation"] < 1.0:
        raise ConfigError("fragmentation", "must be in [0, 1)", values["fragmentation"])
    if "gpu" in values:
        from memplan.fit.colocate import resolve_device

        resolve_device(values["gpu"])
    options = JobOptions.from_mapping(values)
    if "model" in values or "megatron_args" in values:
        spec, job = load_job_and_model(values.get("model"), options, megatron_args=values.get("megatron_args"),
                                       deepspeed_config=values.get("deepspeed_config"))
        validate_job_for_model(job, spec)
    else:
        from memplan.cli import build_job

        build_job(options)


def dump_job_file(
    model_ref: str | None,
    job: Any,
    path: str | Path,
    *,
    gpu: str | None = None,
    fragmentation: float | None = None,
    megatron_args: str | None = None,
    deepspeed_config: str | None = None,
) -> tuple[str, ...]:
    """Write ``job`` (a :class:`~memplan.job.Job`) for model ``model_ref`` as a job file.

    YAML unless ``path`` ends in ``.json``. Only fields that differ from the defaults are written
    (``gpus`` always); ``megatron_args`` / ``deepspeed_config`` are kept as absolute paths (the
    flags written beside them win over them when the file is loaded, as on the command line).
    Returns the names of Job settings that no flag expresses (e.g. Megatron's
    ``microbatch_group_size``) and were therefore left out, so the caller can warn.
    """
    from memplan.cli import _JOB_FIELDS
    from memplan.job import Job

    default = Job()
    out: dict[str, Any] = {} if model_ref is None else {"model": model_ref}
    for key, value in (("megatron-args", megatron_args), ("deepspeed-config", deepspeed_config)):
        if value is not None:
            out[key] = str(Path(value).resolve())
    covered: set[tuple[str | None, str]] = set()
    for flag, (section, name) in _JOB_FIELDS.items():
        covered.add((section, name))
        value = getattr(getattr(job, section) if section else job, name)
        base = getattr(getattr(default, section) if section else default, name)
        if flag == "dp" or (value == base and flag != "gpus") or value is None:
            continue
        out[flag.replace("_", "-")] = value
    if gpu is not None:
        out["gpu"] = gpu
    if fragmentation is not None:
        out["fragmentation"] = fragmentation
    dropped = _uncovered(job, default, covered)
    file = Path(path)
    if file.suffix.lower() == ".json":
        text = json.dumps(out, indent=2) + "\n"
    else:
        text = yaml.safe_dump(out, sort_keys=False)
    try:
        file.write_text(text)
    except OSError as exc:
        raise ConfigError("--save-job", f"cannot write the job file ({exc.strerror})", str(file)) from None
    return dropped


def _uncovered(job: Any, default: Any, covered: set[tuple[str | None, str]]) -> tuple[str, ...]:
    """Settings of ``job`` that differ from the defaults and have no flag."""
    dropped = []
    for f in dataclasses.fields(job):
        value, base = getattr(job, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            for sub in dataclasses.fields(value):
                if (f.name, sub.name) not in covered and sub.name != "dp" \
                        and getattr(value, sub.name) != getattr(base, sub.name):
                    dropped.append(f"{f.name}.{sub.name}")
        elif (None, f.name) not in covered and value != base:
            dropped.append(f.name)
    return tuple(dropped)
