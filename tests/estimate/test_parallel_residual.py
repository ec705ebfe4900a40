"""GPT-NeoX's parallel residual: the MLP's pre-norm reads the layer input, which the attention's pre-norm
keeps already (transformers' ``GPTNeoXLayer`` with ``use_parallel_residual``)."""

from __future__ import annotations

from dataclasses import replace

from memplan.estimate.activations import ActivationShape, layer_terms_by_block
from memplan.estimate.partial_freeze import layer_flows
from memplan.estimate.terms import TermRole
from memplan.job import FineTuning
from memplan.model.hf import model_from_hf_config

NEOX = {"model_type": "gpt_neox", "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8,
        "num_hidden_layers": 2, "vocab_size": 2048, "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "rotary_pct": 0.25, "use_parallel_residual": True}
SHAPE = ActivationShape(seq=64, kv_seq=64, micro_batch=2, hidden=256, tp=1, sequence_parallel=False, act_bytes=2,
                        residual_bytes=4, attention="eager", dropout=False, kernels="eager", norm="layernorm",
                        autocast=True, autocast_ops=True)


def _norm_inputs(config: dict[str, object], shape: ActivationShape) -> tuple[int, int]:
    layer = model_from_hf_config(config, name="neox").layers[0]
    attention, rest = layer_terms_by_block(layer, shape)
    return tuple(sum(t.bytes for t in terms if t.role is TermRole.NORM_INPUT)  # type: ignore[return-value]
                 for terms in (attention, rest))


def test_the_mlp_norm_input_is_the_layer_input_kept_once() -> None:
    layer_input = 4 * 64 * 2 * 256
    assert _norm_inputs(NEOX, SHAPE) == (layer_input, 0)
    # a sequential layer's MLP norm reads the attention's residual sum: a tensor of its own
    assert _norm_inputs({**NEOX, "use_parallel_residual": False}, SHAPE) == (layer_input, layer_input)
    # Megatron builds its own (sequential) layers whatever the family
    assert _norm_inputs(NEOX, replace(SHAPE, kernels="fused")) == (layer_input, layer_input)


def test_the_mlp_of_a_parallel_layer_needs_a_gradient_only_where_the_layer_input_does() -> None:
    model = model_from_hf_config(NEOX, name="neox")
    ft = FineTuning(peft="lora", lora_targets="query_key_value")
    first = layer_flows(model, ft, False)[0]
    assert first.attention.saves and not first.mlp.input_grad
    assert layer_flows(model, ft, False)[1].mlp.input_grad  # the layer input carries the adapter's gradient
    assert layer_flows(model, ft, False, own_layers=True)[0].mlp.input_grad
    assert layer_flows(model, ft, True)[0].mlp.input_grad  # checkpointing makes the first input require grad
