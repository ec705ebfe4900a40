"""DeepSpeed ZeRO-3's buffers priced from the config (memplan.estimate.zero3_buffers), against DeepSpeed's engine."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memplan import Job, Parallelism, estimate, load_model
from memplan.errors import ConfigError
from memplan.estimate.engine import _stage_parts
from memplan.estimate.memo import Same
from memplan.estimate.zero3_buffers import gathered_elements, sub_group_elements
from memplan.frameworks.deepspeed_config import apply_deepspeed_config
from memplan.frameworks.deepspeed_keys import deepspeed_settings
from memplan.job import Batch, Offload, Sharding
from memplan.model.params import embedding_params

MODEL = load_model("llama-3.2-1b")  # tied embedding: 262,668,288 of 1,235,814,400 parameters
TOTAL, EMBEDDING = 1_235_814_400, embedding_params(MODEL)
#: The norms (33 x 2,048): the tensors under DeepSpeed's 1e5-element persistence threshold, kept gathered.
PERSISTENT = 33 * 2048


def _job(tmp_path: Path, zero: dict) -> Job:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **zero}}))
    return apply_deepspeed_config(path, Job(parallel=Parallelism(world_size=8)))


def _comm(job: Job) -> dict[str, int]:
    """Communication bytes at the loss and at the most (the backward) of the one stage."""
    stage = estimate(MODEL, job).stages[0]
    return {"loss": stage.communication_bytes, "most": stage.max_communication_bytes}


def test_keys_are_read_with_deepspeed_names_auto_and_floats(tmp_path: Path) -> None:
    job = _job(tmp_path, {"reduce_bucket_size": 5e7, "prefetch_bucket_size": "auto", "stage3_max_live_parameters": 1e8,
                          "max_reuse_distance": 0, "contiguous_gradients": False, "overlap_comm": True,
                          "sub_group_size": 1e8})
    assert job.sharding == Sharding(zero=3, reduce_bucket_size=50_000_000, prefetch_bucket_size="auto",
                                    max_live_parameters=100_000_000, max_reuse_distance=0, sub_group_size=100_000_000,
                                    contiguous_gradients=False, overlap_comm=True)
    # "auto" only where Hugging Face's integration fills it in (transformers/integrations/deepspeed.py); DeepSpeed
    # refuses the string elsewhere, so memplan names the key instead of taking DeepSpeed's default silently
    for key in ("stage3_max_live_parameters", "sub_group_size", "overlap_comm", "contiguous_gradients"):
        with pytest.raises(ConfigError, match=f"zero_optimization.{key}"):
            _job(tmp_path, {key: "auto"})


@pytest.mark.parametrize("key, value", [("reduce_bucket_size", -1), ("reduce_bucket_size", 0),
                                        ("stage3_prefetch_bucket_size", "5e7"), ("stage3_max_live_parameters", 1.5),
                                        ("stage3_max_reuse_distance", True), ("reduce_bucket_size", None),
                                        ("stage3_max_reuse_distance", float("inf")), ("reduce_bucket_size", 1e16)])
def test_bad_bucket_sizes_are_refused_naming_the_key(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}: must be a") as info:
        _job(tmp_path, {key: value})
    assert "whole number of elements" in str(info.value) and "\n" not in str(info.value)


def test_the_cli_refuses_with_one_sentence_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": -5}}))
    run = subprocess.run([sys.executable, "-m", "memplan", "estimate", "llama-3.2-1b", "--gpus", "8",
                          "--deepspeed-config", str(path)], capture_output=True, text=True, check=False)
    assert run.returncode == 2
    assert "zero_optimization.reduce_bucket_size: must be a positive whole number" in run.stderr + run.stdout
    assert "(got -5)" in run.stderr + run.stdout


def test_each_key_prices_its_buffer(tmp_path: Path) -> None:
    """DeepSpeed's defaults on llama-3.2-1b, 8 GPUs, bf16: every parameter gathered (the prefetcher fills to 1e9 live
    beside the 262.7M embedding), the embedding's gradients in the backward, the 5e8-element bucket."""
    default = _comm(_job(tmp_path, {}))
    assert default == {"loss": 2 * TOTAL + 2 * 500_000_000, "most": 2 * TOTAL + 2 * EMBEDDING + 2 * 500_000_000}
    # the bucket: its size, none without contiguous_gradients, overlap_comm adds no second one at stage 3
    assert _comm(_job(tmp_path, {"reduce_bucket_size": 5e7}))["loss"] == 2 * TOTAL + 2 * 50_000_000
    assert _comm(_job(tmp_path, {"contiguous_gradients": False}))["loss"] == 2 * TOTAL
    assert _comm(_job(tmp_path, {"overlap_comm": False})) == _comm(_job(tmp_path, {"overlap_comm": True})) == default
    # the cap on live parameters, with no reuse window: the embedding beside 1e8 fetched ahead
    small = {"reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e8}
    assert _comm(_job(tmp_path, {**small, "stage3_max_reuse_distance": 0}))["loss"] == 2 * (EMBEDDING + 10**8 + 5 * 10**7 + PERSISTENT)
    # ... and with DeepSpeed's reuse distance, half of it stays gathered from the forward
    assert _comm(_job(tmp_path, small))["loss"] == 2 * (500_000_000 + 5 * 10**7 + PERSISTENT)
    # no prefetching, no reuse: the module computing only
    off = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0, "reduce_bucket_size": 1}
    assert _comm(_job(tmp_path, off))["loss"] == 2 * EMBEDDING + 2 + 2 * PERSISTENT


