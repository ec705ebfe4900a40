"""Request bodies → the library's requests: a job (the job-file fields), fit's settings, a placement.

A job body is a job file as JSON (:mod:`memplan.jobfile`): ``{"model": "llama-3.1-8b", "gpus": 8,
"tp": 2, "gpu": "h100-80gb"}``, checked by the same code, so a field gets the same error as in a
job file. What differs is what names a file: the server reads none of its own files, so

- ``model`` is a preset or a Hub id, never a path; a pasted ``config.json`` goes in ``model_config``
  (an object);
- the dialect fields hold the file's *content*: ``deepspeed_config`` and ``peft_config`` an object,
  ``hf_args`` an object (the JSON ``to_json_string()`` writes) or the script's command line,
  ``megatron_args`` the command line (a string) or a mapping of flags, ``torchtitan_config`` the
  TOML text. Each is written into the request's own folder and read from there by the usual
  loaders, so the job is exactly what the command line reads from the same files.

Errors are :class:`~memplan.errors.ConfigError` naming the field, the rule and the value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memplan.errors import ConfigError
from memplan.inputs import JobRequest

if TYPE_CHECKING:
    from memplan.serve.work import Folder

__all__ = ["DIALECT_FIELDS", "FIT_FIELDS", "JobBody", "check_model_ref", "job_body", "take_fields"]

#: The dialect fields and the JSON types their content may have.
DIALECT_FIELDS: dict[str, tuple[type, ...]] = {
    "megatron_args": (str, dict, list),
    "deepspeed_config": (dict,),
    "hf_args": (dict, str),
    "peft_config": (dict,),
    "torchtitan_config": (str,),
}
#: The file each dialect's content is written to (its suffix decides how the loader reads it).
_DIALECT_FILES = {
    "megatron_args": "megatron_args",
    "deepspeed_config": "deepspeed_config.json",
    "hf_args": "hf_args",
    "peft_config": "adapter_config.json",
    "torchtitan_config": "torchtitan_config.toml",
}
#: fit's own settings beside the job (``memplan fit``'s options), with their types.
FIT_FIELDS: dict[str, type] = {
    "margin": float, "gpus_per_node": int, "top": int, "all": bool, "max_mbs": bool, "max_seq": bool,
    "methods": bool,
}
_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false"}
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


@dataclass(frozen=True)
class JobBody:
    """A job body resolved into a :class:`JobRequest` whose files lie in the request's folder."""

    request: JobRequest
    #: The other fields of the body (fit's settings), by name, type-checked.
    extras: dict[str, Any]


def take_fields(body: Any, allowed: Mapping[str, type | tuple[type, ...]], *, where: str = "body",
                others: str | None = None) -> dict[str, Any]:
    """``body``'s fields of ``allowed`` (names with ``-`` or ``_``), type-checked. Other names are left,
    or, with ``others`` (the rule, e.g. ``"is not a GPU field (id, gpu)"``), the first is refused,
    named ``where.NAME`` (just ``NAME`` at the top of the body)."""
    if not isinstance(body, dict):
        raise ConfigError(where, "must be a JSON object", type(body).__name__)
    out: dict[str, Any] = {}
    for key in list(body):
        name = str(key).replace("-", "_")
        if name in allowed:
            out[name] = _typed(str(key), body[key], allowed[name])
        elif others is not None:
            raise ConfigError(str(key) if where == "body" else f"{where}.{key}", others)
    return out


def _typed(key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if isinstance(kind, tuple):
        for one in kind:
            try:
                return _typed(key, value, one)
            except ConfigError:
                continue
        raise ConfigError(key, f"must be {' or '.join(_TYPE_NAMES[k] for k in kind)}", value)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, kind) and (kind is not int or not isinstance(value, bool)):
        return value
    raise ConfigError(key, f"must be {_TYPE_NAMES[kind]}", value)


