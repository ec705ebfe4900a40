"""DeepSpeed ZeRO-1/2's gradient and communication dtypes against DeepSpeed 0.19.8's engine: BF16_Optimizer's bf16
gradients, grad_accum_dtype at stage 1, communication_data_type and reduce_scatter below stage 3, the bucket keys at
stage 0 (docs/benchmarks.md, helper ds15; the engine on CPU, world size 1, tiny4 Llama, /tmp/ds15/witness.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from memplan.estimate.engine import _stage_parts
from memplan.estimate.memo import Same
from memplan.frameworks.deepspeed_keys import deepspeed_settings
from memplan.inputs import JobRequest, load_job
from tests.estimate.test_zero3_dtypes import TINY4

TOTAL = 3_676_416
STATES = ("parameters", "gradients", "master", "optimizer")


def _ledger(tmp_path: Path, config: dict, *, precision: str = "bf16", steps: int = 1):  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps(TINY4))
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": steps, precision: {"enabled": True},
          **config}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    loaded = load_job(JobRequest(model=str(tmp_path / "config.json"),
                                 flags={"gpus": 1, "seq": 32, "deepspeed_config": str(tmp_path / "ds.json")}))
    _, parts = _stage_parts(Same(loaded.model), loaded.job, 0.0)
    return parts[0][2].ledger


def _states(ledger, phase: str = "end of backward") -> int:  # type: ignore[no-untyped-def]
    return sum(ledger.total(c, phase) for c in STATES)


def _z(stage: int, **keys: object) -> dict:
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000, **keys}}


FP32_ACCUM = {"data_types": {"grad_accum_dtype": "fp32"}}

#: (cell, config, precision, the engine's live storage bytes after the second backward, its largest reduce bucket
#: bytes and the reduction's copy bytes at one collective of that backward).
ENGINE = [
    ("E1 ZeRO-1 bf16", _z(1), "bf16", 58_823_176, 200_000, 0),
    ("E2 ZeRO-1 bf16 grad_accum fp32 (BF16_Optimizer)", {**_z(1), **FP32_ACCUM}, "bf16", 73_528_840, 0, 7_352_832),
    ("E3 E2 + communication_data_type fp32", {**_z(1), **FP32_ACCUM, "communication_data_type": "fp32"}, "bf16",
     73_528_840, 0, 0),
    ("E4 ZeRO-1 fp16 grad_accum fp32", {**_z(1), **FP32_ACCUM}, "fp16", 66_176_008, 400_000, 512_000),
    ("E5 ZeRO-1 bf16 communication_data_type fp32", {**_z(1), "communication_data_type": "fp32"}, "bf16",
     58_823_176, 200_000, 1_024_000),
    ("E6 ZeRO-2 bf16 communication_data_type fp32", {**_z(2), "communication_data_type": "fp32"}, "bf16",
     58_823_176, 200_000, 1_024_000),
    ("E7 ZeRO-1 bf16 reduce_scatter false", _z(1, reduce_scatter=False), "bf16", 58_823_176, 200_000, 0),
    ("E8 ZeRO-2 bf16 reduce_scatter false", _z(2, reduce_scatter=False), "bf16", 58_823_176, 200_000, 0),
]


@pytest.mark.parametrize("cell, config, precision, after_backward, bucket, copy", ENGINE, ids=[c[0] for c in ENGINE])
def test_zero_1_and_2_buffers_match_the_engine(tmp_path: Path, cell: str, config: dict, precision: str,
                                               after_backward: int, bucket: int, copy: int) -> None:
    ledger = _ledger(tmp_path, config, precision=precision)
    # the engine's figure also holds the rotary inv_freq buffer, the input ids and the grad norm: 520 bytes
    assert after_backward - 1024 <= _states(ledger) <= after_backward
    assert max(ledger.total("communication", p) for p in ("backward", "end of backward")) == bucket
    assert sum(c.nbytes for c in ledger.entries if "reduction: up to" in c.note) == copy


def test_bf16_optimizer_keeps_bf16_gradients_beside_the_fp32_buffer(tmp_path: Path) -> None:
    """2 B/param of bf16 param.grad from the backward to the step's zero_grad; the fp32 buffer the whole step."""
    one = _ledger(tmp_path, {**_z(1), **FP32_ACCUM})
    assert one.total("gradients", "end of backward") == (4 + 2) * TOTAL
    assert one.total("gradients", "loss") == 4 * TOTAL  # the first micro-batch's forward: no bf16 gradients yet
    assert one.total("gradients", "optimizer step") == 6 * TOTAL
    accumulating = _ledger(tmp_path, {**_z(1), **FP32_ACCUM}, steps=4)
    assert accumulating.total("gradients", "loss") == 6 * TOTAL  # zeroed, not freed, between micro-batches
    # ZeRO-2 with fp32 accumulation runs the ZeRO optimizer: fp32 gradient partitions only
    assert _ledger(tmp_path, {**_z(2), **FP32_ACCUM}).total("gradients", "end of backward") == 4 * TOTAL


