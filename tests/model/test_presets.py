"""Shipped presets: listing, loading by name or path, helpful errors, and the public surface."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memplan.model as model_pkg
from memplan.errors import ModelConfigError
from memplan.model import PresetInfo, list_presets, load_model, load_preset, total_params
from memplan.model.presets import preset_config, preset_names

EXPECTED = {
    "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "llama-3.2-1b", "llama-3.2-3b", "qwen2.5-7b",
    "qwen2.5-72b", "qwen3-8b", "qwen3-32b", "mistral-7b", "gemma-2-9b", "gpt2", "gpt2-xl",
    "mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3",
    "deepseek-v2-lite",
}

#: Published totals (transformers' count, bf16 checkpoints) to the stated precision.
KNOWN_TOTALS_B = {
    "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "llama-3.1-405b": 405.85, "mixtral-8x7b": 46.70,
    "qwen3-30b-a3b": 30.53, "qwen3-235b-a22b": 235.09, "deepseek-v3": 671.03, "gpt2": 0.12,
}


def test_all_expected_presets_ship() -> None:
    assert set(preset_names()) == EXPECTED


def test_list_presets() -> None:
    infos = list_presets()
    assert [info.name for info in infos] == sorted(EXPECTED)
    by_name = {info.name: info for info in infos}
    assert all(isinstance(info, PresetInfo) for info in infos)
    assert by_name["mixtral-8x7b"].is_moe and not by_name["llama-3.1-8b"].is_moe
    assert by_name["deepseek-v3"].model_type == "deepseek_v3"
    assert (by_name["llama-3.1-70b"].num_layers, by_name["llama-3.1-70b"].hidden_size) == (80, 8192)
    assert "huggingface.co/meta-llama/Llama-3.1-8B" in by_name["llama-3.1-8b"].description
    for name, billions in KNOWN_TOTALS_B.items():
        assert round(by_name[name].total_params / 1e9, 2) == billions


def test_preset_config_strips_provenance_and_is_a_copy() -> None:
    config = preset_config("gpt2")
    assert "_memplan" not in config and config["n_layer"] == 12
    config["n_layer"] = 1
    assert preset_config("gpt2")["n_layer"] == 12


def test_load_preset_case_insensitive() -> None:
    assert load_preset("Llama-3.1-8B") == load_preset("llama-3.1-8b")
    assert total_params(load_preset("llama-3.2-1b")) == 1_235_814_400


def test_unknown_preset_suggests_closest() -> None:
    with pytest.raises(ModelConfigError) as info:
        load_preset("llama-3.1-8")
    message = str(info.value)
    assert "'llama-3.1-8b'" in message and "qwen3-8b" in message


def test_load_model_accepts_name_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(preset_config("mistral-7b")))
    assert load_model("mistral-7b").model_type == "mistral"
    assert load_model(str(tmp_path / "config.json")).num_layers == 32
    assert load_model(str(tmp_path)).name == tmp_path.name


def test_load_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="mixtral-8x7b"):
        load_model("mixtral-8x7")
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model(str(tmp_path))


def test_public_surface() -> None:
    for name in ("load_model", "load_preset", "list_presets", "load_hf_config", "model_from_hf_config"):
        assert name in model_pkg.__all__ and callable(getattr(model_pkg, name))
    assert sorted(model_pkg.__all__) == sorted(set(model_pkg.__all__))
