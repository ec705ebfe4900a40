"""Where an MoE layer applies its routing probabilities decides what autograd keeps.

Megatron (``moe_probs_at="experts"``) scales the experts' activation output: a plain (GELU)
expert keeps that output for the product's backward; a gated one uses the fused weighted SwiGLU
(nothing extra); no combine weighting. Other frameworks weight the combine, which keeps the
expert outputs.
"""

from __future__ import annotations

from memplan.estimate.activations import ActivationShape, divided, layer_terms
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.profiles.framework import HF, MEGATRON

S, B, H, F, E, K, TP, EP = 1024, 4, 512, 2048, 8, 2, 2, 4
ARGS = {"--num-layers": 2, "--hidden-size": H, "--num-attention-heads": 8, "--seq-length": S,
        "--max-position-embeddings": S, "--micro-batch-size": B, "--global-batch-size": 32,
        "--num-experts": E, "--moe-router-topk": K, "--tensor-model-parallel-size": TP,
        "--sequence-parallel": True, "--expert-model-parallel-size": EP, "--expert-tensor-parallel-size": 1,
        "--bf16": True, "--vocab-size": 32000}
PRODUCT = "experts activation output kept by the probability product"
COMBINE = "expert outputs kept by the weighted combine"


def _moe_layer(gated: bool = False):  # type: ignore[no-untyped-def]
    model, _ = from_megatron_args({**ARGS, "--swiglu": True} if gated else ARGS, gpus=8)
    layer = model.layers[0]
    assert layer.moe is not None and layer.moe.expert.gated == gated
    return layer


def _shape(probs_at: str) -> ActivationShape:
    return ActivationShape(seq=S, kv_seq=S, micro_batch=B, hidden=H, tp=TP, sequence_parallel=True, act_bytes=2,
                           residual_bytes=2, attention="flash", dropout=False, kernels="fused", expert_tp=1,
                           dispatcher="allgather", ep=EP, moe_probs_at=probs_at)


def _terms(layer, shape: ActivationShape) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {t.name: divided(t, shape) for t in layer_terms(layer, shape)}


def test_the_profiles_say_where_the_probabilities_go() -> None:
    assert MEGATRON.moe_probs_at == "experts" and HF.moe_probs_at == "combine"


def test_a_gelu_expert_keeps_its_activation_output_for_the_probability_product() -> None:
    terms = _terms(_moe_layer(), _shape("experts"))
    # every rank of the EP=4 x ETP=1 grid runs its experts on all routed copies of the TP group's
    # tokens it receives: S*B*K / TP rows of the full FFN width, in bf16
    assert terms[PRODUCT] == 2 * (S * B * K // TP) * F == 16 * 2**20
    assert terms[PRODUCT] == terms["experts fc2 input"]
    assert COMBINE not in terms


def test_a_gated_expert_uses_the_fused_weighted_swiglu_and_keeps_nothing_more() -> None:
    terms = _terms(_moe_layer(gated=True), _shape("experts"))
    assert PRODUCT not in terms and COMBINE not in terms


def test_the_weighted_combine_keeps_the_expert_outputs_instead() -> None:
    terms = _terms(_moe_layer(), _shape("combine"))
    assert terms[COMBINE] == 2 * (S * B * K // TP) * H
    assert PRODUCT not in terms


def test_moe_act_recompute_drops_the_product_operand() -> None:
    sites = {t.name: t.site for t in layer_terms(_moe_layer(), _shape("experts"))}
    assert sites[PRODUCT] == "moe_act"
