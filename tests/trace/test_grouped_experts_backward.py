"""transformers' grouped experts' backward (helper moegrad11, session 11).

The trace: ``index_backward`` accumulates into its zeros in place on plain tensors (``_index_put_impl_``) but makes
a new tensor under a dispatch mode; the tracking mode runs it in place, as an eager run does. The estimate: the
combine's backward holds three routed-rows gradients (the reordered zeros and the product's two gradients). A
Mixtral-like toy (helper mixtral12, session 12): the experts' backward walked op by op (fc1's output is freed before
its gradient is made), and the combine's gradients in fp32 where the routing weights are fp32 but the experts 16-bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from memplan.trace.core.tracker import TracingFakeMode

QWEN3_MOE_V256 = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 768,
                  "moe_intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
                  "num_hidden_layers": 2, "vocab_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0,
                  "rms_norm_eps": 1e-6}
MIXTRAL_V256 = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 256,
                "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 1024,
                "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6}


class _Ops:
    phase = "backward"
    iteration = 0
    op = ""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def see(self, storage: object, op: str) -> None:
        self.ops.append(op)

    def module_of(self) -> str:
        return ""


def test_index_backward_accumulates_in_place() -> None:
    mode = TracingFakeMode()
    recorder = _Ops()
    with mode:
        x = torch.empty(64, 8, requires_grad=True)
        y = x[torch.arange(64).flip(0)]
        out = y.sum()
        mode.recorder = recorder  # type: ignore[assignment]
        out.backward()
    assert "aten.index_put.default" not in recorder.ops
    assert "aten.index_put_.default" in recorder.ops


@pytest.mark.parametrize("recompute, extra, before", [
    ("none", {}, -0.025), ("full", {}, -0.039),
    ("megatron-selective", {"recompute_modules": "moe_act"}, -0.017),
])
def test_combine_backward_priced(tmp_path: Path, recompute: str, extra: dict[str, object], before: float) -> None:
    """A small vocabulary: the last layer's combine backward sets the peak (``before``: the old estimate's error)."""
    path = tmp_path / "qwen3_moe_v256.json"
    path.write_text(json.dumps(QWEN3_MOE_V256), encoding="utf-8")
    result = trace(str(path), seq=512, precision="bf16-mixed", attention="sdpa", recompute=recompute,
                   optimizer="adamw", device="cuda", iterations=2, optimizer_impl="foreach", mbs=2, **extra)
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    assert abs(rows["peak allocated"].relative or 0.0) <= 0.005


@pytest.mark.parametrize("precision, extra, before", [
    ("bf16-mixed", {}, 0.0346), ("bf16", {"peft": "lora", "lora_targets": "q_proj,v_proj"}, 0.0109),
])
def test_mixtral_experts_backward_walked(tmp_path: Path, precision: str, extra: dict[str, object],
                                         before: float) -> None:
    """The last layer's experts' backward sets the peak (``before``: the old estimate's error)."""
    path = tmp_path / "mixtral_v256.json"
    path.write_text(json.dumps(MIXTRAL_V256), encoding="utf-8")
    result = trace(str(path), seq=512, precision=precision, attention="sdpa", recompute="none", optimizer="adamw",
                   device="cuda", iterations=2, optimizer_impl="foreach", mbs=2, **extra)
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    assert abs(rows["peak allocated"].relative or 0.0) <= 0.005