def test_grad_accum_dtype_and_communication_data_type_are_modelled_below_stage_3() -> None:
    def effects(stage: int) -> dict[str, tuple[str, str]]:
        config = {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"},
                  "zero_optimization": {"stage": stage, "reduce_scatter": False}}
        return {s.key: (s.effect, s.note) for s in deepspeed_settings(config)}

    for stage in (1, 2):
        got = effects(stage)
        assert got["data_types.grad_accum_dtype"][0] == "modelled"
        assert got["communication_data_type"][0] == "modelled"
        assert got["zero_optimization.reduce_scatter"][0] == "no-memory-effect"
    assert "BF16_Optimizer" in effects(1)["data_types.grad_accum_dtype"][1]


BUCKET_KEYS = {"reduce_bucket_size": 100_000, "contiguous_gradients": True, "overlap_comm": True,
               "reduce_scatter": False, "allgather_bucket_size": 100_000}


def test_stage_0_reads_no_bucket_key(tmp_path: Path) -> None:
    """E10 / E11: stage 0 all-reduces in the engine's own 5e8-element buckets; each bucket key is read only by the ZeRO
    optimizers, so the notes say so and the estimate does not move."""
    settings = deepspeed_settings({"zero_optimization": {"stage": 0, **BUCKET_KEYS}})
    for s in settings[1:]:
        assert s.effect == "no-memory-effect" and "stage 0" in s.note and "ZeRO-1/2" not in s.note, s.key
    plain = _ledger(tmp_path, {"zero_optimization": {"stage": 0}})
    keyed = _ledger(tmp_path, {"zero_optimization": {"stage": 0, **BUCKET_KEYS}})
    assert plain.allocated_at("backward") == keyed.allocated_at("backward")


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hf_zero_is_deepspeed_s_engine_and_the_doctor_s_fix_is_that_job(zero: int) -> None:
    """``--framework hf --zero N`` is the Hugging Face Trainer's DeepSpeed integration (docs/estimate.md's ``--zero``;
    the profile's ``zero_framework``): priced byte for byte as ``--framework deepspeed --zero N`` where the HF model's
    code decides nothing apart (tests/profiles/test_zero_engine_model_code.py), with a sentence saying so; the doctor's
    ZeRO fix for the hf job is its ``--zero N``, priced the same."""
    from memplan import estimate
    from memplan.doctor import diagnose

    def est(framework: str, stage: int):  # type: ignore[no-untyped-def]
        loaded = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8, "framework": framework, "zero": stage}))
        return estimate(loaded.model, loaded.job)

    hf, ds = est("hf", zero), est("deepspeed", zero)
    assert (hf.peak_allocated_bytes, hf.peak_reserved_bytes, hf.stages) == (ds.peak_allocated_bytes,
                                                                           ds.peak_reserved_bytes, ds.stages)
    assert hf.assumptions[0].startswith(f"--framework hf --zero {zero}: the Hugging Face Trainer runs ZeRO through")
    assert hf.assumptions[1:] == ds.assumptions
    job = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8, "framework": "hf"}))
    fixes = diagnose(job=job, capacity_bytes=hf.peak_reserved_bytes * 2 // 3).fixes
    fix = next(f for f in fixes if f.setting == f"--zero {zero}")
    assert fix.peak_bytes == ds.peak_reserved_bytes == hf.peak_reserved_bytes


def test_hf_zero_refuses_what_deepspeed_s_engine_refuses_naming_the_flag(tmp_path: Path) -> None:
    """A Hugging Face setting DeepSpeed's profile does not run: one sentence naming --zero, the framework and the
    rule, exit 2, from the flags, a job file and the server alike; --zero 3 with --fsdp stays PyTorch FSDP's."""
    import subprocess
    import sys

    from memplan.errors import JobConfigError

    flags = {"gpus": 8, "framework": "hf", "zero": 2, "recompute": "attention-module"}
    loaded = load_job(JobRequest(model="llama-3.2-1b", flags=flags))
    from memplan import estimate

    with pytest.raises(JobConfigError, match=r"^--zero: 2 under --framework hf runs deepspeed's engine") as info:
        estimate(loaded.model, loaded.job)
    assert "\n" not in str(info.value) and "attention-module" in str(info.value)
    run = subprocess.run([sys.executable, "-m", "memplan", "estimate", "llama-3.2-1b", "--gpus", "8", "--framework",
                          "hf", "--zero", "2", "--recompute", "attention-module"], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 2 and "--zero: 2 under --framework hf" in run.stderr + run.stdout
    (tmp_path / "job.yaml").write_text("model: llama-3.2-1b\ngpus: 8\nframework: hf\nzero: 2\n"
                                       "recompute: attention-module\n")
    run = subprocess.run([sys.executable, "-m", "memplan", "estimate", "--job", str(tmp_path / "job.yaml")],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 2 and "--zero: 2 under --framework hf" in run.stderr + run.stdout
    starlette = pytest.importorskip("starlette.testclient")
    from memplan.serve import create_app

    body = {"model": "llama-3.2-1b", "gpus": 8, "framework": "hf", "zero": 2, "recompute": "attention-module"}
    response = starlette.TestClient(create_app()).post("/v1/estimate", json=body)
    assert response.status_code == 400 and response.json()["error"]["field"] == "zero"
    fsdp = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8, "framework": "hf", "zero": 3, "fsdp": "full"}))
    assert estimate(fsdp.model, fsdp.job).framework == "hf"


