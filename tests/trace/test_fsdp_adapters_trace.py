"""peft adapters on FSDP2 ranks (memplan.trace.setup._sharded_adapters): peft wraps the model, then each decoder
layer and the root are ``fully_shard``-ed with the bf16 / fp32 ``MixedPrecisionPolicy``; the estimate of the same
job agrees (tests/estimate/test_fsdp_adapter_dtype.py holds these figures for the estimator alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from tests.estimate.test_fsdp_adapter_dtype import FLAGS, LLAMA_TOY, TRACED


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("fsdp16")) / "config.json"
    path.write_text(json.dumps(LLAMA_TOY), encoding="utf-8")
    return str(path)


def test_lora_on_two_fsdp_ranks(toy: str) -> None:
    result = trace(toy, device="cuda", iterations=2, framework="torchtitan", recompute="none", **FLAGS)
    summary = result.summary
    assert summary.trainable_params == 2 * 75_776  # LoRA r 16 on the 7 linears of 2 layers
    assert (summary.peak_allocated_bytes, summary.max_requested_by_category["activation"]) == \
        TRACED[("torchtitan", "none")]
    rows = {r.category: r for r in compare_with_estimate(toy, result.options, summary).rows}
    for category in ("parameter", "gradient", "optimizer_state"):
        assert rows[category].estimated_bytes == rows[category].traced_bytes, category
    for category in ("activation", "peak allocated"):
        assert abs(rows[category].relative or 0.0) < 0.002, (category, rows[category])
