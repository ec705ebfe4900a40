"""Eager attention's ``q @ k^T`` saves q only for the keys' gradient: with LoRA on q_proj and v_proj and a block
input that needs no gradient (the first layer, no checkpointing), q is not saved."""

from __future__ import annotations

from dataclasses import replace

from memplan.estimate.activations import ActivationShape, layer_terms_by_block
from memplan.estimate.partial_freeze import layer_flows, unkeyed_query_terms
from memplan.estimate.terms import TermRole
from memplan.job import FineTuning
from memplan.model import load_model

SHAPE = ActivationShape(seq=64, kv_seq=64, micro_batch=1, hidden=2048, tp=1, sequence_parallel=False, act_bytes=2,
                        residual_bytes=2, attention="eager", dropout=False, kernels="eager")


def test_the_keys_need_a_gradient_where_their_projection_or_the_block_input_does() -> None:
    model = load_model("llama-3.2-1b")
    default = FineTuning(peft="lora", lora_targets="q_proj,v_proj")
    assert not layer_flows(model, default, False)[0].attention.keys_grad
    assert layer_flows(model, default, False)[1].attention.keys_grad  # its input carries layer 0's gradient
    assert layer_flows(model, default, True)[0].attention.keys_grad  # checkpointing: the input requires grad
    assert layer_flows(model, FineTuning(peft="lora", lora_targets="k_proj"), False)[0].attention.keys_grad


def test_unfused_attention_drops_q_where_the_keys_need_no_gradient() -> None:
    model = load_model("llama-3.2-1b")
    layer = model.layers[0]
    flow = layer_flows(model, FineTuning(peft="lora", lora_targets="q_proj,v_proj"), False)[0].attention

    def qkv(shape: ActivationShape) -> int:
        terms = unkeyed_query_terms(layer_terms_by_block(layer, shape)[0], layer.attention, shape, flow)
        return sum(t.bytes for t in terms if t.role is TermRole.QKV)

    attn = layer.attention
    q = 2 * 64 * attn.num_heads * attn.head_dim
    kv = 2 * 64 * attn.num_kv_heads * (attn.head_dim + attn.v_head_dim)
    assert qkv(SHAPE) == kv
    assert qkv(replace(SHAPE, attention="sdpa")) == q + kv  # the SDPA node saves q, k and v whatever
