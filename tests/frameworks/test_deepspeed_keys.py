"""Every DeepSpeed config key is classified, and --deepspeed-config reports each key of the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.frameworks.deepspeed_config import job_with_deepspeed
from memplan.frameworks.deepspeed_keys import KEYS, SECTIONS, classify, deepspeed_key_list, deepspeed_settings
from memplan.frameworks.hf_args import hf_args_job
from memplan.job import Job, Parallelism

_UNCLASSIFIED = ("not a DeepSpeed config key", "a DeepSpeed key memplan has not classified")


def test_every_key_of_deepspeeds_list_is_classified() -> None:
    keys = deepspeed_key_list()
    assert len(keys) > 300 and "zero_optimization.offload_param.device" in keys
    unclassified = [k for k in keys if classify(k)[1] in _UNCLASSIFIED]
    assert unclassified == []
    assert {classify(k)[0] for k in keys} == {"modelled", "no-memory-effect", "not-modelled"}


def test_the_shipped_list_names_its_deepspeed_commit() -> None:
    from importlib import resources

    first = resources.files("memplan.frameworks").joinpath("deepspeed_key_list.txt").read_text().splitlines()[0]
    assert first.startswith("# DeepSpeed ") and " commit " in first and "unknown" not in first


def test_the_table_names_only_deepspeed_keys() -> None:
    keys = set(deepspeed_key_list())
    assert [k for k in KEYS if classify(k)[1] == _UNCLASSIFIED[0]] == []
    assert [p for p in SECTIONS if not any(k == p or k.startswith(p + ".") for k in keys)] == []


_Z3 = {"zero_optimization": {"stage": 3}}
_PART = {"partition_activations": True}
#: Per modelled key: a config that sets it, and the same config without it.
_MODELLED_CASES = {
    "train_batch_size": ({"train_batch_size": 64}, {}),
    "train_micro_batch_size_per_gpu": ({"train_micro_batch_size_per_gpu": 3}, {}),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 4}, {}),
    "zero_optimization.stage": ({"zero_optimization": {"stage": 2}}, {}),
    "zero_optimization.offload_optimizer.device":
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, _Z3),
    "zero_optimization.offload_param.device":
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, _Z3),
    "communication_data_type": ({"communication_data_type": "fp32"}, {}),
    "bf16.enabled": ({"bf16": {"enabled": True}}, {"bf16": {"enabled": False}}),
    "bfloat16.enabled": ({"bfloat16": {"enabled": True}}, {"bfloat16": {"enabled": False}}),
    "fp16.enabled": ({"fp16": {"enabled": True}}, {"fp16": {"enabled": False}}),
    "optimizer.type": ({"optimizer": {"type": "SGD"}}, {}),
    "optimizer.params.momentum": ({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}},
                                  {"optimizer": {"type": "SGD"}}),
    "activation_checkpointing.partition_activations": ({"activation_checkpointing": {"partition_activations": True}},
                                                       {}),
    "activation_checkpointing.cpu_checkpointing": ({"activation_checkpointing": {"cpu_checkpointing": True}}, {}),
    "activation_checkpointing.contiguous_memory_optimization": (
        {"activation_checkpointing": {**_PART, "contiguous_memory_optimization": True, "number_checkpoints": 4}},
        {"activation_checkpointing": {**_PART, "number_checkpoints": 4}}),
    "activation_checkpointing.number_checkpoints": (
        {"activation_checkpointing": {**_PART, "contiguous_memory_optimization": True, "number_checkpoints": 8}},
        {"activation_checkpointing": {**_PART, "contiguous_memory_optimization": True, "number_checkpoints": 4}}),
}


def test_every_modelled_key_changes_the_job() -> None:
    assert {k for k, (effect, _) in {**KEYS, **SECTIONS}.items() if effect == "modelled"} == set(_MODELLED_CASES)
    base = Job(parallel=Parallelism(world_size=8))
    for key, (config, without) in _MODELLED_CASES.items():
        assert job_with_deepspeed(config, base) != job_with_deepspeed(without, base), key
    assert job_with_deepspeed({"fp16": {"enabled": False}}, base).precision.name == "fp32"
    assert job_with_deepspeed({"fp16": {"enabled": True}}, base).precision.name == "fp16-mixed"


def test_values_auto_off_assumed_and_unknown() -> None:
    config = {"train_micro_batch_size_per_gpu": "auto",
              "zero_optimization": {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": "auto"},
              "activation_checkpointing": {"cpu_checkpointing": False},
              "compile": {"deepcompile": True}, "elasticity": {"enabled": False}, "zero_optimisation": {"stage": 3}}
    got = {s.key: (s.effect, s.note) for s in deepspeed_settings(config)}
    assert got["train_micro_batch_size_per_gpu"][0] == "modelled" and '"auto"' in got["train_micro_batch_size_per_gpu"][1]
    # stage 0 (the config names none): only DeepSpeed's ZeRO optimizers read the bucket keys (helper ds15)
    assert got["zero_optimization.allgather_bucket_size"][0] == "no-memory-effect"
    assert '"auto"' in got["zero_optimization.allgather_bucket_size"][1]
    assert got["zero_optimization.reduce_bucket_size"][0] == "no-memory-effect"
    assert got["activation_checkpointing.cpu_checkpointing"][0] == "modelled"
    assert got["elasticity.enabled"][0] == "no-memory-effect"
    assert got["compile.deepcompile"][0] == "not-modelled"
    assert got["zero_optimisation.stage"] == ("not-modelled", "not a DeepSpeed config key")
    assert deepspeed_settings({"zero_optimization": {"reduce_bucket_size": 2e8}})[0].effect == "no-memory-effect"
    stage1 = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 2e8, "allgather_bucket_size": 2e8}}
    assert [s.effect for s in deepspeed_settings(stage1)[1:]] == ["modelled", "not-modelled"]
    stage3 = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2e8}}
    assert deepspeed_settings(stage3)[1].effect == "modelled"  # ZeRO-3's reduce bucket is priced at any size


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8},
        "activation_checkpointing": {"partition_activations": True, "profile": False},
        "progressive_layer_drop": {"theta": 0.5},
        "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "x"},
    }))
    return path


def test_estimate_json_reports_every_key(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--deepspeed-config", str(_config(tmp_path)),
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    effects = {s["key"]: s["effect"] for s in data["input_settings"] if s["source"] == "--deepspeed-config"}
    assert effects == {
        "train_micro_batch_size_per_gpu": "modelled", "bf16.enabled": "modelled",
        "zero_optimization.stage": "modelled", "zero_optimization.zero_hpz_partition_size": "not-modelled",
        "activation_checkpointing.partition_activations": "modelled",
        "activation_checkpointing.profile": "no-memory-effect", "progressive_layer_drop.theta": "not-modelled",
        "tensorboard.enabled": "no-memory-effect",
        "tensorboard.output_path": "no-memory-effect", "tensorboard.job_name": "no-memory-effect",
    }
    assert [s["key"] for s in data["input_settings"] if s["effect"] == "not-modelled"] == [
        "zero_optimization.zero_hpz_partition_size", "progressive_layer_drop.theta"]
    assert [s.split(" = ")[0] for s in data["unmodelled_settings"]] == [
        "--deepspeed-config zero_optimization.zero_hpz_partition_size",
        "--deepspeed-config progressive_layer_drop.theta"]


def test_estimate_text_warns(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--deepspeed-config", str(_config(tmp_path))],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.stdout.splitlines() if line.startswith("Not modelled (2 input settings")]
    assert "--deepspeed-config progressive_layer_drop.theta" in line
    assert "tensorboard" not in line


def test_hf_args_deepspeed_object_is_reported_too() -> None:
    args = {"per_device_train_batch_size": 2, "bf16": True,
            "deepspeed": {"zero_optimization": {"stage": 2, "overlap_comm": True}, "wandb": {"enabled": True}}}
    job, settings = hf_args_job(args, Job())
    assert job.framework == "deepspeed" and job.sharding.zero == 2
    got = {s.key: s.effect for s in settings if s.source == "--hf-args deepspeed"}
    assert got == {"zero_optimization.stage": "modelled", "zero_optimization.overlap_comm": "modelled",
                   "wandb.enabled": "no-memory-effect"}


@pytest.mark.parametrize("key", ["optimizer.params.lr", "scheduler.params.warmup_num_steps",
                                 "compression_training.weight_quantization.different_groups.wq1.params.start_bits"])
def test_free_form_sub_keys_follow_their_section(key: str) -> None:
    assert classify(key, 1)[1] not in _UNCLASSIFIED


def test_nvme_offload_is_priced_on_the_gpu_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                    "offload_param": {"device": "cpu"}}}
    path.write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--deepspeed-config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [s.split(" = ")[0] for s in data["unmodelled_settings"]] == [
        "--deepspeed-config zero_optimization.offload_optimizer.device"]
    assert "NVMe" in data["unmodelled_settings"][0]
    path.write_text(json.dumps({**config, "zero_optimization": {**config["zero_optimization"],
                                                                 "offload_optimizer": {"device": "cpu"}}}))
    as_cpu = json.loads(CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--deepspeed-config", str(path),
                                                 "--json"]).stdout)
    assert as_cpu["unmodelled_settings"] == []
    assert as_cpu["peak_allocated_bytes"] == data["peak_allocated_bytes"]  # the GPU side is the same as cpu offload
