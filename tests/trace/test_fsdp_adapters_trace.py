"""peft adapters on FSDP2 ranks (memplan.trace.setup._sharded_adapters): peft wraps the model, then each decoder
layer and the root are ``fully_shard``-ed with the bf16 / fp32 ``MixedPrecisionPolicy``; the estimate of the same
job agrees (tests/estimate/test_fsdp_adapter_dtype.py holds these figures for the estimator alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from tests.estimate.test_fsdp_adapter_dtype import FLAGS, LLAMA_TOY, TRACED, TRACED_V256

_CELLS = [(256 * 8, key, figures) for key, figures in TRACED.items()] + \
    [(256, key, figures) for key, figures in TRACED_V256.items()]


@pytest.mark.parametrize(("vocab", "key", "figures"), _CELLS)
def test_lora_on_two_fsdp_ranks(tmp_path: Path, vocab: int, key: tuple[str, str], figures: tuple[int, int]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": vocab}), encoding="utf-8")
    framework, recompute = key
    result = trace(str(path), device="cuda", iterations=2, framework=framework, recompute=recompute, **FLAGS)
    summary = result.summary
    assert summary.trainable_params == 2 * 75_776  # LoRA r 16 on the 7 linears of 2 layers
    assert summary.peak_allocated_bytes == figures[0]
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, summary).rows}
    for category in ("parameter", "gradient", "optimizer_state"):
        assert rows[category].estimated_bytes == rows[category].traced_bytes, category
    assert abs(rows["peak allocated"].relative or 0.0) < 0.002, rows["peak allocated"]
    if vocab > 256:
        assert summary.max_requested_by_category["activation"] == figures[1]
        assert abs(rows["activation"].relative or 0.0) < 0.002, rows["activation"]
