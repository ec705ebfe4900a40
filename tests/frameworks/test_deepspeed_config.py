"""DeepSpeed JSON config mapping."""

from __future__ import annotations

import json

import pytest

from memplan.errors import ConfigError
from memplan.frameworks.deepspeed_config import apply_deepspeed_config
from memplan.job import Job, Parallelism


def _write(tmp_path, data):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_zero_stage_precision_batch_and_optimizer_are_mapped(tmp_path):
    path = _write(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 4,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        },
    )
    job = apply_deepspeed_config(path, Job(parallel=Parallelism(world_size=8)))
    assert job.framework == "deepspeed"
    assert job.sharding.zero == 2
    assert job.precision.name == "bf16-mixed"
    assert job.batch.micro_batch_size == 2
    assert job.batch.global_batch_size == 2 * 4 * 8
    assert job.optimizer.name == "adamw"


def test_auto_values_keep_the_job(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1}})
    job = apply_deepspeed_config(path, Job())
    assert job.batch.micro_batch_size == 1 and job.sharding.zero == 1


@pytest.mark.parametrize(
    "data, field",
    [
        ('{"zero_optimization": {"stage": 3}', "--deepspeed-config"),
        ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage"),
        ({"train_micro_batch_size_per_gpu": -1}, "train_micro_batch_size_per_gpu"),
        ([1, 2], "--deepspeed-config"),
    ],
)
def test_bad_configs_name_the_field(tmp_path, data, field):
    with pytest.raises(ConfigError, match=field):
        apply_deepspeed_config(_write(tmp_path, data), Job())


def test_cpu_and_nvme_offload_map(tmp_path):
    path = _write(tmp_path, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                   "offload_param": {"device": "cpu"}}})
    job = apply_deepspeed_config(path, Job())
    assert job.offload.optimizer and job.offload.params
    path = _write(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
    assert apply_deepspeed_config(path, Job()).offload.optimizer
    path = _write(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}})
    with pytest.raises(ConfigError, match=r"offload_optimizer\.device.*none, cpu or nvme.*disk"):
        apply_deepspeed_config(path, Job())
    path = _write(tmp_path, {"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="--offload-params"):
        apply_deepspeed_config(path, Job())


def test_activation_checkpointing_switches_map(tmp_path):
    section = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
               "number_checkpoints": 24, "synchronize_checkpoint_boundary": True, "profile": True}
    job = apply_deepspeed_config(_write(tmp_path, {"activation_checkpointing": section}), Job())
    rc = job.recompute
    assert (rc.partition_activations, rc.cpu_checkpointing, rc.contiguous_checkpoints) == (True, True, 24)
    # number_checkpoints is only read with the contiguous buffers
    section = {"partition_activations": True, "number_checkpoints": 24}
    rc = apply_deepspeed_config(_write(tmp_path, {"activation_checkpointing": section}), Job()).recompute
    assert (rc.partition_activations, rc.cpu_checkpointing, rc.contiguous_checkpoints) == (True, False, None)


@pytest.mark.parametrize(
    "section, field",
    [
        ({"partition_activations": "yes"}, "activation_checkpointing.partition_activations"),
        ({"contiguous_memory_optimization": True, "number_checkpoints": 4},
         "activation_checkpointing.contiguous_memory_optimization"),
        ({"partition_activations": True, "contiguous_memory_optimization": True},
         "activation_checkpointing.number_checkpoints"),
        ({"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 0},
         "activation_checkpointing.number_checkpoints"),
        ([True], "activation_checkpointing"),
    ],
)
def test_bad_activation_checkpointing_names_the_key(tmp_path, section, field):
    with pytest.raises(ConfigError, match=field):
        apply_deepspeed_config(_write(tmp_path, {"activation_checkpointing": section}), Job())