def test_hf_zero_with_selective_means_hf_s_selective_and_is_refused() -> None:
    """review of session 15: ``selective`` is the user's framework's policy (hf: the attention module), which
    DeepSpeed's engine cannot run; the alias was resolved under the runner (the attention core), 71.7 against
    164.8 GiB for llama-3.1-8b. The reserved mode is the runner's default too."""
    from memplan import estimate
    from memplan.errors import JobConfigError
    from memplan.estimate.engine import reserved_mode

    loaded = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8, "framework": "hf", "zero": 1,
                                                               "recompute": "selective"}))
    with pytest.raises(JobConfigError, match=r"^--zero: 1 under --framework hf runs deepspeed's engine.*attention-module"):
        estimate(loaded.model, loaded.job)
    plain = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8, "framework": "hf", "zero": 2}))
    assert reserved_mode(plain.job) == "fixed" == reserved_mode(
        load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8, "framework": "deepspeed", "zero": 2})).job)


def test_zero_1_with_overlap_comm_prices_no_partition_beside_the_full_gradients(tmp_path: Path) -> None:
    """review of session 15: with overlap_comm each gradient moves into the bucket as it is made, so ZeRO-1's
    partition never sits beside all the full gradients. The engine (ds15's witness, tiny4 Llama, stage 1, bucket 1e5,
    overlap_comm) held at most 61,295,768 B at any collective of the backward, activations included; memplan's model
    states and buffers at the end of the backward were 66,575,488 (+8.6%) with the partition. Without it they stay
    under the engine's figure, which also holds the activations alive there."""
    ledger = _ledger(tmp_path, _z(1, overlap_comm=True), precision="bf16")
    assert not [c for c in ledger.entries if c.note.startswith("DeepSpeed ZeRO-1 reduction: this GPU's gradient partition")
                and c.nbytes]
    mine = [c for c in ledger.entries if c.note.startswith("DeepSpeed ZeRO") and c.live_at("end of backward")
            and c.category in ("communication", "temporary")]
    got = _states(ledger) + sum(c.nbytes for c in mine)
    assert 61_295_768 * 0.95 <= got <= 61_295_768


