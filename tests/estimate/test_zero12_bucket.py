"""DeepSpeed ZeRO-1/2's reduce buckets (memplan.estimate.zero12_bucket): DeepSpeed's ``setup_buckets`` allocates
``reduce_bucket_size`` elements whatever the model's size, twice with ``overlap_comm``, none without
``contiguous_gradients``; ``"auto"`` is Hugging Face's hidden_size^2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan import estimate
from memplan.estimate.result import StageEstimate
from memplan.inputs import JobRequest, load_job


def _stage(tmp_path: Path, model: str, zero: int, *, steps: int = 1, top: dict[str, object] | None = None,
           **zero_keys: object) -> StageEstimate:
    config = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": steps,
              "zero_optimization": {"stage": zero, **zero_keys}, **(top or {})}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    loaded = load_job(JobRequest(model=model, flags={"gpus": 8, "seq": 1024, "deepspeed_config": str(path)}))
    return estimate(loaded.model, loaded.job).stages[0]


def _communication(tmp_path: Path, model: str, zero: int, **zero_keys: object) -> int:
    """The most the buckets hold at any moment of the step."""
    return _stage(tmp_path, model, zero, **zero_keys).max_communication_bytes


@pytest.mark.parametrize("zero", [1, 2])
def test_a_small_model_gets_the_whole_bucket(zero: int, tmp_path: Path) -> None:
    """gpt2 (124 M parameters) under DeepSpeed's default 5e8-element bucket: 5e8 bf16 elements, not its gradients'
    size (the cap memplan had)."""
    assert _communication(tmp_path, "gpt2", zero) == 500_000_000 * 2


def test_the_config_s_size_overlap_and_contiguity(tmp_path: Path) -> None:
    assert _communication(tmp_path, "gpt2", 2, reduce_bucket_size=50_000_000) == 50_000_000 * 2
    assert _communication(tmp_path, "gpt2", 2, reduce_bucket_size=50_000_000, overlap_comm=True) == 2 * 50_000_000 * 2
    assert _communication(tmp_path, "gpt2", 2, contiguous_gradients=False) == 0
    assert _communication(tmp_path, "gpt2", 1, reduce_bucket_size="auto") == 768 * 768 * 2


def test_overlap_comm_is_read_and_checked(tmp_path: Path) -> None:
    from memplan.errors import ConfigError

    with pytest.raises(ConfigError, match="overlap_comm"):
        _communication(tmp_path, "gpt2", 2, overlap_comm="yes")


def test_the_bucket_is_one_sentence_of_the_ledger(tmp_path: Path) -> None:
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "overlap_comm": True}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    loaded = load_job(JobRequest(model="gpt2", flags={"gpus": 8, "deepspeed_config": str(path)}))
    result = estimate(loaded.model, loaded.job)
    assert any("ZeRO-2 reduce buckets: 2 x reduce_bucket_size 500,000,000" in a for a in result.assumptions)


def test_the_bucket_lives_in_the_backward_and_across_a_stage_1_accumulation(tmp_path: Path) -> None:
    """Freed at the end of every backward at stage 2 (independent_gradient_partition_epilogue), at the accumulation
    boundary at stage 1: the loss holds it only in a stage-1 step that accumulates."""
    at2 = _stage(tmp_path, "gpt2", 2, reduce_bucket_size=50_000_000)
    assert at2.peak_phase == "loss" and at2.communication_bytes == 0
    at1 = _stage(tmp_path, "gpt2", 1, steps=4, reduce_bucket_size=50_000_000)
    assert at1.peak_phase == "loss" and at1.communication_bytes == 50_000_000 * 2


def test_the_bucket_s_dtype_and_bf16_optimizer(tmp_path: Path) -> None:
    """With fp32 gradient accumulation the stage-2 bucket stays in the model's dtype; stage 1 with bf16 weights and
    fp32 accumulation runs BF16_Optimizer, which has none (engine.py _do_optimizer_sanity_check)."""
    fp32 = {"data_types": {"grad_accum_dtype": "fp32"}}
    assert _stage(tmp_path, "gpt2", 2, top=fp32).max_communication_bytes == 500_000_000 * 2
    assert _stage(tmp_path, "gpt2", 1, top=fp32).max_communication_bytes == 0


def test_the_python_api_checks_the_deepspeed_settings() -> None:
    """Sharding reached without the config reader refuses what DeepSpeed's config refuses (review, session 14)."""
    from memplan.errors import JobConfigError
    from memplan.job import Sharding

    for fields in ({"reduce_bucket_size": -5}, {"reduce_bucket_size": 0}, {"sub_group_size": 1.5},
                   {"max_live_parameters": "auto"}, {"overlap_comm": "yes"}, {"communication_data_type": "int8"}):
        with pytest.raises(JobConfigError):
            Sharding(zero=2, **fields)  # type: ignore[arg-type]
    assert Sharding(zero=3, reduce_bucket_size="auto", prefetch_bucket_size=0).reduce_bucket_size == "auto"
