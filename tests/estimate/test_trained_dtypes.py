"""Partial freezing of MoE layers on a 16-bit base (memplan.estimate.trained_dtypes): a trained layer's HF
grouped experts and gpt-oss sink softmax run in the trained weights' fp32; frozen ones in the base's dtype.
The trace agreement is tests/trace/test_agreement_grid.py's --trainable cells on the Qwen3-MoE and gpt-oss toys."""

from __future__ import annotations

from memplan.estimate import estimate
from memplan.estimate.context import activation_shape
from memplan.estimate.partial_freeze import layer_flows
from memplan.estimate.precision import resolve_precision
from memplan.estimate.trained_dtypes import trained_dtypes_note, trained_weights_shape, uncopied_expert_numel
from memplan.jobflags import build_job
from memplan.model import model_from_hf_config
from memplan.profiles import get_profile

GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 2048,
           "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 128}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
             "vocab_size": 2048, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}


def _job(trainable: str, precision: str = "bf16-mixed", **extra: object):
    return build_job({"seq": 256, "mbs": 2, "precision": precision, "attention": "eager", "framework": "hf",
                      "trainable": trainable, **extra})


def _shapes(config: dict[str, object], trainable: str, precision: str = "bf16-mixed"):
    model = model_from_hf_config(config, name="toy")
    job = _job(trainable, precision)
    profile = get_profile("hf")
    prec = resolve_precision(job, profile)
    shape = activation_shape(model, job, profile, prec)
    flows = layer_flows(model, job.finetune, False)
    return shape, [trained_weights_shape(shape, f, 4 if precision.endswith("mixed") else 2) for f in flows]


def test_a_trained_layer_runs_its_experts_and_sinks_in_fp32_and_a_frozen_one_in_the_base_dtype():
    base, (frozen, trained) = _shapes(GPT_OSS, "layers.1")
    assert (base.act_bytes, base.expert_bytes, base.sink_bytes, base.autocast) == (2, 2, 0, False)
    assert frozen == base
    assert (trained.expert_bytes, trained.sink_bytes) == (4, 4)
    # the attention alone: its sinks train, the experts stay in the base's dtype
    _, (_, attention) = _shapes(GPT_OSS, "layers.1.self_attn")
    assert (attention.expert_bytes, attention.sink_bytes) == (2, 4)


def test_pure_bf16_keeps_everything_16_bit():
    base, shapes = _shapes(QWEN3_MOE, "layers.1", "bf16")
    assert all(s == base for s in shapes)


def test_trained_expert_weights_get_no_autocast_copy():
    model = model_from_hf_config(QWEN3_MOE, name="toy")
    experts = 8 * (2 * 128 * 256 + 256 * 128)  # gate_up_proj and down_proj of one layer
    assert uncopied_expert_numel(model, _job("layers.1").finetune, (0, 1)) == experts
    assert uncopied_expert_numel(model, _job("layers.1.self_attn").finetune, (0, 1)) == 0
    assert uncopied_expert_numel(model, _job("layers.1").finetune, (0,)) == 0


def test_an_moe_block_training_only_its_experts_keeps_no_routing_gradient_tensors():
    model = model_from_hf_config(QWEN3_MOE, name="toy")
    alone = layer_flows(model, _job("layers.1.mlp.experts").finetune, False)[1].mlp
    assert alone.only_experts and not alone.routing_grad
    whole = layer_flows(model, _job("layers.1").finetune, False)[1].mlp
    assert not whole.only_experts and whole.routing_grad
    # an earlier trained layer makes the block's input need a gradient: the routing weights then need one too
    later = layer_flows(model, _job("layers.0,layers.1.mlp.experts").finetune, False)[1].mlp
    assert later.only_experts and later.routing_grad


def test_frozen_experts_under_a_trained_router_keep_nothing_of_theirs():
    model = model_from_hf_config(QWEN3_MOE, name="toy")
    router = layer_flows(model, _job("layers.1.mlp.gate").finetune, False)[1].mlp
    assert router.frozen_experts and not router.experts_save and router.routing_grad
    # a trained norm before them makes their input need a gradient
    normed = layer_flows(model, _job("layers.1.mlp.gate,layers.1.post_attention_layernorm").finetune, False)[1].mlp
    assert normed.experts_save
    expert_terms = 2 * 256 * 2 * 2 * (256 + 256 + 128 + 128)  # dispatched, gate-up, activation, down input (bf16)
    alone = estimate(model, _job("layers.1.mlp.gate", attention="sdpa")).stages[0].forward_activations_bytes
    with_norm = estimate(model, _job("layers.1.mlp.gate,layers.1.post_attention_layernorm",
                                     attention="sdpa")).stages[0].forward_activations_bytes
    assert with_norm - alone >= expert_terms


def test_the_fp32_experts_are_priced_and_explained():
    model = model_from_hf_config(QWEN3_MOE, name="toy")
    mixed = estimate(model, _job("layers.1", attention="sdpa"))
    note = [a for a in mixed.assumptions if a.startswith("partial freezing on a 16-bit base")]
    assert len(note) == 1 and "routed experts train" in note[0] and "sink softmax" not in note[0]
    all_but_experts = "layers.1.self_attn,layers.1.input_layernorm,layers.1.post_attention_layernorm,layers.1.mlp.gate"
    frozen_experts = estimate(model, _job(all_but_experts, attention="sdpa"))
    assert not any(a.startswith("partial freezing on a 16-bit base") for a in frozen_experts.assumptions)
    # the experts' fp32 tensors (gathered tokens, gate-up output, activation, down input, the outputs the combine
    # keeps) at 2 bytes more per element than frozen 16-bit experts; neither has autocast weight copies
    routed, h, f = 2 * 256 * 2, 256, 128
    delta = mixed.stages[0].forward_activations_bytes - frozen_experts.stages[0].forward_activations_bytes
    assert delta == 2 * routed * (h + 2 * f + f + f + h)
    assert not trained_dtypes_note(model, _job("layers.1", "bf16").finetune,
                                   _shapes(QWEN3_MOE, "layers.1", "bf16")[0], 2, "bf16")
