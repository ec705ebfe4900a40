"""A fine-tuned layer's frozen gated MLP backward, walked op by op (memplan.estimate.frozen_mlp_backward),
and a quantized linear's backward as an op of its own (memplan.estimate.finetune.dequantizing_op_bytes).

The figures are mistral-7b's at 2,048 tokens x 1 (bf16-mixed, hf, LoRA on q_proj,v_proj), where memplan
trace (fake tensors, benchmarks/quantized_witness.py) shows a layer's backward worst op at 176,160,768 bytes
above the layer's saved tensors beside its 16,777,216-byte output gradient: with an int8 base
``down_proj``'s dequantized weight (14,336 x 4,096 bf16) and its input gradient (2,048 x 14,336 bf16),
without one the product's backward (three intermediate-sized gradients); the general rule said 352,321,536
(two of the largest saved term, the fc1 term that counts three tensors) until session 12, plus the dequantized
weight on an int8 base. It now prices the product's first node as the walk does (three intermediate-sized
tensors) but without the output gradient beside it.
"""

from __future__ import annotations

import pytest

from memplan.estimate.engine import layer_activation_costs
from memplan.job import Batch, FineTuning, Job, Precision, Recompute
from memplan.model import load_model

TRACED = 176_160_768 + 16_777_216


def _job(quantize_base: str = "none", recompute: str = "full", peft: str = "lora",
         targets: str = "q_proj,v_proj") -> Job:
    return Job(framework="hf", precision=Precision(name="bf16-mixed"), batch=Batch(seq_length=2048),
               finetune=FineTuning(peft=peft, lora_targets=targets, quantize_base=quantize_base),
               attention="sdpa", recompute=Recompute(mode=recompute))


@pytest.mark.parametrize("quantize_base", ["none", "int8", "nf4"])
@pytest.mark.parametrize("recompute", ["full", "none"])
def test_a_frozen_mlp_backward_holds_what_the_trace_shows(quantize_base: str, recompute: str) -> None:
    transient = layer_activation_costs(load_model("mistral-7b"), _job(quantize_base, recompute), 1)[2]
    # a recomputed 4-bit layer: down_proj's backward runs before the recompute (the 4-bit matmul saves nothing),
    # whose up_proj holds its dequantized weight beside the block's residual input and its norm's output
    forward_locals = 2 * 16_777_216 if quantize_base == "nf4" and recompute == "full" else 0
    assert transient == TRACED + forward_locals


def test_adapted_and_trained_mlps_are_walked_node_by_node() -> None:
    model = load_model("mistral-7b")
    # LoRA on down_proj too (memplan.estimate.mlp_backward_nodes, helper fp32lora13): its adapter's saved 16-bit
    # input (2,048 x 14,336) is freed before the product's node, which holds three intermediate-sized gradients
    # beside the 16-bit output gradient (the general rule: those three beside every saved tensor, 176,160,768)
    adapted = 16_777_216 + 3 * 58_720_256 - 58_720_256
    assert layer_activation_costs(model, _job(targets="all-linear"), 1)[2] == adapted
    # a trained MLP (memplan.estimate.mlp_backward_nodes): down_proj's node holds the fp32 output gradient, its
    # 16-bit cast, the 16-bit weight gradient (14,336 x 4,096) and the input's gradient (2,048 x 14,336)
    walked = 33_554_432 + 16_777_216 + 117_440_512 + 58_720_256
    assert layer_activation_costs(model, _job(peft="none", targets="auto"), 1)[2] == walked
