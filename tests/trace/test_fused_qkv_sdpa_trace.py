"""A fused q/k/v projection with RoPE under SDPA (GPT-NeoX ``query_key_value``, Phi-3 ``qkv_proj``): RoPE's
``torch.cat`` makes q and k heads-first, so the kernel's saved output and the output projection's input (its
``transpose(1, 2).contiguous()`` copy) are two tensors, and a frozen output projection keeps only the first
(helper neoxsdpa13, session 13; at merge13-b the estimate kept both: NeoX LoRA query_key_value +8.01%, LoRA
all-linear +4.81%, DoRA all-linear +2.57% activations; Phi-3 GQA full training -2.4%; at fp32, where the
memory-efficient kernel's output is the projection's input, v's width was counted twice: Phi-3 MHA +4.6%, GQA +1.3%)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate

from tests.trace.test_policies_trace import NEOX

#: Phi-3 with grouped keys and values: its q/k/v term counted v's width twice and the kernel's output not at all.
PHI3_GQA = {"model_type": "phi3", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 2048, "tie_word_embeddings": False,
            "max_position_embeddings": 1024, "pad_token_id": 0}


@pytest.mark.parametrize(("config", "precision", "flags"), [
    (NEOX, "bf16-mixed", {"peft": "lora", "lora_targets": "query_key_value"}),
    (NEOX, "bf16-mixed", {"peft": "lora", "lora_targets": "all-linear"}),
    (NEOX, "bf16-mixed", {"peft": "dora", "lora_targets": "all-linear"}),
    (PHI3_GQA, "bf16-mixed", {}),
    (PHI3_GQA, "bf16-mixed", {"peft": "lora", "lora_targets": "qkv_proj"}),
    # fp32 runs the memory-efficient kernel, whose output is sequence-first: one tensor with the projection's input
    (PHI3_GQA, "fp32", {}),
    (dict(PHI3_GQA, num_key_value_heads=8), "fp32", {}),
])
def test_fused_qkv_sdpa_keeps_the_kernel_output_apart(tmp_path: Path, config: dict[str, object], precision: str,
                                                      flags: dict[str, str]) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(config))
    result = trace(str(path), seq=256, mbs=2, precision=precision, attention="sdpa", recompute="none",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, dropout=0.0, **flags)
    rows = {row.category: row for row in compare_with_estimate(str(path), result.options, result.summary).rows}
    assert abs(rows["activation"].relative or 0.0) <= 0.01, rows["activation"]
    assert abs(rows["peak allocated"].relative or 0.0) <= 0.005, rows["peak allocated"]
