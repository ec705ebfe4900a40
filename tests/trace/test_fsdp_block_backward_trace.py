"""``memplan trace --fsdp full`` at a block's backward, against the estimate (memplan.estimate.fsdp_block_backward):
FSDP2 keeps the previous unit's reduce-scatter input until the next unit's post-backward (torch
``FSDPParamGroup.post_backward``, ``comm_ctx.reduce_scatter_states``), makes a block's weight gradients unsharded
in the compute dtype, and at the first layer's backward prefetches the embedding's unit (``_backward_prefetch``).
Cells of benchmarks/fsdp_block_witness.py (C2, C4, H4; before: -4.19%, -2.41%, -1.94%)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY
from tests.estimate.test_fsdp_block_backward import FLAGS


@pytest.mark.parametrize(("vocab", "framework", "recompute"), [(2048, "torchtitan", "full"),
                                                               (256, "torchtitan", "none"), (256, "hf", "none")])
def test_block_backward_peak(tmp_path: Path, vocab: int, framework: str, recompute: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": vocab}), encoding="utf-8")
    result = trace(str(path), device="cuda", iterations=2, framework=framework, recompute=recompute, **FLAGS)
    assert result.summary.peak_phase == "backward"
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    assert abs(rows["peak allocated"].relative or 0.0) < 0.001


def test_grouped_experts_gradients_peak(tmp_path: Path) -> None:
    """The grid's ``qwen3_moe_wide`` toy, torchtitan, full recompute (moe_fsdp_witness W2; before: -7.35%): layer 0's
    gate-up grouped GEMM's backward holds its experts' unsharded bf16 gradients (helper moefsdp18)."""
    from tests.trace.test_agreement_grid import _COMMON, CONFIGS

    path = tmp_path / "moe.json"
    path.write_text(json.dumps({**_COMMON, **CONFIGS["qwen3_moe_wide"]}), encoding="utf-8")
    result = trace(str(path), device="cuda", iterations=2, framework="torchtitan", recompute="full", **FLAGS)
    assert result.summary.peak_module == "model.layers.0.mlp.experts"
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    assert abs(rows["peak allocated"].relative or 0.0) < 0.001
