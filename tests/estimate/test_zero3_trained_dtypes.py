"""DeepSpeed ZeRO-3 refuses trained parameters of two dtypes (cell Z11, docs/benchmarks.md, helpers zero18/zero18b):
under zero.Init the engine does not cast the model, so peft's fp32 adapters meet the bf16 ``modules_to_save`` copy,
and ``deepspeed.initialize`` asserts one dtype (stage3.py ``_create_fp16_partitions_with_defragmentation`` ->
zero/utils.py ``defragment``). memplan priced that job; it now refuses it, exit 2, from every dialect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import JobConfigError
from memplan.inputs import JobRequest, load_job
from tests.estimate.test_deepspeed_engine_moments import TINY4

LORA = ["--peft", "lora", "--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--modules-to-save", "lm_head"]


def _files(tmp_path: Path, stage: int, **zero: object) -> tuple[str, str]:
    (tmp_path / "config.json").write_text(json.dumps(TINY4))
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **zero}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    return str(tmp_path / "config.json"), str(tmp_path / "ds.json")


def _run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, ["estimate", *args, "--gpus", "2", "--seq", "32"])


@pytest.mark.parametrize("dialect", [["--framework", "deepspeed", "--zero", "3", "--precision", "bf16-mixed"],
                                     ["--framework", "hf", "--zero", "3", "--precision", "bf16-mixed"], ["ds"]],
                         ids=["flags", "hf --zero 3", "deepspeed config"])
def test_fp32_adapters_beside_a_bf16_copy_are_refused_at_zero3(tmp_path: Path, dialect: list[str]) -> None:
    config, ds = _files(tmp_path, 3)
    args = ["--deepspeed-config", ds] if dialect == ["ds"] else dialect
    result = _run(config, *args, *LORA)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    for part in ("--adapter-dtype", "fp32 adapters beside bf16 --modules-to-save copies (lm_head)", "--zero 3",
                 "one flat buffer of one dtype", "give --adapter-dtype bf16"):
        assert part in text, text


def test_an_hf_command_line_with_a_zero3_config_is_refused(tmp_path: Path) -> None:
    """TRL's SFT script under ``--deepspeed`` (the TrainingArguments reader) with ``--lora_modules_to_save``."""
    config, ds = _files(tmp_path, 3)
    (tmp_path / "run.sh").write_text(f"torchrun --nproc_per_node 2 sft.py --model_name_or_path {config} --bf16 "
                                     f"--per_device_train_batch_size 1 --max_length 32 --deepspeed {ds} --use_peft "
                                     "--lora_r 8 --lora_target_modules q_proj v_proj --lora_modules_to_save lm_head\n")
    result = CliRunner().invoke(app, ["estimate", config, "--hf-args", str(tmp_path / "run.sh")])
    assert result.exit_code == 2, result.output
    assert "--modules-to-save copies (lm_head)" in " ".join(result.output.split())


def test_the_python_api_refuses_it(tmp_path: Path) -> None:
    config, ds = _files(tmp_path, 3)
    flags = {"gpus": 2, "deepspeed_config": ds, "peft": "lora", "modules_to_save": "lm_head"}
    with pytest.raises(JobConfigError, match="--adapter-dtype.*one dtype"):
        load_job(JobRequest(model=config, flags=flags))


@pytest.mark.parametrize("args", [["--zero", "3", "--adapter-dtype", "bf16"], ["--zero", "2"], ["--zero", "1"],
                                  ["--zero", "3", "--offload-params", "--offload-optimizer"]],
                         ids=["same dtype", "zero 2 casts", "zero 1 casts", "offload_param copies"])
def test_what_the_engine_runs_is_priced(tmp_path: Path, args: list[str]) -> None:
    """ZeRO-1/2 cast every parameter to bf16 (``_cast_module_mixed_precision``); ZeRO-3 with ``offload_param`` copies
    each partition into a CPU buffer of the engine's dtype (``_move_to_flat_buffer``): no assertion there."""
    config, _ = _files(tmp_path, 3)
    result = _run(config, "--framework", "deepspeed", "--precision", "bf16-mixed", *args, *LORA)
    assert result.exit_code == 0, result.output


def test_fp32_adapters_beside_trained_bf16_base_weights_are_refused_at_zero3() -> None:
    """The same assertion holds for ``--trainable`` base weights beside the adapters (defragment takes every trained
    partition); int18 priced this job (review of session 18). bf16 adapters beside them run."""
    base = ["estimate", "llama-3.2-1b", "--framework", "deepspeed", "--zero", "3", "--gpus", "2", "--peft", "lora",
            "--trainable", "norm", "--precision", "bf16-mixed"]
    refused = CliRunner().invoke(app, base)
    assert refused.exit_code == 2, refused.output
    assert "--trainable base weights (norm)" in refused.output and "Traceback" not in refused.output
    assert CliRunner().invoke(app, [*base, "--adapter-dtype", "bf16"]).exit_code == 0
