"""--peft-config: real adapter_config.json files written by peft's own LoraConfig.save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import ConfigError, UnsupportedError
from memplan.frameworks.peft_config import apply_peft_config, peft_job
from memplan.inputs import JobRequest, load_job
from memplan.job import Job
from memplan.model import load_model

peft = pytest.importorskip("peft")


def _save(tmp_path: Path, **kwargs: object) -> Path:
    folder = tmp_path / "adapter"
    peft.LoraConfig(**kwargs).save_pretrained(str(folder))
    return folder / "adapter_config.json"


def test_a_real_lora_config_maps(tmp_path: Path) -> None:
    path = _save(tmp_path, r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj"],
                 modules_to_save=["lm_head"], use_rslora=True, rank_pattern={"v_proj": 4},
                 base_model_name_or_path="meta-llama/Llama-3.2-1B", task_type="CAUSAL_LM")
    loaded = load_job(JobRequest(model="llama-3.2-1b", peft_config=str(path)))
    ft = loaded.job.finetune
    assert (ft.peft, ft.lora_rank, ft.lora_alpha, ft.lora_dropout, ft.rslora) == ("lora", 16, 32.0, 0.05, True)
    assert set(ft.lora_targets.split(",")) == {"q_proj", "k_proj", "v_proj"}
    assert ft.rank_pattern == {"v_proj": 4} and ft.modules_to_save == "lm_head"
    keys = {s.key for s in loaded.settings}
    assert keys == set(json.loads(path.read_text()))  # every key of the file is classified
    assert loaded.unmodelled == ()


def test_dora_all_linear_and_typed_flags_win(tmp_path: Path) -> None:
    path = _save(tmp_path, r=8, use_dora=True, target_modules="all-linear")
    loaded = load_job(JobRequest(model="llama-3.2-1b", peft_config=str(path), flags={"lora_rank": 64}))
    assert loaded.job.finetune.peft == "dora"
    assert loaded.job.finetune.lora_targets == "all-linear"
    assert loaded.job.finetune.lora_rank == 64  # --lora-rank beside --peft-config needs no --peft


def test_a_regex_target_is_expanded_against_the_model() -> None:
    model = load_model("llama-3.2-1b")
    job, settings = peft_job({"peft_type": "LORA", "target_modules": r".*\.(q_proj|down_proj)"}, Job(), model=model)
    assert job.finetune.lora_targets == "q_proj,down_proj"
    job, settings = peft_job({"peft_type": "LORA", "target_modules": r"model\.layers\.0\..*q_proj"}, Job(), model=model)
    assert job.finetune.lora_targets == "q_proj"
    assert [s.effect for s in settings if s.key == "target_modules"] == ["not-modelled"]  # one layer of 16
    with pytest.raises(ConfigError, match="matches none"):
        peft_job({"peft_type": "LORA", "target_modules": "nothing_here"}, Job(), model=model)


def test_unmodelled_keys_are_stated(tmp_path: Path) -> None:
    path = _save(tmp_path, r=8, target_modules=["q_proj"], bias="all", layers_to_transform=[0, 1])
    loaded = load_job(JobRequest(model="llama-3.2-1b", peft_config=str(path)))
    assert {s.key for s in loaded.unmodelled} == {"bias", "layers_to_transform"}


def test_another_base_model_is_one_line_exit_2(tmp_path: Path) -> None:
    path = _save(tmp_path, r=8, base_model_name_or_path="Qwen/Qwen3-8B")
    with pytest.raises(ConfigError, match="another base model"):
        apply_peft_config(path, Job(), model_ref="llama-3.2-1b", model=load_model("llama-3.2-1b"))
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--peft-config", str(path)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


def test_other_peft_types_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ia3"
    peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[]).save_pretrained(str(folder))
    with pytest.raises(UnsupportedError, match="peft_type 'IA3' is not modelled"):
        apply_peft_config(folder, Job())
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--peft-config", str(folder)])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output


def test_json_output_lists_the_settings(tmp_path: Path) -> None:
    path = _save(tmp_path, r=8, target_modules=["q_proj"], bias="lora_only")
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--peft-config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [s.split(" = ")[0] for s in data["unmodelled_settings"]] == ["--peft-config bias"]
    assert {s["effect"] for s in data["input_settings"]} <= {"modelled", "no-memory-effect", "not-modelled"}
    text = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--peft-config", str(path)], env={"COLUMNS": "300"})
    assert "Not modelled" in text.stdout and "bias" in text.stdout
