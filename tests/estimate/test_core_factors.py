"""Partial freezing of an eager attention block (helper peftmom18): each matmul of the core saves a factor only for
the other's gradient, and a linear its input only for its weight's. Measured with ``memplan trace`` on the agreement
grid's llama toy (eager, bf16-mixed, 256 tokens x 2): DoRA on k_proj,v_proj keeps no keys in layer 0 (+0.633%
before), DoRA on q_proj,o_proj no 16-bit probabilities there (+5.266%), q/k/v trained alone no output-projection
input (+1.261%); benchmarks/peft_moments18.py."""

from __future__ import annotations

from memplan.estimate.activations import ActivationShape, layer_terms_by_block
from memplan.estimate.partial_freeze import block_terms, core_factor_terms, layer_flows
from memplan.estimate.terms import TermRole
from memplan.job import FineTuning
from memplan.model import load_model

SHAPE = ActivationShape(seq=64, kv_seq=64, micro_batch=2, hidden=2048, tp=1, sequence_parallel=False, act_bytes=2,
                        residual_bytes=2, attention="eager", dropout=False, kernels="eager")


def _attention(ft: FineTuning, index: int) -> dict[TermRole, int]:
    model = load_model("llama-3.2-1b")
    layer = model.layers[index]
    flow = layer_flows(model, ft, False)[index].attention
    terms = core_factor_terms(block_terms(layer_terms_by_block(layer, SHAPE)[0], SHAPE, flow), layer.attention,
                              SHAPE, flow)
    out: dict[TermRole, int] = {}
    for t in terms:
        out[t.role] = out.get(t.role, 0) + t.bytes
    return out


def test_the_factors_need_a_gradient_where_their_projection_or_the_block_input_does() -> None:
    model = load_model("llama-3.2-1b")
    kv = layer_flows(model, FineTuning(peft="dora", lora_targets="k_proj,v_proj"), False)
    assert not kv[0].attention.queries_grad and kv[0].attention.values_grad
    assert kv[1].attention.queries_grad  # its input carries layer 0's gradient
    qo = layer_flows(model, FineTuning(peft="dora", lora_targets="q_proj,o_proj"), False)
    assert qo[0].attention.queries_grad and not qo[0].attention.values_grad
    assert layer_flows(model, FineTuning(peft="lora", lora_targets="q_proj,o_proj"), True)[0].attention.values_grad


def test_queries_needing_no_gradient_keep_no_keys() -> None:
    """DoRA on k_proj,v_proj, layer 0: q is saved (for the keys' gradient), the keys neither rotated nor repeated."""
    attn = load_model("llama-3.2-1b").layers[0].attention
    tokens = 2 * 64
    kept = _attention(FineTuning(peft="dora", lora_targets="k_proj,v_proj"), 0)
    assert kept[TermRole.QKV] == 2 * tokens * (attn.num_heads + attn.num_kv_heads) * attn.head_dim  # q and v
    assert kept[TermRole.REPEATED_KV] == 2 * tokens * (attn.num_heads - attn.num_kv_heads) * attn.v_head_dim
    later = _attention(FineTuning(peft="dora", lora_targets="k_proj,v_proj"), 1)
    assert later[TermRole.QKV] == 2 * tokens * (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim


def test_values_needing_no_gradient_keep_no_probabilities_cast() -> None:
    """DoRA on q_proj,o_proj, layer 0: the PV matmul saves no probabilities; layer 1's values need a gradient."""
    attn = load_model("llama-3.2-1b").layers[0].attention
    first = _attention(FineTuning(peft="dora", lora_targets="q_proj,o_proj"), 0)
    assert TermRole.SOFTMAX_CAST not in first
    assert first[TermRole.SOFTMAX_FP32] == 4 * 2 * attn.num_heads * 64 * 64
    assert TermRole.SOFTMAX_CAST in _attention(FineTuning(peft="dora", lora_targets="q_proj,o_proj"), 1)


def test_a_frozen_output_projection_keeps_no_input() -> None:
    """q/k/v trained with o_proj frozen: o_proj saves no input in either layer; trained with them, it does."""
    qkv = "q_proj,k_proj,v_proj"
    assert TermRole.OUTPUT_PROJECTION_INPUT not in _attention(FineTuning(trainable=qkv), 0)
    assert TermRole.OUTPUT_PROJECTION_INPUT not in _attention(FineTuning(trainable=qkv), 1)
    assert TermRole.OUTPUT_PROJECTION_INPUT in _attention(FineTuning(trainable=qkv + ",o_proj"), 1)
