"""Shipped model presets: real Hugging Face ``config.json`` files under ``memplan/model/presets``.

Each preset file is the model's published ``config.json`` plus a ``_memplan`` key that the loader
ignores: ``display_name``, ``source`` (the Hub file), ``witnesses`` (public copies it was checked
against, field by field) and ``published_params`` (docs/model-sources.md renders them). :func:`load_model` is the one entry point the
CLI needs: it takes a preset name, a ``config.json`` path or a directory holding one.

Example::

    >>> load_model("llama-3.1-8b").num_layers
    32
    >>> [p.name for p in list_presets()][:2]
    ['deepseek-v2-lite', 'deepseek-v3']
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from memplan.errors import ModelConfigError
from memplan.frozen import frozen_dataclass
from memplan.model.hf import model_from_hf_config
from memplan.model.params import total_params
from memplan.model.spec import ModelSpec

__all__ = ["PresetInfo", "list_presets", "load_model", "load_preset", "preset_config", "preset_names"]

_PACKAGE = "memplan.model"
_FOLDER = "presets"
_PROVENANCE_KEY = "_memplan"


@frozen_dataclass(kw_only=True)
class PresetInfo:
    """A one-line summary of a shipped preset."""

    #: Name accepted by :func:`load_preset` / :func:`load_model`.
    name: str
    #: Hugging Face ``model_type``.
    model_type: str
    #: Every trainable parameter as ``transformers`` builds the model (MTP modules excluded).
    total_params: int
    num_layers: int
    hidden_size: int
    is_moe: bool
    #: Display name and the Hub repository the config was taken from.
    description: str


def _preset_dir() -> Any:
    return resources.files(_PACKAGE).joinpath(_FOLDER)


@cache
def preset_names() -> tuple[str, ...]:
    """Names of the shipped presets, sorted."""
    return tuple(sorted(
        entry.name.removesuffix(".json") for entry in _preset_dir().iterdir() if entry.name.endswith(".json")
    ))


@cache
def _read_preset(name: str) -> dict[str, Any]:
    text = _preset_dir().joinpath(f"{name}.json").read_text(encoding="utf-8")
    config = json.loads(text)
    assert isinstance(config, dict), f"preset {name} is not a JSON object"
    return config


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of a preset's ``config.json`` contents, without memplan's provenance key.

    Suitable for ``transformers.AutoConfig.for_model(**preset_config(name))``.
    """
    key = name.lower()
    if key not in preset_names():
        raise _unknown_preset(name)
    config: dict[str, Any] = json.loads(json.dumps(_read_preset(key)))
    config.pop(_PROVENANCE_KEY, None)
    return config


def _unknown_preset(name: str) -> ModelConfigError:
    names = preset_names()
    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ModelConfigError(
        "model", "is not a known preset or an existing config.json path", name,
        hint=f"{hint}presets: {', '.join(names)}",
    )


@cache
def load_preset(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of a shipped preset (case-insensitive name)."""
    key = name.lower()
    if key not in preset_names():
        raise _unknown_preset(name)
    return model_from_hf_config(_read_preset(key), name=key)


def list_presets() -> list[PresetInfo]:
    """Every shipped preset with its size, sorted by name."""
    infos = []
    for name in preset_names():
        spec = load_preset(name)
        meta = _read_preset(name).get(_PROVENANCE_KEY, {})
        description = meta.get("display_name", name)
        if "source" in meta:
            description += f" — {meta['source']}"
        infos.append(PresetInfo(
            name=name,
            model_type=spec.model_type,
            total_params=total_params(spec),
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            is_moe=spec.is_moe,
            description=description,
        ))
    return infos


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name, a path to a ``config.json``, a directory containing ``config.json``, or a
    Hugging Face Hub id ``ORG/NAME[@REVISION]`` (its config.json only, see :mod:`memplan.model.hub`).

    A preset name wins over a same-named relative path, and an existing path over a Hub id. An unknown name raises
    :class:`ModelConfigError` listing the presets and suggesting the closest one.
    """
    from memplan.model.hf import load_hf_config

    if name_or_path.lower() in preset_names():
        return load_preset(name_or_path)
    path = Path(name_or_path).expanduser()
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
        has_config = is_dir and (path / "config.json").is_file()
    except OSError:  # a name longer than a path may be (ENAMETOOLONG): not a path
        is_file = is_dir = has_config = False
    if is_file or has_config:
        return load_hf_config(path)
    if is_dir:
        raise ModelConfigError("model", "directory has no config.json", str(path))
    from memplan.model.hub import hub_config_path, looks_like_hub_id, split_hub_id

    if looks_like_hub_id(name_or_path):
        return load_hf_config(hub_config_path(name_or_path), name=split_hub_id(name_or_path.strip())[0])
    raise _unknown_preset(name_or_path)
