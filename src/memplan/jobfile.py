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

:func:`load_job_file` returns the values under the job flags' names (:mod:`memplan.jobflags`)
plus ``model``, ``gpu``, ``fragmentation``, ``megatron_args``, ``deepspeed_config``, ``hf_args``,
``peft_config`` and ``torchtitan_config``;
:func:`memplan.inputs.load_job` merges them under the flags typed on the command line.

Unknown fields, duplicated fields, values of the wrong type and settings that contradict each
other raise :class:`~memplan.errors.ConfigError` naming the file and the field (exit code 2).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from memplan.bounds import parse_json, parse_yaml
from memplan.errors import ConfigError
from memplan.jobflags import check_conflicts

__all__ = ["EXTRA_FIELDS", "check_fields", "dump_job_file", "job_file_fields", "load_job_file"]

#: Fields of a job file beyond the job flags (memplan.jobflags), with their types.
EXTRA_FIELDS: dict[str, type] = {
    "model": str,
    "gpu": str,
    "fragmentation": float,
    "megatron_args": str,
    "deepspeed_config": str,
    "hf_args": str,
    "peft_config": str,
    "torchtitan_config": str,
}
#: Fields holding paths, resolved relative to the job file's folder.
_PATH_FIELDS = ("megatron_args", "deepspeed_config", "hf_args", "peft_config", "torchtitan_config")
def job_file_fields() -> dict[str, type]:
    """Every field a job file may hold and its type (int, float, str or bool)."""
    from memplan.jobflags import job_flags

    return {**{f.name: f.kind for f in job_flags()}, **EXTRA_FIELDS}


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
            data = parse_json(text, field="--job", object_pairs_hook=_unique_pairs)
        else:
            data = parse_yaml(text, field="--job", loader=_UniqueKeyLoader)  # a SafeLoader subclass
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


def load_job_file(path: str | Path) -> dict[str, Any]:
    """Read a job file; return ``{field name: value}`` (``JobFlag.name`` plus the extra fields).

    Checks the file's syntax, its field names and their types, and settings that only mean
    something together; the values themselves are checked when :func:`memplan.inputs.load_job`
    builds the job (errors then name the file and the field). Relative ``megatron-args`` /
    ``deepspeed-config`` paths are resolved against the file's folder.
    """
    file = Path(path)
    try:
        values = _normalise(_read(file), file)
        check_conflicts(values)
    except ConfigError as exc:
        raise in_file(exc, file) from None
    return values


def in_file(exc: ConfigError, file: Path) -> ConfigError:
    """``exc`` with its field prefixed by the job file's path (unless it already names the file)."""
    if exc.field.startswith(f"{file}:") or exc.field == "--job":
        return exc
    return ConfigError(f"{file}: {exc.field.removeprefix('--')}", exc.rule, exc.value, hint=exc.hint)


def _normalise(raw: dict[Any, Any], file: Path) -> dict[str, Any]:
    values = check_fields(raw)
    for name in _PATH_FIELDS:
        if name in values and not Path(values[name]).is_absolute():
            values[name] = str(file.parent / values[name])
    return values


def check_fields(raw: dict[Any, Any]) -> dict[str, Any]:
    """A job file's mapping → ``{field name: value}``: names normalised (``--sequence-parallel`` →
    ``sequence_parallel``), unknown or twice-spelled fields and wrong types refused with a
    :class:`ConfigError` naming the field; ``None`` values dropped. Paths are left as given."""
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
    return values


def dump_job_file(
    model_ref: str | None,
    job: Any,
    path: str | Path,
    *,
    gpu: str | None = None,
    fragmentation: float | None = None,
    megatron_args: str | None = None,
    deepspeed_config: str | None = None,
    hf_args: str | None = None,
    peft_config: str | None = None,
    torchtitan_config: str | None = None,
    reload: Callable[[Path], Any] | None = None,
) -> tuple[str, ...]:
    """Write ``job`` (a :class:`~memplan.job.Job`) for model ``model_ref`` as a job file.

    YAML unless ``path`` ends in ``.json``. Only fields that differ from the defaults are written
    (``gpus`` always); ``megatron_args`` / ``deepspeed_config`` are kept as absolute paths (the
    flags written beside them win over them when the file is loaded, as on the command line).
    Returns the names of Job settings that no flag expresses (e.g. Megatron's
    ``microbatch_group_size``) and that the written file does not restore, so the caller can warn: where a
    framework file is kept, ``reload`` (the written file's path -> its Job, or None when it does not load) loads
    it again and a setting it gives back (a DeepSpeed config's ``sharding.reduce_bucket_size``) is not named.
    """
    from memplan.jobflags import flag_values, unflagged_settings

    out: dict[str, Any] = {} if model_ref is None else {"model": model_ref}
    for key, value in (("megatron-args", megatron_args), ("deepspeed-config", deepspeed_config),
                       ("hf-args", hf_args), ("peft-config", peft_config), ("torchtitan-config", torchtitan_config)):
        if value is not None:
            out[key] = str(Path(value).resolve())
    out.update({name.replace("_", "-"): value for name, value in flag_values(job).items()})
    if gpu is not None:
        out["gpu"] = gpu
    if fragmentation is not None:
        out["fragmentation"] = fragmentation
    dropped = unflagged_settings(job)
    file = Path(path)
    if file.suffix.lower() == ".json":
        text = json.dumps(out, indent=2) + "\n"
    else:
        text = yaml.safe_dump(out, sort_keys=False)
    try:
        file.write_text(text)
    except OSError as exc:
        raise ConfigError("--save-job", f"cannot write the job file ({exc.strerror})", str(file)) from None
    kept_files = any(name.replace("_", "-") in out for name in _PATH_FIELDS)
    return _not_restored(reload(file), job, dropped) if dropped and kept_files and reload else dropped


def _not_restored(again: Any, job: Any, dropped: tuple[str, ...]) -> tuple[str, ...]:
    """The ``section.field`` names of ``dropped`` whose value ``again`` (the written file loaded again: its
    framework files set them) does not give back; all of them when it did not load (None)."""
    if again is None:
        return dropped

    def value(of: Any, name: str) -> Any:
        for part in name.split("."):
            of = getattr(of, part)
        return of

    return tuple(name for name in dropped if value(again, name) != value(job, name))
