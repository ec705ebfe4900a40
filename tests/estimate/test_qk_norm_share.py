"""Per-head q/k norms under partial freezing (helper qknorm18): where the keys (or the queries) need no gradient,
their norm's input needs none and its weight is frozen, so it saves nothing. Measured with ``memplan trace`` on the
agreement grid's qwen3_moe toy (sdpa, bf16-mixed, int8 base, LoRA q_proj,v_proj): layer 0 holds q_norm's fp32 copy
and 1/rms only (+0.452% before, the k norm's 135,168 B); benchmarks/peft_moments18.py, cell G97."""

from __future__ import annotations

from memplan.estimate.activations import ActivationShape, layer_terms_by_block
from memplan.estimate.partial_freeze import block_terms, core_factor_terms, layer_flows
from memplan.job import FineTuning
from memplan.model import load_model

SHAPE = ActivationShape(seq=64, kv_seq=64, micro_batch=2, hidden=4096, tp=1, sequence_parallel=False, act_bytes=2,
                        residual_bytes=2, attention="sdpa", dropout=False, kernels="eager")
TOKENS = 2 * 64


def _norm_bytes(ft: FineTuning, index: int) -> tuple[int, int]:
    """(the q/k norms' saved tensors, their 1/rms) of qwen3-8b's layer ``index`` attention block."""
    model = load_model("qwen3-8b")
    layer = model.layers[index]
    flow = layer_flows(model, ft, False)[index].attention
    terms = core_factor_terms(block_terms(layer_terms_by_block(layer, SHAPE)[0], SHAPE, flow), layer.attention,
                              SHAPE, flow)
    norms = [t for t in terms if t.name.startswith("q, k norms")]
    return (sum(t.bytes for t in norms if "1/rms" not in t.name), sum(t.bytes for t in norms if "1/rms" in t.name))


def test_keys_needing_no_gradient_keep_no_k_norm() -> None:
    """LoRA on q_proj,v_proj, layer 0 (its input needs no gradient): q_norm's fp32 copy and 1/rms only."""
    attn = load_model("qwen3-8b").layers[0].attention
    assert _norm_bytes(FineTuning(peft="lora", lora_targets="q_proj,v_proj"), 0) == (
        4 * TOKENS * attn.num_heads * attn.head_dim, 4 * TOKENS * attn.num_heads)
    # layer 1's input carries layer 0's gradient: both norms save
    assert _norm_bytes(FineTuning(peft="lora", lora_targets="q_proj,v_proj"), 1) == (
        4 * TOKENS * (attn.num_heads + attn.num_kv_heads) * attn.head_dim,
        4 * TOKENS * (attn.num_heads + attn.num_kv_heads))


def test_queries_needing_no_gradient_keep_no_q_norm() -> None:
    attn = load_model("qwen3-8b").layers[0].attention
    assert _norm_bytes(FineTuning(peft="lora", lora_targets="k_proj,v_proj"), 0) == (
        4 * TOKENS * attn.num_kv_heads * attn.head_dim, 4 * TOKENS * attn.num_kv_heads)


def test_neither_factor_needing_a_gradient_keeps_no_norm() -> None:
    """LoRA on v_proj alone: neither norm saves anything in layer 0."""
    assert _norm_bytes(FineTuning(peft="lora", lora_targets="v_proj,o_proj"), 0) == (0, 0)


def test_a_trained_k_norm_keeps_its_share() -> None:
    """A trained norm of the block makes the keys need a gradient: both norms save (unchanged)."""
    attn = load_model("qwen3-8b").layers[0].attention
    both = _norm_bytes(FineTuning(peft="lora", lora_targets="q_proj,v_proj", trainable="layers.0.self_attn.k_norm"), 0)
    assert both[1] == 4 * TOKENS * (attn.num_heads + attn.num_kv_heads)
