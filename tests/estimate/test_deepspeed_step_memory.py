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
