"""transformers' DeepSeek-V2 (MLA, MoE) under SDPA with LoRA on a 16-bit frozen base (helper mlalora13, session 13).

Two things the estimate counted that the job does not keep: a frozen MLA latent norm keeps nothing where its latent
needs no gradient (the first layer, frozen embedding: only an adapter or a trained down-projection gives the latent
one), and the fp32 router's ``F.linear(hidden.type(float32), ...)`` under autocast casts back to 16 bits and saves
that copy only for a trained router weight (a frozen router keeps its weight's copy alone). At merge13-c: LoRA
kv_b_proj +8.20% activations / +3.06% peak, LoRA q_a_proj,q_b_proj +6.64% / +2.57%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate

from tests.trace.test_mla_up import TOY


@pytest.mark.parametrize("flags", [
    {"peft": "lora", "lora_targets": "kv_b_proj"},
    {"peft": "lora", "lora_targets": "q_a_proj,q_b_proj"},
    {},  # control: full training
])
def test_mla_lora_keeps_no_frozen_latent_norm_nor_router_input(tmp_path: Path, flags: dict[str, str]) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(TOY))
    result = trace(str(path), seq=256, mbs=2, precision="bf16-mixed", attention="sdpa", recompute="none",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, dropout=0.0, **flags)
    rows = {row.category: row for row in compare_with_estimate(str(path), result.options, result.summary).rows}
    assert abs(rows["activation"].relative or 0.0) <= 0.01, rows["activation"]
    assert abs(rows["peak allocated"].relative or 0.0) <= 0.005, rows["peak allocated"]
