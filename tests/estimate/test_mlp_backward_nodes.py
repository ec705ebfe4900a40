"""A dense MLP's backward node by node (memplan.estimate.mlp_backward_nodes): GPT-2-XL's frozen gelu_new MLP under
LoRA at 512 tokens (bf16-mixed on a 16-bit base, hf, SDPA), as the traces of tests/trace/test_mlp_backward_vs_trace.py
and tests/trace/test_dropout_trace.py show it: the layer's output gradient (16-bit residual), ``c_proj``'s input
gradient cast back to fp32, the last product's two fp32 gradients beside it and, in a layer that is not recomputed,
the 16-bit cast of ``0.5 * x``'s; a LoRA adapter on ``c_proj`` frees its saved 16-bit input first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.estimate.engine import layer_activation_costs
from memplan.job import Batch, FineTuning, Job, Precision, Recompute
from memplan.model import load_model

TOKENS = 512
OUT = TOKENS * 1600 * 2  # the layer's output gradient
FP32 = TOKENS * 6400 * 4  # one of gelu_new's fp32 tensors
ONE = TOKENS * 6400 * 2  # one intermediate in 16 bits


def _transient(targets: str, recompute: str, peft: str = "lora") -> int:
    job = Job(framework="hf", precision=Precision(name="bf16-mixed"), batch=Batch(seq_length=TOKENS),
              attention="sdpa", finetune=FineTuning(peft=peft, lora_targets=targets), recompute=Recompute(mode=recompute))
    return layer_activation_costs(load_model("gpt2-xl"), job, 1)[2]


@pytest.mark.parametrize("targets, recompute, walked", [
    ("c_attn", "none", OUT + 3 * FP32 + ONE),
    # a recomputed tensor is freed once unpacked: the product's node casts its 16-bit gradient after its factors
    ("c_attn", "full", OUT + 3 * FP32),
    # the adapter's saved 16-bit input freed by c_proj's node; x's gradient from the adapter, from the base and
    # their sum (three fp32 tensors), then the product's node on the sum
    ("all-linear", "none", OUT + 3 * FP32 + ONE - ONE),
    ("all-linear", "full", OUT + 3 * FP32 - ONE),
])
def test_frozen_gelu_new_mlp_walked(targets: str, recompute: str, walked: int) -> None:
    assert _transient(targets, recompute) == walked  # the general rule: 3 * FP32


def test_dora_on_the_output_projection_keeps_the_general_rule() -> None:
    assert _transient("all-linear", "full", peft="dora") == 3 * FP32


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_gated_mlp_with_a_lora_output_projection_walked(recompute: str) -> None:
    """Llama's frozen SwiGLU MLP under LoRA all-linear at fp32 (helper fp32lora13): ``down_proj``'s adapter frees
    the input it saved, then its input gradient, the base's and their sum; the product's node on the sum holds
    the incoming gradient and one per factor. Worst: the output gradient and two intermediates (the general rule:
    three intermediates beside every saved tensor)."""
    out, one = TOKENS * 2048 * 4, TOKENS * 8192 * 4
    job = Job(framework="hf", precision=Precision(name="fp32"), batch=Batch(seq_length=TOKENS), attention="sdpa",
              finetune=FineTuning(peft="lora", lora_targets="all-linear"), recompute=Recompute(mode=recompute))
    assert layer_activation_costs(load_model("llama-3.2-1b"), job, 1)[2] == out + 2 * one


#: The GPT-NeoX toy of tests/trace (plain GELU MLP, 256 wide, 1,024 intermediate) at 512 tokens.
NEOX = {"model_type": "gpt_neox", "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8,
        "num_hidden_layers": 2, "vocab_size": 2048, "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "rotary_pct": 0.25, "use_parallel_residual": True, "bos_token_id": 0, "eos_token_id": 0}


@pytest.mark.parametrize("precision, walked", [
    # fp32: dense_4h_to_h's adapter frees the input it saved (its gradient as large), then the base's gradient and
    # the two summed beside the layer's output gradient (the general rule: two intermediates beside every saved tensor)
    ("fp32", TOKENS * 256 * 4 + 2 * TOKENS * 1024 * 4),
    # pure bf16, fp32 adapters: lora_A's fp32 input gradient beside the output gradient and the add's bf16 cast of it
    # (held until the base's node; the general rule: two of the fp32 input)
    ("bf16", 2 * TOKENS * 256 * 2 + TOKENS * 1024 * 4),
])
def test_plain_gelu_mlp_with_a_lora_output_projection_walked(tmp_path: Path, precision: str, walked: int) -> None:
    """GPT-NeoX's frozen plain-GELU MLP under LoRA all-linear (helper neoxft14; traces of the toy at fp32 and pure
    bf16, full recompute: tests/trace/test_lora_recompute_tail_trace.py)."""
    path = tmp_path / "neox.json"
    path.write_text(json.dumps(NEOX))
    job = Job(framework="hf", precision=Precision(name=precision), batch=Batch(seq_length=TOKENS), attention="sdpa",
              finetune=FineTuning(peft="lora", lora_targets="all-linear"), recompute=Recompute(mode="none"))
    assert layer_activation_costs(load_model(str(path)), job, 1)[2] == walked
