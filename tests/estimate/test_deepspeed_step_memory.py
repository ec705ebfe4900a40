"""DeepSpeed's engine after the step and at the next forward: gradients freed at stages 0-2 (not ZeRO-3's flat
partition, not BF16_Optimizer's fp32 buffer) (docs/benchmarks.md, helper dsfree15; DeepSpeed 0.19.8's engine on CPU,
world size 1, tiny4 Llama, /tmp/dsfree15/witness2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan import estimate
from memplan.inputs import JobRequest, load_job
from tests.estimate.test_zero12_dtypes import FP32_ACCUM, _ledger, _states, _z

#: (cell, config, the engine's live storage bytes after the second backward and after the second step).
ENGINE = [
    ("E1 ZeRO-1 bf16", _z(1), 58_823_176, 51_470_344),
    ("E9 ZeRO-2 bf16", _z(2), 58_823_176, 51_470_344),
    ("E10 stage 0 bf16", {"zero_optimization": {"stage": 0}}, 58_823_324, 51_470_492),
    ("E13 ZeRO-3 bf16 (its flat gradient partition stays)", _z(3), 59_023_181, 59_023_181),
    ("E2 ZeRO-1 bf16 grad_accum fp32 (BF16_Optimizer's fp32 buffer stays)", {**_z(1), **FP32_ACCUM}, 73_528_840,
     66_176_008),
]


def _forward_states(ledger) -> int:  # type: ignore[no-untyped-def]
    return _states(ledger, "forward") - ledger.total("absent", "forward")


@pytest.mark.parametrize("cell, config, after_backward, after_step", ENGINE, ids=[c[0] for c in ENGINE])
def test_states_after_the_step_match_the_engine(tmp_path: Path, cell: str, config: dict, after_backward: int,
                                                after_step: int) -> None:
    ledger = _ledger(tmp_path, config)
    assert _states(ledger) == pytest.approx(after_backward, rel=0.02)
    assert _forward_states(ledger) == pytest.approx(after_step, rel=0.02)


def test_accumulation_keeps_them_through_the_next_micro_batches(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, _z(1), steps=2)
    assert ledger.total("absent", "forward") == 0


def _one_b(zero: int, **flags: object):  # type: ignore[no-untyped-def]
    loaded = load_job(JobRequest(model="llama-3.2-1b", flags={"gpus": 8, "framework": "deepspeed", "zero": zero,
                                                              **flags}))
    return estimate(loaded.model, loaded.job)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_the_loss_holds_no_gradient_below_zero3(zero: int) -> None:
    est = _one_b(zero)
    stage = est.stages[0]
    assert stage.peak_phase == "loss"
    assert stage.gradients_absent_at_peak_bytes == stage.gradients_bytes > 0
    assert any(f"ZeRO-{zero}" in a or (zero == 0 and "without ZeRO" in a) for a in est.assumptions
               if "frees every gradient" in a)


def test_zero3_keeps_its_gradient_partition() -> None:
    stage = _one_b(3).stages[0]
    assert stage.gradients_absent_at_peak_bytes == 0


def _lora_ledger(tmp_path: Path, stage: int):  # type: ignore[no-untyped-def]
    from memplan.estimate.engine import _stage_parts
    from memplan.estimate.memo import Same
    from tests.estimate.test_zero3_dtypes import TINY4
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY4))
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, **_z(stage)}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    loaded = load_job(JobRequest(model=str(tmp_path / "config.json"), flags={
        "gpus": 1, "seq": 32, "deepspeed_config": str(tmp_path / "ds.json"), "peft": "lora", "lora_rank": 8,
        "lora_targets": "q_proj,v_proj"}))
    _, parts = _stage_parts(Same(loaded.model), loaded.job, 0.0)
    return loaded.job, parts[0][2].ledger


#: E14: tiny4 with LoRA r8 on q_proj and v_proj (32,768 adapter parameters), ZeRO-2 bf16: deepspeed.initialize casts
#: peft's fp32 adapters to bf16; the engine holds 7,877,656 B after the backward and 7,812,120 B after the step
#: (bf16 weights and adapters 7,418,368, the adapters' fp32 master 131,072 and moments 262,144, no gradient).
ADAPTERS, ALL = 32_768, 3_709_184


def test_deepspeed_casts_the_adapters_to_the_model_dtype(tmp_path: Path) -> None:
    from memplan.job import resolved_adapter_dtype

    job, ledger = _lora_ledger(tmp_path, 2)
    assert resolved_adapter_dtype(job) == "bf16"
    assert ledger.total("parameters") == 2 * ALL
    assert ledger.total("master") == 4 * ADAPTERS
    assert _states(ledger) == pytest.approx(7_877_656, rel=0.02)
    assert _forward_states(ledger) == pytest.approx(7_812_120, rel=0.001)


def test_zero3_under_zero_init_keeps_peft_fp32_adapters(tmp_path: Path) -> None:
    """Measured: a model built under ``deepspeed.zero.Init`` keeps fp32 adapters through ``deepspeed.initialize``
    (a plain model's are cast to bf16 at ZeRO-3 too); memplan's ZeRO-3 is the zero.Init one."""
    from memplan.job import resolved_adapter_dtype

    job, _ = _lora_ledger(tmp_path, 3)
    assert resolved_adapter_dtype(job) == "fp32"


@pytest.mark.parametrize("config", [{"zero_optimization": {"stage": 0}},
                                    {"zero_optimization": {"stage": 0, "reduce_bucket_size": 100_000}}],
                         ids=["E10", "E11 bucket keys"])
def test_stage0_flattens_the_gradients_for_its_all_reduce(tmp_path: Path, config: dict) -> None:
    """E10: 7,352,832 B (all 3,676,416 bf16 gradients, below 5e8 elements) alive at the all-reduce, after the
    backward; the engine holds 66,176,164 B then."""
    ledger = _ledger(tmp_path, config)
    assert ledger.total("communication", "end of backward") == 7_352_832
    assert ledger.total("communication", "backward") == 0
    assert _states(ledger) + ledger.total("communication", "end of backward") == pytest.approx(66_176_164, rel=0.02)


def test_stage0_bucket_in_communication_data_type(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, {"zero_optimization": {"stage": 0}, "communication_data_type": "fp32"})
    assert ledger.total("temporary", "end of backward") == 4 * 3_676_416


def test_stage0_communication_data_type_is_modelled() -> None:
    from memplan.frameworks.deepspeed_keys import deepspeed_settings

    got = {s.key: (s.effect, s.note) for s in deepspeed_settings({"communication_data_type": "fp32",
                                                                   "zero_optimization": {"stage": 0}})}
    assert got["communication_data_type"][0] == "modelled" and "ds_allreduce" in got["communication_data_type"][1]
