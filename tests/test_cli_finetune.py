"""Fine-tuning flags through the command line: bad module names and ranks exit 2 with one line naming
the flag; the JSON result carries trainable and frozen parameter counts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli import app

BASE = ("estimate", "llama-3.2-1b", "--framework", "hf", "--peft", "lora")

BAD = [
    ("--lora-targets", ("--lora-targets", "qq_proj")),
    ("--lora-rank", ("--lora-rank", "1000", "--lora-targets", "k_proj")),
    ("--lora-rank", ("--lora-rank", "0")),
    ("--lora-rank", ("--lora-rank", "-4")),
    ("--lora-rank-pattern", ("--lora-targets", "q_proj", "--lora-rank-pattern", "q_proj=4096")),
    ("--lora-rank-pattern", ("--lora-rank-pattern", "q_proj:8")),
    ("--lora-dropout", ("--lora-dropout", "1.5")),
    ("--modules-to-save", ("--modules-to-save", "no_such_module")),
    ("--trainable", ("--trainable", "layers.99")),
    ("--quant-compute-dtype", ("--quantize-base", "nf4", "--quant-compute-dtype", "fp8")),
    ("--quant-compute-dtype", ("--quantize-base", "nf4", "--quant-compute-dtype", "int8")),
]


@pytest.mark.parametrize(("flag", "args"), BAD)
def test_bad_finetune_input_exits_2_with_one_line(flag: str, args: tuple[str, ...]) -> None:
    result = CliRunner().invoke(app, [*BASE, *args])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and flag in lines[0], result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "flag"), [
    (("--quantize-base", "nf4"), "--quantize-base"),  # a quantized base cannot train: needs --peft
    (("--lora-rank", "16"), "lora-rank"),  # a LoRA setting without --peft
    (("--trainable", "adapters"), "--trainable"),
])
def test_fine_tuning_settings_without_peft_exit_2(args: tuple[str, ...], flag: str) -> None:
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", *args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and flag in lines[0], result.output


def test_json_has_trainable_and_frozen_params() -> None:
    full = json.loads(CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--framework", "hf", "--json"]).output)
    assert full["frozen_params"] == 0 and full["trainable_params"] == full["total_parameters"]
    lora = json.loads(CliRunner().invoke(app, [*BASE, "--json"]).output)
    # r=8 on q_proj (2048 -> 2048) and v_proj (2048 -> 512) of 16 layers.
    assert lora["trainable_params"] == 16 * 8 * ((2048 + 2048) + (2048 + 512))
    assert lora["frozen_params"] == full["total_parameters"]


@pytest.mark.parametrize(("model", "adapted", "peft_default"), [
    ("gpt2-xl", "c_attn", True), ("llama-3.2-1b", "q_proj,v_proj", True), ("qwen3-30b-a3b", "q_proj,v_proj", False)])
def test_auto_lora_targets_follow_pefts_default_for_the_model_type(model: str, adapted: str,
                                                                 peft_default: bool) -> None:
    """``--lora-targets auto`` is peft's default for the model type (GPT-2: ``c_attn``), and the result says
    which modules it adapted and whether peft itself has a default for the type."""
    result = CliRunner().invoke(app, ["estimate", model, "--framework", "hf", "--peft", "lora", "--json"])
    assert result.exit_code == 0, result.output
    note = next(a for a in json.loads(result.output)["assumptions"] if a.startswith("--lora-targets auto"))
    assert f"auto: {adapted}" in note
    assert ("peft has no default" not in note) == peft_default


def test_auto_lora_targets_a_model_lacks_exit_2_with_one_line() -> None:
    """DeepSeek-V3 (MLA: no q_proj/v_proj, and no peft default): one line naming the flag, what auto stood for
    and the modules the model has."""
    result = CliRunner().invoke(app, ["estimate", "deepseek-v3", "--peft", "lora"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--lora-targets" in lines[0] and "auto stands for" in lines[0], result.output
    assert "kv_b_proj" in lines[0]
