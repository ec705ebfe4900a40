"""DoRA's forward temporaries at an adapted linear (:func:`memplan.estimate.adapter_acts.dora_forward_transient`)
against what a trace holds there."""

from __future__ import annotations

from memplan.estimate.adapter_acts import dora_forward_transient, dora_output_backward
from memplan.model.linears import LinearModule
from memplan.peft.params import Adapter

#: The agreement grid's llama_wide toy: down_proj 2048 -> 256, rank 8, seq 64 x 2 under bf16-mixed.
DOWN = Adapter(module=LinearModule("model.layers.0.mlp.down_proj", 2048, 256, layer=0), rank=8, dora=True)
TOKENS = 128


def test_weight_rebuild_sits_beside_the_input_cast_to_the_adapters_dtype() -> None:
    # a trace at lora_B's output in the recomputed down_proj: the fp32 input cast (1,048,576), the fp32 identity
    # (16,777,216) and its bf16 copy (8,388,608), autocast's copies of lora_A (32,768) and lora_B (4,096),
    # lora_A's output (32,768) and lora_B's (1,048,576)
    held = 1_048_576 + 16_777_216 + 8_388_608 + 32_768 + 4_096 + 32_768 + 1_048_576
    assert dora_forward_transient((DOWN,), autocast=True, compute_bytes=2, base_bytes=2, tokens=TOKENS) == held
    # adapters in the input's dtype: no cast; without autocast no copies (lora_A's output in the adapters' dtype)
    plain = dora_forward_transient((DOWN,), autocast=False, compute_bytes=4, base_bytes=4, tokens=TOKENS,
                                   adapter_bytes=4)
    # the norm's stage: identity, lora_A's output of it (lora_B's graph keeps it: a trace of the llama_1k_v256 toy in
    # fp32 and in pure bf16 holds it there, helper bw15), product, the two fp32 sums
    assert plain == 16_777_216 + 2048 * 8 * 4 + 3 * 2048 * 256 * 4
    # LoRA adapters (no magnitude vector) rebuild nothing
    lora = Adapter(module=DOWN.module, rank=8, dora=False)
    assert dora_forward_transient((lora,), autocast=True, compute_bytes=2, base_bytes=2, tokens=TOKENS) == 0


def test_last_linear_output_backward_before_the_recompute() -> None:
    """The llama toy's recomputed layer 1 (512 tokens, hidden 256, DoRA on all linears, bf16-mixed): before its
    recompute starts, the trace holds down_proj's output gradient in fp32 (524,288), its bf16 cast for the base
    result (262,144) and the product by scaling (524,288)."""
    down = Adapter(module=LinearModule("model.layers.1.mlp.down_proj", 768, 256, layer=1), rank=8, dora=True)
    assert dora_output_backward((down,), last_linear="mlp.down_proj", tokens=512, compute_bytes=2) == 1_310_720
    # adapters in the compute dtype: the casts are no-ops, the product alone
    assert dora_output_backward((down,), last_linear="mlp.down_proj", tokens=512, compute_bytes=4,
                                adapter_bytes=4) == 524_288
    # not the layer's last linear, or LoRA: nothing before the recompute
    assert dora_output_backward((down,), last_linear="mlp.up_proj", tokens=512, compute_bytes=2) == 0
    lora = Adapter(module=down.module, rank=8, dora=False)
    assert dora_output_backward((lora,), last_linear="mlp.down_proj", tokens=512, compute_bytes=2) == 0