def job_body(body: Any, workdir: Folder, *, extra: Mapping[str, type | tuple[type, ...]] | None = None,
             where: str = "body") -> JobBody:
    """Check a job body and write its dialect contents into ``workdir`` (made on first use); ``extra`` names other fields
    the endpoint takes (type-checked, returned in :attr:`JobBody.extras`)."""
    from memplan.jobfile import check_fields

    if not isinstance(body, dict):
        raise ConfigError(where, "must be a JSON object of job-file fields", type(body).__name__)
    extras = take_fields(body, extra or {}, where=where)
    plain: dict[str, Any] = {}
    dialects: dict[str, Any] = {}
    model_config = None
    for key, value in body.items():
        name = str(key).replace("-", "_")
        if name in (extra or {}):
            continue
        if name == "model_config":
            model_config = value
        elif name in DIALECT_FIELDS:
            if value is not None:
                dialects[name] = _dialect_value(str(key), value)
        else:
            plain[key] = value
    values = check_fields(plain)
    model = values.pop("model", None)
    if model is not None and model_config is not None:
        raise ConfigError("model_config", "cannot be combined with model (give one)", "model_config")
    if model is not None:
        check_model_ref(model)
    elif model_config is None and not {"megatron_args", "hf_args", "torchtitan_config"} & set(dialects):
        raise ConfigError("model", "is required: a preset (GET /v1/models), a Hub id, or model_config (or "
                          "megatron_args, torchtitan_config or hf_args naming one)")
    if model_config is not None:
        model = _write_model_config(model_config, workdir.path)
    files = {name: _write_dialect(name, value, workdir.path) for name, value in dialects.items()}
    flags = {k: v for k, v in values.items() if k not in ("gpu", "fragmentation")}
    request = JobRequest(model=model, flags=flags, gpu=values.get("gpu"), fragmentation=values.get("fragmentation"),
                         **files)
    return JobBody(request, extras)


def check_model_ref(model: str) -> None:
    """A model the server may load: a preset or a Hub id, never a file of the server's."""
    from memplan.model.hub import looks_like_hub_id
    from memplan.model.presets import preset_names

    text = model.strip()
    if text.lower() in preset_names():
        return
    if looks_like_hub_id(text) and not Path(text).expanduser().exists():
        return
    raise ConfigError("model", "must be a preset (GET /v1/models) or a Hub id ORG/NAME; the server reads no "
                      "files of its own — send a config.json's content as model_config", model)


def _dialect_value(key: str, value: Any) -> Any:
    name = key.replace("-", "_")
    kinds = DIALECT_FIELDS[name]
    if not isinstance(value, kinds):
        shapes = " or ".join(_TYPE_NAMES[k] for k in kinds)
        raise ConfigError(key, f"must be the file's content ({shapes}); the server reads no files of its own",
                          type(value).__name__)
    if name == "hf_args":
        _check_hf_args(key, value)
    return value


def _check_hf_args(key: str, value: dict[str, Any] | str) -> None:
    """TrainingArguments may name other files (``deepspeed``, ``model_name_or_path``): only contents
    and Hub ids are taken here."""
    if isinstance(value, str):
        from memplan.frameworks.hf_args_file import parse_hf_command_line

        args = parse_hf_command_line(value)
    else:
        args = value
    if isinstance(args.get("deepspeed"), str):
        raise ConfigError(f"{key}: deepspeed", "names a file; send the DeepSpeed config itself as deepspeed_config",
                          args["deepspeed"])
    named = args.get("model_name_or_path")
    if isinstance(named, str):
        check_model_ref(named)


def _write_model_config(config: Any, workdir: Path) -> str:
    if not isinstance(config, dict):
        raise ConfigError("model_config", "must be a config.json's content (an object)", type(config).__name__)
    named = str(config.get("_name_or_path") or "").rstrip("/").rsplit("/", 1)[-1]
    folder = workdir / (named if _SAFE_NAME.fullmatch(named) else "model")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _write_dialect(name: str, value: Any, workdir: Path) -> str:
    file = workdir / _DIALECT_FILES[name]
    if isinstance(value, (dict, list)):
        if file.suffix != ".json":
            file = file.with_suffix(".json")
        file.write_text(json.dumps(value))
    else:
        if not file.suffix:
            file = file.with_suffix(".txt")
        file.write_text(value)
    return str(file)
