"""DeepSpeed's gradient and communication dtypes, ZeRO-3's persistent parameters and --save-job with a DeepSpeed
config, against DeepSpeed 0.19.8's engine (docs/benchmarks.md, helper ds3more14)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memplan import Job, Parallelism, estimate, load_model
from memplan.commands.estimate import _reloaded
from memplan.errors import ConfigError
from memplan.estimate.engine import _stage_parts
from memplan.estimate.memo import Same
from memplan.estimate.zero3_buffers import model_numels, persistent_elements, reduced_elements
from memplan.frameworks.deepspeed_config import apply_deepspeed_config
from memplan.frameworks.deepspeed_keys import deepspeed_settings
from memplan.inputs import JobRequest, load_job
from memplan.jobfile import dump_job_file
from memplan.model.params import embedding_params

MODEL = load_model("llama-3.2-1b")
TOTAL, PERSISTENT = 1_235_814_400, 33 * 2048  # the norms: the tensors under DeepSpeed's 1e5 threshold
PARTITION, EMBEDDING = TOTAL // 8, embedding_params(MODEL)


def _config(tmp_path: Path, config: dict, stage: int = 3) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, **config,
                                "zero_optimization": {"stage": stage, **config.get("zero_optimization", {})}}))
    return path


def _job(tmp_path: Path, config: dict, stage: int = 3) -> Job:
    return apply_deepspeed_config(_config(tmp_path, config, stage), Job(parallel=Parallelism(world_size=8)))


def _ledger(job: Job):  # type: ignore[no-untyped-def]
    _, parts = _stage_parts(Same(MODEL), job, 0.0)
    return parts[0][2].ledger


#: The engine's buffers (CPU, world size 1, bf16, tiny4: 3,676,416 parameters): data_types.grad_accum_dtype fp32 makes
#: grad_partitions_flat_buffer float32, 14,705,664 B (bf16 by default: 7,352,832 B); communication_data_type fp32 with
#: reduce_bucket_size 1e5 makes the IPG bucket float32, 400,000 B (bf16: 200,000 B).
def test_grad_accum_dtype_fp32_keeps_fp32_gradient_partitions(tmp_path: Path) -> None:
    job = _job(tmp_path, {"data_types": {"grad_accum_dtype": "fp32"}})
    assert job.precision.grad_dtype == "fp32"
    assert estimate(MODEL, job).stages[0].gradients_bytes == 4 * PARTITION  # 14,705,664 / 3,676,416 = 4
    # the step's fp32 sub-group gradient is the flat fp32 copy itself (no 16-bit copy beside it)
    assert _ledger(job).total("temporary", "optimizer step") == 4 * PARTITION
    assert _job(tmp_path, {"data_types": {"grad_accum_dtype": "bf16"}}).precision.grad_dtype is None


def test_communication_data_type_fp32_doubles_the_bucket_and_converts_it(tmp_path: Path) -> None:
    base = {"zero_optimization": {"reduce_bucket_size": 5e7}}
    bf16, fp32 = _job(tmp_path, base), _job(tmp_path, {**base, "communication_data_type": "fp32"})
    assert fp32.sharding.communication_data_type == "fp32"
    loss = [estimate(MODEL, j).stages[0].communication_bytes for j in (bf16, fp32)]
    assert loss[1] - loss[0] == 2 * 50_000_000  # 400,000 B for 1e5 fp32 elements in the engine: 4 bytes each
    # the reduction copies the embedding's gradient (larger than the bucket: reduced alone) to fp32, and converts the
    # scattered eighth back to the bf16 partitions
    backward = [_ledger(j).total("temporary", "backward") for j in (bf16, fp32)]
    assert backward[1] - backward[0] == 4 * EMBEDDING + 2 * (EMBEDDING // 8)
    accum = _job(tmp_path, {**base, "data_types": {"grad_accum_dtype": "fp32"}})
    assert _ledger(accum).total("temporary", "backward") - backward[0] == 4 * (EMBEDDING // 8)
    both = _job(tmp_path, {**base, "communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}})
    assert _ledger(both).total("temporary", "backward") - backward[0] == 4 * EMBEDDING


#: The engine's reductions (tiny4, world size 1, the default reduce_scatter: stage3.py __avg_scatter_grads), the most
#: gradient elements one took: (reduce_bucket_size, measured); the 256,000-element head is larger than a 1e5 bucket.
REDUCED = [(100_000, 256_000), (1_000_000, 981_504), (500_000_000, 3_676_416)]


@pytest.mark.parametrize("bucket, measured", REDUCED)
def test_reductions_match_deepspeeds_engine(bucket: int, measured: int) -> None:
    got = reduced_elements(3_676_416, bucket, 256_000)
    assert measured <= got <= measured * 1.02  # a bucket is priced full


#: tiny4 (4 layers, h 256, ffn 688, vocab 1000, untied): the engine's ds_persist parameters per threshold.
TINY4 = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000, "tie_word_embeddings": False,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
PERSISTED = [(100_000, 1_050_880), (200_000, 3_164_416), (2_560, 2_304), (0, 0)]  # 2,560: Hugging Face's "auto"


@pytest.mark.parametrize("threshold, measured", PERSISTED)
def test_persistent_parameters_match_deepspeeds_engine(tmp_path: Path, threshold: int, measured: int) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY4))
    numels = model_numels(load_model(str(tmp_path / "config.json")))
    assert sum(numels) == 3_676_416
    assert persistent_elements(numels, threshold, None) == measured


def test_persistence_threshold_is_priced_but_for_the_step(tmp_path: Path) -> None:
    """Kept from the forward to the end of the backward; the step releases every parameter (``step`` ->
    ``_partition_all_parameters``) and gathers the persistent ones again after it (``_post_step``): re-measured by
    helper zero17 (Z4, world size 2: the step's most live is the states, the bucket and the fp32 sub-group gradient
    with its flat copy, no persistent parameter; until session 17 this test held them at the step)."""
    assert persistent_elements((10, 20, 5), 30, 25) == 15  # the model cap skips the 20 and keeps the 5
    small = {"zero_optimization": {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}
    ledgers = [_ledger(_job(tmp_path, {"zero_optimization": {**small["zero_optimization"], **extra}}))
               for extra in ({}, {"stage3_param_persistence_threshold": 0},
                             {"stage3_param_persistence_threshold": "auto"})]
    step = [led.total("communication", "optimizer step") for led in ledgers]
    loss = [led.total("communication", "loss") for led in ledgers]
    assert step[0] == step[1] == step[2]  # none at the optimizer step
    assert loss[0] - loss[1] == 2 * PERSISTENT
    assert loss[2] == loss[0]  # Hugging Face's 10 * 2,048 also keeps only the norms


@pytest.mark.parametrize("config, key", [({"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype"),
                                         ({"communication_data_type": "fp8"}, "communication_data_type"),
                                         ({"data_types": "fp32"}, "data_types"),
                                         ({"zero_optimization": {"stage3_param_persistence_threshold": -1}},
                                          "zero_optimization.stage3_param_persistence_threshold")])
def test_bad_dtypes_and_thresholds_are_refused_naming_the_key(tmp_path: Path, config: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: must be") as info:
        _job(tmp_path, config)
    assert "\n" not in str(info.value)


def test_stage_0_refuses_a_gradient_dtype_other_than_the_models(tmp_path: Path) -> None:
    path = _config(tmp_path, {"data_types": {"grad_accum_dtype": "fp32"}}, stage=0)
    run = subprocess.run([sys.executable, "-m", "memplan", "estimate", "llama-3.2-1b", "--gpus", "8",
                          "--deepspeed-config", str(path)], capture_output=True, text=True, check=False)
    assert run.returncode == 2
    assert "data_types.grad_accum_dtype: must be the model's dtype (bf16) without ZeRO" in run.stderr + run.stdout


def test_the_priced_keys_leave_the_unmodelled_list() -> None:
    keys = {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"},
            "zero_optimization": {"stage3_param_persistence_threshold": 1e4, "stage3_model_persistence_threshold": 1e6}}

    def effects(stage: int) -> dict[str, str]:
        config = {**keys, "zero_optimization": {"stage": stage, **keys["zero_optimization"]}}
        return {s.key: s.effect for s in deepspeed_settings(config) if s.key != "zero_optimization.stage"}

    assert set(effects(3).values()) == {"modelled"}
    at2 = effects(2)
    # below stage 3 both dtypes are priced too (memplan.estimate.zero12_bucket, helper ds15)
    assert at2["data_types.grad_accum_dtype"] == "modelled" and at2["communication_data_type"] == "modelled"
    assert at2["zero_optimization.stage3_param_persistence_threshold"] == "no-memory-effect"
    assert effects(1)["data_types.grad_accum_dtype"] == "modelled"  # BF16_Optimizer's bf16 gradients priced
    assert effects(0)["communication_data_type"] == "modelled"  # the stage-0 engine's all-reduce copy (dsfree15)


#: ZeRO-1 and ZeRO-2 in the engine (tiny4, world size 1), bytes per parameter after the backward: 16-bit weights
#: (bit16_groups) 2, gradients (averaged_gradients) 2 in bf16 and fp16 alike, fp32 master
#: (single_partition_of_fp32_groups) 4, Adam moments 8; ZeRO-2 with grad_accum_dtype fp32: gradients 4.
@pytest.mark.parametrize("stage, precision, grad_accum, grads", [(1, "bf16", None, 2), (2, "bf16", None, 2),
                                                                 (1, "fp16", None, 2), (2, "fp16", None, 2),
                                                                 (2, "bf16", "fp32", 4)])
def test_zero_1_and_2_states_match_the_engine(tmp_path: Path, stage: int, precision: str, grad_accum: str | None,
                                              grads: int) -> None:
    config = {precision: {"enabled": True}, "zero_optimization": {"stage": stage}}
    if grad_accum:
        config["data_types"] = {"grad_accum_dtype": grad_accum}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    job = apply_deepspeed_config(path, Job(parallel=Parallelism(world_size=1)))
    stage_ = estimate(MODEL, job).stages[0]
    per = {name: getattr(stage_, f"{name}_bytes") / TOTAL for name in ("parameters", "gradients",
                                                                       "master_weights", "optimizer_moments")}
    assert per == {"parameters": 2, "gradients": grads, "master_weights": 4, "optimizer_moments": 8}


CELLS = {"a": {}, "b": {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                        "stage3_param_persistence_threshold": "auto"},
         "c": {"reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e8}}


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_save_job_round_trips_a_deepspeed_config(tmp_path: Path, cell: str) -> None:
    """zero3ds14's three cells: the saved job estimates as the original, and nothing is reported as not written."""
    path = _config(tmp_path, {"zero_optimization": CELLS[cell]})
    loaded = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8, "seq": 4096}, deepspeed_config=str(path)))
    assert dump_job_file(loaded.model_ref, loaded.job, tmp_path / "job.yaml", deepspeed_config=str(path),
                         reload=_reloaded) == ()
    again = load_job(JobRequest(job_file=str(tmp_path / "job.yaml")))
    assert again.job == loaded.job
    assert estimate(again.model, again.job).peak_allocated_bytes == estimate(loaded.model, loaded.job).peak_allocated_bytes


