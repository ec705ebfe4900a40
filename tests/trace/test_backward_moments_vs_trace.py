"""Two moments of the backward against the trace (helper backmom12, session 12; ported onto main by helper fnorm12):
the weight gradients a layer's backward has made when it reaches an eager softmax (:mod:`memplan.estimate.made_gradients`,
tensor parallelism included), and the final norm's backward (:mod:`memplan.estimate.final_norm_backward`). The toys of
tests/estimate/test_backward_moments.py (a 256-token vocabulary) at 512 tokens, where a backward moment, not the loss,
sets the peak; ``before``: the estimate's error against the trace before them (1624be5; main c90b7fc had the eager
dense and MoE cells' gradients already, through made_gradients).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from tests.estimate.test_backward_moments import written

_QV = {"peft": "lora", "lora_targets": "q_proj,v_proj"}
#: The estimate within this of the trace's peak allocated (the cells sit within 0.8% after).
TOLERANCE = 0.01


@pytest.mark.parametrize("toy, precision, attention, recompute, extra, before", [
    # the last layer's softmax backward beside its MLP / MoE block's gradients
    ("llama_v256", "bf16-mixed", "eager", "none", {}, -0.0195),
    ("llama_v256", "bf16", "eager", "none", {}, -0.0177),
    ("qwen3_moe_v256", "bf16-mixed", "eager", "none", {}, -0.033),
    ("qwen3_moe_v256", "bf16-mixed", "eager", "full", {}, -0.0354),
    ("llama_v256", "bf16-mixed", "eager", "none", {"tp": 2}, -0.0255),
    # the final norm's backward beside every layer's saved tensors
    ("llama_v256", "bf16-mixed", "sdpa", "megatron-selective", {"recompute_modules": "core_attn"}, -0.0111),
    ("qwen3_moe_v256", "bf16", "sdpa", "none", {}, -0.0283),
    ("llama_v256", "bf16-mixed", "sdpa", "none", _QV, -0.0386),
    ("llama_v256", "bf16-mixed", "sdpa", "none", {**_QV, "quantize_base": "int8"}, -0.0725),
])
def test_backward_moment_priced(tmp_path: Path, toy: str, precision: str, attention: str, recompute: str,
                                extra: dict[str, object], before: float) -> None:
    path = written(tmp_path, toy)
    job = {"optimizer_impl": "foreach", "mbs": 2, **extra}
    result = trace(path, seq=512, precision=precision, attention=attention, recompute=recompute,
                   optimizer="adamw", device="cuda", iterations=2, **job)
    row = compare_with_estimate(path, result.options, result.summary).row("peak allocated")
    assert abs(row.relative or 0.0) <= TOLERANCE, (row.traced_bytes, row.estimated_bytes, before)


_GPT2_V256 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 8, "vocab_size": 256, "n_positions": 1024}
_NEOX_V256 = {"model_type": "gpt_neox", "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8,
              "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 1024, "tie_word_embeddings": False,
              "rotary_pct": 0.25, "use_parallel_residual": True, "bos_token_id": 0, "eos_token_id": 0}


@pytest.mark.parametrize("toy, precision, extra, before", [
    ("llama_v256", "bf16-mixed", {}, 0.0021),
    ("llama_v256", "bf16", {}, -0.0051),
    ("llama_v256", "bf16-mixed", {"tp": 2}, -0.0059),
    ("llama_v256", "bf16", {"tp": 2}, -0.0095),
    ("qwen3_moe_v256", "bf16-mixed", {}, -0.0071),
    ("qwen3_moe_v256", "bf16", {}, -0.0050),
    ("gpt2_v256", "bf16", {}, -0.0023),
    ("neox_v256", "bf16-mixed", {}, 0.0080),
])
def test_the_softmax_backward_holds_the_residual_gradient(tmp_path: Path, toy: str, precision: str,
                                                         extra: dict[str, object], before: float) -> None:
    """At the last layer's eager softmax backward (its traced peak; no recompute) the residual stream's gradient waits
    for the attention block's, and the autocast copies of the weights whose backward has run are freed (helper
    gpt2bwd12); GPT-2's and GPT-NeoX's attention projections are ``attn.c_attn``, ``attention.query_key_value``.
    ``before``: the error at ce91adc."""
    import json

    configs = {"gpt2_v256": _GPT2_V256, "neox_v256": _NEOX_V256}
    if toy in configs:
        path = str(tmp_path / f"{toy}.json")
        Path(path).write_text(json.dumps(configs[toy]))
    else:
        path = written(tmp_path, toy)
    result = trace(path, seq=512, precision=precision, attention="eager", recompute="none", optimizer="adamw",
                   device="cuda", iterations=2, optimizer_impl="foreach", mbs=2, dropout=0.0, **extra)
    row = compare_with_estimate(path, result.options, result.summary).row("peak allocated")
    assert abs(row.relative or 0.0) <= 0.001, (row.traced_bytes, row.estimated_bytes, before)
