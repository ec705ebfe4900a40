"""What save_on_cpu cannot take off the GPU or brings back: the weights autograd saved
(memplan.estimate.offload_weights: the stacked experts of a Hugging Face MoE block, a dense projection's 16-bit
weight, nothing of a quantized base) and the embedding output a checkpointed LoRA job makes a leaf."""

from __future__ import annotations

from memplan.estimate.input_leaf import input_leaf_bytes
from memplan.estimate.layer_costs import largest_saved_term
from memplan.estimate.layer_walk import walk_layers
from memplan.estimate.offload_weights import NOTE, largest_saved_weight
from memplan.estimate.stage_activations import stage_activations
from tests.estimate.test_reserved_mechanics import _ctx

_LORA = {"seq": 1024, "mbs": 1, "precision": "bf16-mixed", "framework": "hf", "offload_activations": True,
         "peft": "lora", "lora_rank": 16, "lora_targets": "q_proj,v_proj"}


def test_frozen_stacked_experts_are_the_bring_back() -> None:
    """Mixtral 8x7B under LoRA: the grouped GEMM saves the bf16 gate_up_proj of all 8 experts (what the trace
    brings back in layer 0's experts backward: 1,879,048,192 bytes), far above any saved activation."""
    ctx = _ctx("mixtral-8x7b", _LORA)
    layers = list(ctx.layout.layer_indices)
    assert largest_saved_weight(ctx.run, layers) == 8 * 2 * 14336 * 4096 * 2
    acts = stage_activations(ctx, walk_layers(ctx, 0), None)
    assert acts.bring_back == 8 * 2 * 14336 * 4096 * 2 > largest_saved_term(ctx.run, layers)
    assert NOTE in acts.notes


def test_expert_parallelism_divides_the_stack_and_quantized_dense_weights_bring_nothing() -> None:
    ep = _ctx("mixtral-8x7b", {**_LORA, "gpus": 4, "ep": 4})
    assert largest_saved_weight(ep.run, [0]) == 2 * 2 * 14336 * 4096 * 2
    dense = _ctx("mistral-7b", _LORA)
    assert largest_saved_weight(dense.run, [0]) == 14336 * 4096 * 2  # one MLP projection, frozen bf16
    quantized = _ctx("mistral-7b", {**_LORA, "quantize_base": "nf4"})
    assert largest_saved_weight(quantized.run, [0]) == 0


def test_dense_activations_still_set_the_bring_back() -> None:
    """Mistral 7B at 4,096 tokens: the two tensors the gated MLP's product node saved (act(gate) and up, 235 MB)
    outweigh a projection's weight (at 2,048 tokens they weigh as much as it)."""
    ctx = _ctx("mistral-7b", {**_LORA, "seq": 4096})
    acts = stage_activations(ctx, walk_layers(ctx, 0), None)
    assert acts.bring_back == largest_saved_term(ctx.run, list(ctx.layout.layer_indices)) > 14336 * 4096 * 2
    assert NOTE not in acts.notes


def test_checkpointed_lora_holds_the_embedding_leaf() -> None:
    """enable_input_require_grads (frozen embedding, checkpointing) makes the embedding's output a leaf that
    AccumulateGrad holds: one bf16 hidden state per micro-batch (the trace's aten.embedding output); none when
    the layers are not checkpointed or the embedding trains."""
    flags = {**_LORA, "seq": 2048, "mbs": 2, "recompute": "full"}
    assert input_leaf_bytes(_ctx("mistral-7b", flags)) == 2048 * 2 * 4096 * 2
    assert input_leaf_bytes(_ctx("mistral-7b", {**flags, "recompute": "none"})) == 0
    assert input_leaf_bytes(_ctx("mistral-7b", {**flags, "modules_to_save": "embed_tokens"})) == 0
