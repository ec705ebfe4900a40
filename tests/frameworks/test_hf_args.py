"""--hf-args: real TrainingArguments JSON (transformers' to_json_string) and script command lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import ConfigError, UnsupportedError
from memplan.frameworks.hf_args import hf_args_job, parse_hf_command_line
from memplan.frameworks.hf_fields import OPTIMIZERS, UNMODELLED_OPTIMIZERS
from memplan.estimate import estimate
from memplan.inputs import JobRequest, load_job
from memplan.model import load_model
from memplan.job import Job

transformers = pytest.importorskip("transformers")


def _args_json(tmp_path: Path, **kwargs: object) -> Path:
    late = {key: kwargs.pop(key) for key in ("bf16", "deepspeed") if key in kwargs}
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), **kwargs)
    for key, value in late.items():  # refused here without a bf16 GPU / deepspeed installed; a GPU run writes them
        setattr(args, key, value)
    path = tmp_path / "training_args.json"
    path.write_text(args.to_json_string())
    return path


def test_a_real_training_arguments_json_maps(tmp_path: Path) -> None:
    path = _args_json(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=8, bf16=True,
                      gradient_checkpointing=True, optim="paged_adamw_8bit", torch_compile=True)
    loaded = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 2}, hf_args=str(path)))
    job = loaded.job
    assert job.framework == "hf"
    assert (job.batch.micro_batch_size, job.batch.global_batch_size) == (4, 4 * 8 * 2)
    assert job.precision.name == "bf16-mixed"
    assert job.optimizer.name == "paged-adamw8bit"
    assert job.recompute.mode == "full" and job.recompute.reentrant is False  # transformers' use_reentrant=False
    assert job.compile and loaded.unmodelled == ()
    # compiled layers under gradient checkpointing have no partitioner rule: the estimate says so
    est = estimate(load_model("llama-3.2-1b"), job, settings=loaded.settings)
    assert [s.split(":")[0] for s in est.unmodelled_settings] == ["--compile compiled layers = true",
                                                                  "--compile compiled model = true"]
    assert job.compile_loss == "auto"  # the model's forward computes the loss, compiled with it


def test_a_label_smoother_keeps_the_loss_out_of_the_compiled_model(tmp_path: Path) -> None:
    path = _args_json(tmp_path, torch_compile=True, label_smoothing_factor=0.1)
    job = load_job(JobRequest(model="llama-3.2-1b", hf_args=str(path))).job
    assert job.compile and job.compile_loss == "off"  # Trainer.compute_loss pops the labels for the smoother


def test_every_field_of_a_real_json_is_classified(tmp_path: Path) -> None:
    path = _args_json(tmp_path)
    data = json.loads(path.read_text())
    loaded = load_job(JobRequest(model="llama-3.2-1b", hf_args=str(path)))
    assert [s.key for s in loaded.settings] == list(data)
    unknown = [s.key for s in loaded.settings if s.note == "a field memplan does not know"]
    assert unknown == []
    assert loaded.job.precision.name == "fp32"  # neither bf16 nor fp16: the Trainer trains in fp32
    assert loaded.job.optimizer.implementation == OPTIMIZERS[data["optim"]][1]


def test_use_reentrant_follows_transformers_and_torch(tmp_path: Path) -> None:
    base = {"activation_checkpointing": True}
    job, _ = hf_args_job({**base, "activation_checkpointing_kwargs": {"use_reentrant": True}}, Job())
    assert job.recompute.reentrant is True
    job, _ = hf_args_job({**base, "activation_checkpointing_kwargs": {"preserve_rng_state": True}}, Job())
    assert job.recompute.reentrant is True  # kwargs without use_reentrant: torch.utils.checkpoint's default
    job, settings = hf_args_job({**base, "activation_checkpointing_kwargs": {"every_n_layers": 2}}, Job())
    assert any(s.effect == "not-modelled" for s in settings)


def test_unknown_optimizer_is_one_line_exit_2(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="known: adamw_torch, adamw_torch_fused"):
        hf_args_job({"optim": "adamw_magic"}, Job())
    with pytest.raises(UnsupportedError, match="galore_adamw_8bit"):
        hf_args_job({"optim": "galore_adamw_8bit"}, Job())
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"optim": "adamw_magic"}))
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--hf-args", str(path)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


def test_every_transformers_optimizer_name_is_known() -> None:
    names = {o.value for o in transformers.training_args.OptimizerNames}
    assert names == set(OPTIMIZERS) | set(UNMODELLED_OPTIMIZERS)


SCRIPT = """\
#!/bin/bash
BS=2
torchrun --nproc_per_node 4 --nnodes 2 sft.py \\
    --model_name_or_path meta-llama/Llama-3.2-1B \\
    --per_device_train_batch_size $BS --gradient_accumulation_steps 4 \\
    --bf16 --gradient_checkpointing --max_length 2048 --packing \\
    --optim adamw_torch_fused --use_peft --lora_r 32 --lora_alpha 16 \\
    --lora_target_modules q_proj k_proj v_proj o_proj --load_in_4bit --use_bnb_nested_quant \\
    --logging_steps 10 --learning_rate 2e-4 --report_to none