def test_the_reduction_copy_takes_the_largest_parameter_this_gpu_holds() -> None:
    """review of session 15: the copy of a parameter larger than the bucket was the whole model's largest tensor on
    every pipeline stage and tensor-parallel rank (llama-3.1-8b PP 4: the 525M-element embedding on stages without
    it, 2.1 GB); it is the stage's largest, split by TP."""
    def copies(flags: dict) -> list[int]:
        loaded = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 16, "framework": "deepspeed", "zero": 1,
                                                                   "precision": "bf16", **flags}))
        job = dataclasses.replace(loaded.job, sharding=dataclasses.replace(
            loaded.job.sharding, communication_data_type="fp32", reduce_bucket_size=16_777_216))
        _, parts = _stage_parts(Same(loaded.model), job, 0.0)
        return [max((c.nbytes // 4 for c in part[2].ledger.entries if "copied to fp32" in c.note), default=0)
                for part in parts]

    embedding, linear = 128_256 * 4_096, 14_336 * 4_096
    assert copies({"pp": 4}) == [embedding, linear, linear, embedding]
    assert copies({"tp": 4}) == [embedding // 4]


def test_the_stage_0_all_reduce_bucket_passes_with_the_largest_tensor_this_gpu_holds() -> None:
    """The flattened bucket without ZeRO (ds_allreduce): 5e8 elements and the tensor that passes them, this GPU's
    largest (its stage's, split by TP), not the whole model's on every stage and rank; the whole model's gradients
    where they are fewer."""
    def buckets(model: str, flags: dict) -> list[int]:
        loaded = load_job(JobRequest(model=model, flags={"framework": "deepspeed", "precision": "bf16", **flags}))
        _, parts = _stage_parts(Same(loaded.model), loaded.job, 0.0)
        return [max((c.nbytes // 2 for c in part[2].ledger.entries if "flattens up to" in c.note), default=0)
                for part in parts]

    gradients = [b for b in buckets("llama-3.1-8b", {"gpus": 4, "pp": 4})]
    assert gradients[0] == 500_000_000 + 128_256 * 4_096  # the embedding passes the threshold on the first stage
    assert gradients[1] == gradients[2] < gradients[0]  # a middle stage's gradients are fewer than 5e8 + its largest
    moe = buckets("mixtral-8x7b", {"gpus": 16, "tp": 4})
    assert moe == [500_000_000 + 8 * 2 * 14_336 * 4_096 // 4]  # the stacked gate-up experts, split by TP


#: The engine's most live bytes at one collective of the second backward (ZeRO-1 reduces at the accumulation boundary,
#: after the backward): the gradient partition (grads_in_partition, or the compact fp32 partition) is allocated whole
#: at its first copy beside the full gradients not reduced yet.
REDUCING = [("E1", _z(1), "bf16", 65_732_948), ("E4", {**_z(1), **FP32_ACCUM}, "fp16", 81_793_684),
            ("E2", {**_z(1), **FP32_ACCUM}, "bf16", 80_881_680)]


@pytest.mark.parametrize("cell, config, precision, measured", REDUCING, ids=[c[0] for c in REDUCING])
def test_zero_1_reduction_holds_the_partition_beside_the_full_gradients(tmp_path: Path, cell: str, config: dict,
                                                                        precision: str, measured: int) -> None:
    ledger = _ledger(tmp_path, config, precision=precision)
    mine = [c for c in ledger.entries if c.note.startswith("DeepSpeed ZeRO") and c.live_at("end of backward")
            and c.category in ("communication", "temporary")]
    got = _states(ledger) + sum(c.nbytes for c in mine)
    assert measured * 0.999 <= got <= measured * 1.01  # E1: the head's 512,000 B were freed before the partition came