def test_save_job_still_names_what_no_file_restores(tmp_path: Path) -> None:
    # without a DeepSpeed config: no file is kept, so the setting is named without reloading
    loaded = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8, "zero": 3, "framework": "deepspeed"}))
    job = dataclasses.replace(loaded.job, sharding=dataclasses.replace(loaded.job.sharding, reduce_bucket_size=5))
    assert dump_job_file(loaded.model_ref, job, tmp_path / "job.yaml", reload=_reloaded) == ("sharding.reduce_bucket_size",)
    # with one that sets a different bucket: the written file is loaded again, gives back the config's 5e7, not the
    # job's 5, and the setting is still named (the reload's comparison, not the no-file shortcut)
    path = _config(tmp_path, {"zero_optimization": CELLS["c"]})
    loaded = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8}, deepspeed_config=str(path)))
    job = dataclasses.replace(loaded.job, sharding=dataclasses.replace(loaded.job.sharding, reduce_bucket_size=5))
    reloads: list[Path] = []
    named = dump_job_file(loaded.model_ref, job, tmp_path / "job2.yaml", deepspeed_config=str(path),
                          reload=lambda file: reloads.append(file) or _reloaded(file))
    assert reloads == [tmp_path / "job2.yaml"]
    assert named == ("sharding.reduce_bucket_size",)
    assert _reloaded(tmp_path / "job2.yaml").sharding.reduce_bucket_size == 5e7


def test_the_cli_saves_a_deepspeed_job_without_warning(tmp_path: Path) -> None:
    path = _config(tmp_path, {"zero_optimization": CELLS["c"]})
    run = subprocess.run([sys.executable, "-m", "memplan", "estimate", "llama-3.2-1b", "--gpus", "8", "--deepspeed-config",
                          str(path), "--save-job", str(tmp_path / "job.yaml")], capture_output=True, text=True, check=False)
    assert run.returncode == 0 and "not written" not in run.stderr