def test_hf_auto_values_come_from_the_hidden_size(tmp_path: Path) -> None:
    auto = _job(tmp_path, {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                           "stage3_max_reuse_distance": 0})
    hidden = MODEL.hidden_size
    assert _comm(auto)["loss"] == 2 * TOTAL + 2 * hidden * hidden
    no_prefetch = dataclasses.replace(auto, sharding=dataclasses.replace(auto.sharding, prefetch_bucket_size=0))
    assert _comm(no_prefetch)["loss"] == 2 * EMBEDDING + 2 * hidden * hidden + 2 * PERSISTENT


def test_flag_jobs_get_deepspeeds_defaults() -> None:
    job = Job(parallel=Parallelism(world_size=8), framework="deepspeed", sharding=Sharding(zero=3))
    assert _comm(job)["loss"] == 2 * TOTAL + 2 * 500_000_000


def test_priced_keys_leave_the_unmodelled_list() -> None:
    keys = {"reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e8,
            "stage3_max_reuse_distance": 1e9, "overlap_comm": True, "contiguous_gradients": True,
            "stage3_param_persistence_threshold": 1e4, "sub_group_size": 1e9}
    at3 = {s.key.split(".")[1]: s.effect for s in deepspeed_settings({"zero_optimization": {"stage": 3, **keys}})}
    assert at3 == {"stage": "modelled", "reduce_bucket_size": "modelled", "stage3_prefetch_bucket_size": "modelled",
                   "stage3_max_live_parameters": "modelled", "stage3_max_reuse_distance": "modelled",
                   "overlap_comm": "no-memory-effect", "contiguous_gradients": "modelled",
                   "stage3_param_persistence_threshold": "modelled", "sub_group_size": "modelled"}
    at2 = {s.key.split(".")[1]: s.effect for s in deepspeed_settings({"zero_optimization": {"stage": 2, **keys}})}
    # ZeRO-1/2's reduce buckets read them too (memplan.estimate.zero12_bucket)
    assert at2["reduce_bucket_size"] == at2["overlap_comm"] == at2["contiguous_gradients"] == "modelled"
    assert at2["stage3_max_live_parameters"] == at2["sub_group_size"] == "no-memory-effect"