"""


def test_a_trl_command_line_maps(tmp_path: Path) -> None:
    path = tmp_path / "run.sh"
    path.write_text(SCRIPT)
    assert parse_hf_command_line(SCRIPT)["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    loaded = load_job(JobRequest(model="llama-3.2-1b", hf_args=str(path)))
    job = loaded.job
    assert job.parallel.world_size == 8
    assert (job.batch.micro_batch_size, job.batch.global_batch_size, job.batch.seq_length) == (2, 2 * 4 * 8, 2048)
    assert job.batch.packing and job.precision.name == "bf16-mixed" and job.recompute.mode == "full"
    assert (job.optimizer.name, job.optimizer.implementation) == ("adamw", "fused")
    ft = job.finetune
    assert (ft.peft, ft.lora_rank, ft.lora_targets, ft.quantize_base, ft.double_quant) == \
        ("lora", 32, "q_proj,k_proj,v_proj,o_proj", "nf4", True)
    assert loaded.unmodelled == ()


def test_the_command_line_names_the_model(tmp_path: Path) -> None:
    path = tmp_path / "run.sh"
    path.write_text(SCRIPT.replace("meta-llama/Llama-3.2-1B", "llama-3.2-1b"))
    assert load_job(JobRequest(hf_args=str(path))).model.name == "llama-3.2-1b"


def test_deepspeed_inside_the_args_and_flag_precedence(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"},
                                                  "train_micro_batch_size_per_gpu": "auto"}))
    path = _args_json(tmp_path, per_device_train_batch_size=2, deepspeed=str(tmp_path / "ds.json"))
    loaded = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 4, "mbs": 1}, hf_args=str(path)))
    assert loaded.job.framework == "deepspeed" and loaded.job.sharding.zero == 2
    assert loaded.job.batch.micro_batch_size == 1  # the typed flag wins


def test_fsdp_options(tmp_path: Path) -> None:
    job, _ = hf_args_job({"fsdp": "full_shard auto_wrap offload", "fsdp_config": {"activation_checkpointing": True}},
                         Job(parallel=Job().parallel.__class__(world_size=8)))
    assert (job.sharding.fsdp, job.offload.params, job.recompute.mode) == ("full", True, "full")
    job, _ = hf_args_job({"fsdp": "shard_grad_op"}, Job(parallel=Job().parallel.__class__(world_size=8)))
    assert (job.sharding.fsdp, job.sharding.zero) == ("none", 2)
    with pytest.raises(ConfigError, match="fsdp"):
        hf_args_job({"fsdp": "fully_sharded"}, Job())


def test_fit_report_and_save_job_carry_the_settings(tmp_path: Path) -> None:
    path = _args_json(tmp_path, per_device_train_batch_size=2, torch_empty_cache_steps=5)
    runner = CliRunner()
    fit = runner.invoke(app, ["fit", "llama-3.2-1b", "--gpus", "2", "--hf-args", str(path), "--top", "1", "--json"])
    assert fit.exit_code in (0, 1), fit.output
    assert [s.split(" = ")[0] for s in json.loads(fit.stdout)["unmodelled_settings"]] == [
        "--hf-args torch_empty_cache_steps"]
    html = tmp_path / "report.html"
    report = runner.invoke(app, ["report", "llama-3.2-1b", "--gpus", "2", "--hf-args", str(path), "-o", str(html)])
    assert report.exit_code == 0, report.output
    assert "torch_empty_cache_steps" in html.read_text()
    saved = tmp_path / "job.yaml"
    first = runner.invoke(app, ["estimate", "llama-3.2-1b", "--gpus", "2", "--hf-args", str(path), "--mbs", "3",
                                "--save-job", str(saved), "--json"])
    again = runner.invoke(app, ["estimate", "--job", str(saved), "--json"])
    assert first.exit_code == again.exit_code == 0, again.output
    assert json.loads(first.stdout) == json.loads(again.stdout)


def test_trace_takes_the_arguments(tmp_path: Path) -> None:
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 2, "optim": "adamw_torch", "bf16": False,
                                "fp16": False, "torch_compile": True}))
    result = CliRunner().invoke(app, ["trace", "gpt2", "--hf-args", str(path), "--seq", "64", "--device", "cpu",
                                      "--iterations", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):])
    job = data["options"]["job"]
    assert job["batch"]["micro_batch_size"] == 2 and job["precision"]["name"] == "fp32"
    assert job["compile"] is True and data["compiled_layers"]  # the decoder layers ran as partitioned graphs
    assert [s.split(" = ")[0] for s in data["unmodelled_settings"]] == ["--compile compiled model"]


@pytest.mark.parametrize("args, precision", [
    ({"bf16": False}, "fp32"),  # Trainer (and TRL) without bf16 or fp16 trains in fp32; memplan kept bf16-mixed
    ({"bf16": False, "fp16": True}, "fp16-mixed"),
    ({"bf16": True}, "bf16-mixed"),
    ({"fp16": False}, "bf16-mixed"),  # bf16 not given: TRL's default is bf16, Trainer's fp32; the job's is kept
])
def test_bf16_given_decides_the_precision(tmp_path: Path, args: dict[str, bool], precision: str) -> None:
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 2, **args}))
    loaded = load_job(JobRequest(model="llama-3.2-1b", hf_args=str(path), flags={"gpus": 2}))
    assert loaded.job.precision.name == precision
