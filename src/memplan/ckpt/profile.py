"""``memplan ckpt profile``: per-block predictors of a Hugging Face model, measured on CPU.

The model is built with ``transformers`` from its config (a shipped preset or a ``config.json``;
random weights, nothing downloaded), usually with fewer layers than the original: identical blocks
have identical predictors, so two layers measure what every layer of the full model keeps. Each
size runs one training step through :meth:`CheckpointController.warm_up` (one block checkpointed
and probed, the others measured as they run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memplan.ckpt.predictor import QuadraticFit
from memplan.ckpt.wrapper import auto_checkpoint, controller_of
from memplan.errors import ConfigError, ModelConfigError

__all__ = ["ProfileResult", "SeriesProfile", "load_hf_config_dict", "profile_model"]

#: Budget used while profiling: large enough never to interfere.
_PROFILE_BUDGET = 2**50


@dataclass(frozen=True, kw_only=True)
class SeriesProfile:
    """One predictor: what was measured at each size and the fit."""

    name: str
    points: tuple[tuple[int, float], ...]
    fit: QuadraticFit | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "points": [list(p) for p in self.points],
                "fit": self.fit.to_dict() if self.fit else None}


@dataclass(frozen=True, kw_only=True)
class ProfileResult:
    """Per-block and per-phase predictors of a model, sizes in tokens (batch × sequence length)."""

    model: str
    model_type: str
    n_layers_profiled: int
    n_layers_model: int
    batch_size: int
    seq_lengths: tuple[int, ...]
    n_params_profiled: int
    series: tuple[SeriesProfile, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "model_type": self.model_type, "n_layers_profiled": self.n_layers_profiled,
            "n_layers_model": self.n_layers_model, "batch_size": self.batch_size,
            "seq_lengths": list(self.seq_lengths), "n_params_profiled": self.n_params_profiled,
            "size_unit": "tokens", "series": [s.to_dict() for s in self.series],
        }


def load_hf_config_dict(name_or_path: str) -> dict[str, Any]:
    """A preset's or a ``config.json``'s contents (a preset name wins over a same-named path)."""
    from memplan.model.presets import preset_config, preset_names

    if name_or_path.lower() in preset_names():
        return preset_config(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        preset_config(name_or_path)  # raises the "unknown preset" error with suggestions
    from memplan.bounds import parse_json
    from memplan.textfile import read_text_file

    text = read_text_file(path, field="model", error=ModelConfigError)
    try:
        data = parse_json(text, field="model")
    except ValueError as exc:
        raise ModelConfigError("model", "is not a readable JSON config", str(path), hint=str(exc)) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelConfigError("model", "config.json must be an object with a model_type", str(path))
    data.pop("_memplan", None)
    return data


def _build(config_dict: dict[str, Any], layers: int) -> tuple[torch.nn.Module, int, str]:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    values = dict(config_dict)
    model_type = str(values.pop("model_type"))
    try:
        config = AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as exc:
        raise ModelConfigError("model", f"transformers cannot build model_type {model_type!r}", hint=str(exc)) from None
    full_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if layers > 0 and full_layers:
        config.num_hidden_layers = min(layers, full_layers)
        if hasattr(config, "layer_types") and isinstance(config.layer_types, list):
            config.layer_types = config.layer_types[: config.num_hidden_layers]
    config.use_cache = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train(), full_layers, model_type


def profile_model(
    name_or_path: str, *, seq_lengths: Sequence[int] = (64, 128, 256, 512), batch_size: int = 1, layers: int = 2,
) -> ProfileResult:
    """Measure per-block activation bytes and forward seconds, and the phase terms, at each length."""
    if not seq_lengths or any(n <= 0 for n in seq_lengths):
        raise ConfigError("--sizes", "must be positive sequence lengths", list(seq_lengths))
    if batch_size <= 0:
        raise ConfigError("--batch", "must be a positive number of sequences", batch_size)
    if layers < 0:
        raise ConfigError("--layers", "must be 0 (all layers) or a positive number of layers", layers)
    model, full_layers, model_type = _build(load_hf_config_dict(name_or_path), layers)
    vocab = int(getattr(model.config, "vocab_size", 1000))
    max_len = int(getattr(model.config, "max_position_embeddings", 0) or getattr(model.config, "n_positions", 0) or 0)
    if max_len and max(seq_lengths) > max_len:
        raise ConfigError("--sizes", f"longest length exceeds the model's {max_len} positions", max(seq_lengths))
    model = auto_checkpoint(model, _PROFILE_BUDGET)
    ctl = controller_of(model)
    gen = torch.Generator().manual_seed(0)

    def step(n: int) -> Any:
        ids = torch.randint(0, vocab, (batch_size, n), generator=gen)
        return lambda: model(input_ids=ids, labels=ids).loss.backward()

    ctl.warm_up([step(n) for n in sorted(seq_lengths)])
    series = tuple(
        SeriesProfile(name=name, points=tuple(sorted((int(k), float(v)) for k, v in s.points.items())), fit=s.fit)
        for name, s in ctl.series().items()
    )
    return ProfileResult(
        model=name_or_path, model_type=model_type, n_layers_profiled=ctl.n_blocks, n_layers_model=full_layers,
        batch_size=batch_size, seq_lengths=tuple(sorted(seq_lengths)),
        n_params_profiled=sum(p.numel() for p in model.parameters()), series=series,
    )