#: DeepSpeed 0.19.8's real ZeRO-3 engine on CPU (DS_ACCELERATOR=cpu, gloo, world size 1, bf16, torch AdamW, two
#: steps), tiny Llama models; the most parameters gathered (AVAILABLE or INFLIGHT, sampled at every module's forward
#: and backward hooks) per config: (total, largest module, prefetch, max live, reuse distance, measured).
#: 4 layers (h 256, ffn 688, vocab 1000, untied; persistence threshold 0) and 16 layers (h 384, ffn 1024, vocab 4000,
#: tied; the llama-3.2-1b cells' settings scaled by its 2.4% of the parameters).
ENGINE = [
    (3_676_416, 256_000, 50_000_000, 1_000_000_000, 1_000_000_000, 3_676_416),
    (3_676_416, 256_000, 0, 1_000_000_000, 0, 256_000),
    (3_676_416, 256_000, 300_000, 200_000, 0, 452_864),
    (3_676_416, 256_000, 300_000, 1_000_000, 0, 1_243_904),
    (3_676_416, 256_000, 0, 1_000_000_000, 2_000_000, 1_047_040),
    (29_860_224, 1_536_000, 1_200_000, 24_100_000, 24_100_000, 25_522_176),
    (29_860_224, 1_536_000, 132_710, 24_100_000, 24_100_000, 25_128_960),  # (b): HF's "auto" for h 384
    (29_860_224, 1_536_000, 1_200_000, 2_410_000, 24_100_000, 12_152_832),  # (c), overlap_comm on and off alike
    (29_860_224, 1_536_000, 1_200_000, 2_410_000, 0, 3_895_296),
    (29_860_224, 1_536_000, 0, 1_000_000_000, 0, 1_536_000),
]


@pytest.mark.parametrize("total, unit, prefetch, live, reuse, measured", ENGINE)
def test_gathered_parameters_match_deepspeeds_engine(total: int, unit: int, prefetch: int, live: int, reuse: int,
                                                     measured: int) -> None:
    tolerance = 0.05 if prefetch == 0 and reuse else 0.025  # the reuse window ends mid-module
    assert gathered_elements(total, unit, prefetch, live, reuse) == pytest.approx(measured, rel=tolerance)


def test_megatron_zero3_is_megatron_fsdps_not_deepspeeds() -> None:
    """Megatron's --zero 3 is Megatron-FSDP's optim_grads_params: DeepSpeed's buffers are not priced there (its CI
    cases, tests/frameworks/test_megatron_args.py, measure it); DeepSpeed's estimator's 4 bytes x largest module stay."""
    job = Job(parallel=Parallelism(world_size=8), framework="megatron", sharding=Sharding(zero=3))
    assert _comm(job) == {"loss": 4 * (EMBEDDING + MODEL.hidden_size), "most": 4 * (EMBEDDING + MODEL.hidden_size)}


def _step_temporary(sub_group_size: int | None, offload: bool = False) -> int:
    job = Job(parallel=Parallelism(world_size=8), framework="deepspeed", batch=Batch(seq_length=16),
              sharding=Sharding(zero=3, sub_group_size=sub_group_size), offload=Offload(optimizer=offload))
    _, parts = _stage_parts(Same(MODEL), job, 0.0)
    return parts[0][2].ledger.total("temporary", "optimizer step")


def test_the_step_makes_one_sub_groups_fp32_gradient() -> None:
    """The gradient partitions stay in bf16 (2 bytes, DeepSpeed's grad_partitions_flat_buffer); the step makes the
    largest sub-group's fp32 gradient from a flat bf16 copy (6 bytes per element at that instant)."""
    partition, embedding_part = TOTAL // 8, EMBEDDING // 8
    job = Job(parallel=Parallelism(world_size=8), framework="deepspeed", sharding=Sharding(zero=3))
    assert estimate(MODEL, job).stages[0].gradients_bytes == 2 * partition
    assert _step_temporary(None) == 6 * partition  # DeepSpeed's 1e9: the whole partition is one sub-group
    assert _step_temporary(10**8) == 6 * (10**8 + embedding_part)
    assert _step_temporary(0) == 6 * embedding_part  # one parameter per sub-group: the largest
    assert _step_temporary(None, offload=True) == 0  # the offloaded optimizer's gradients are in CPU memory


#: The same engine (tiny4, persistence 0), the fp32 gradient ``_prepare_fp32_grad_for_sub_group`` made at its largest
#: (bytes / 4) and the gradient partitions (2 bytes per parameter: 7,352,832 B for 3,676,416 parameters):
#: (sub_group_size, measured elements); the largest parameter's partition is the 256,000-element head.
SUB_GROUPS = [(1_000_000_000, 3_676_416), (500_000, 614_912), (0, 256_000)]


@pytest.mark.parametrize("size, measured", SUB_GROUPS)
def test_sub_groups_match_deepspeeds_engine(size: int, measured: int) -> None:
    got = sub_group_elements(3_676_416, size, 256_000)
    assert measured <= got <= measured + 256_000  # the crossing parameter is priced at the largest one's size
