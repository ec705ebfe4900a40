"""The locals of peft's LoRA forward on the MLP's output projection where a recomputed layer's forward stops
(:func:`~memplan.estimate.lora_recompute_tail.lora_recompute_tail`; witnessed by tests/trace/test_lora_recompute_tail_trace.py)."""

from __future__ import annotations

from memplan.estimate.activations import Term
from memplan.estimate.lora_recompute_tail import lora_recompute_tail
from memplan.estimate.terms import TermRole
from memplan.model.linears import LinearModule
from memplan.peft.params import Adapter

DOWN = LinearModule("model.layers.1.mlp.down_proj", 768, 256, layer=1)
Q = LinearModule("model.layers.1.self_attn.q_proj", 256, 256, layer=1)
TOKENS, HIDDEN = 512, 256


def _tail(adapters: tuple[Adapter, ...], act_bytes: int = 2, adapter_bytes: int = 4, autocast: bool = True,
          dropout: bool = False) -> int:
    return lora_recompute_tail(adapters, tokens=TOKENS, residual=TOKENS * HIDDEN * 2, mlp_input=TOKENS * HIDDEN * 2,
                               byte_sizes=(act_bytes, adapter_bytes, 2), autocast=autocast, dropout=dropout)


def test_autocast_llama_toy_matches_the_trace() -> None:
    # the trace's extras at lora_B's weight copy (memplan trace, Llama toy, bf16-mixed): the scaling product's
    # gradient, the residual, the MLP input, the projection's input and base result (262,144 each but the input,
    # 786,432) and its fp32 cast (1,572,864); the output gradient is added by the caller
    assert _tail((Adapter(DOWN, 8, False),)) == 4 * 262_144 + 786_432 + 1_572_864


def test_only_an_adapter_on_the_output_projection() -> None:
    assert _tail((Adapter(Q, 8, False),)) == 0
    assert _tail((Adapter(Q, 8, True),)) == 0


def test_dora_autocast_llama_toy_matches_the_trace() -> None:
    # the trace's extras after (mag_norm_scale - 1) * base_result (Llama toy, bf16-mixed, DoRA all-linear) but the
    # output gradient: the head's three tensors, the LoRA locals but the base result (DoRA saves it), the identity's
    # 16-bit copy and lora_A's output of it, lora_weight and the base weight cast to fp32, the fp32 product
    head = 524_288 + 262_144 + 524_288
    locals_ = 262_144 + 262_144 + 786_432 + 1_572_864
    dora = 1_179_648 + 12_288 + 786_432 + 786_432 + 524_288
    assert _tail((Adapter(DOWN, 8, True),)) == head + locals_ + dora


def test_adapters_in_the_activation_dtype_save_the_input_itself() -> None:
    # fp32 everywhere: no cast, lora_A saves x and the MLP input's group is kept: the scaling gradient, the residual
    # and the base result
    size = TOKENS * 256 * 4
    assert _tail((Adapter(DOWN, 8, False),), act_bytes=4, autocast=False) == size + TOKENS * HIDDEN * 2 + size


def test_without_autocast_the_fp32_cast_is_saved_and_the_output_casts_run() -> None:
    # the head: the scaling product's fp32 gradient and the add's 16-bit cast of the output gradient (the fp32 cast
    # of ``result.to(torch_result_dtype)`` is freed once the product's node has read it: traces of the Llama and
    # GPT-NeoX toys at pure bf16, helper neoxft14)
    out = TOKENS * 256
    expected = out * (4 + 2) + TOKENS * HIDDEN * 2 + TOKENS * HIDDEN * 2 + TOKENS * 768 * 2 + out * 2
    assert _tail((Adapter(DOWN, 8, False),), autocast=False) == expected


def test_pure_bf16_neox_toy_peaks_inside_the_input_projection() -> None:
    # GPT-NeoX toy at pure bf16, fp32 adapters (helper neoxft14): the trace's peak is inside dense_h_to_4h's recompute,
    # at lora_B's fp32 output times scaling: the base's bf16 result (1 MiB), the two fp32 tensors (2 MiB each), the
    # MLP input and the attention output (256 KiB each) and the head (the scaling product's fp32 gradient and the
    # add's bf16 cast), before gelu's saved input (1 MiB) and dense_4h_to_h's lora_A fp32 input (2 MiB) and output
    # exist; the stop (2,621,440 B) is lower
    up = Adapter(LinearModule("gpt_neox.layers.1.mlp.dense_h_to_4h", 256, 1024, layer=1), 8, False)
    down = Adapter(LinearModule("gpt_neox.layers.1.mlp.dense_4h_to_h", 1024, 256, layer=1), 8, False)
    terms = [Term("mlp fc1 output (activation input)", TOKENS * 1024 * 2, "tp", "body", role=TermRole.MLP_FC1),
             Term("dense_4h_to_h lora_A input", TOKENS * 1024 * 4, "rep", "body", role=TermRole.MLP_FC2_ADAPTER_INPUT)]
    tail = lora_recompute_tail((up, down), tokens=TOKENS, residual=TOKENS * HIDDEN * 2, mlp_input=TOKENS * HIDDEN * 2,
                               byte_sizes=(2, 4, 2), autocast=False, mlp_terms=terms)
    head = TOKENS * 256 * (4 + 2)
    assert tail == head + 2 * TOKENS * HIDDEN * 2 + TOKENS * 1024 * (2 + 4 + 4) - TOKENS * (8 * 4 + 1024 * 6)
    assert tail == 3_391_488


def test_fp32_dora_llama_toy_peaks_at_the_weight_norm_step() -> None:
    # Llama toy at fp32, DoRA all-linear (helper dora14): the trace's peak is the recompute's `weight + scaling *
    # lora_weight` in down_proj's DoRA forward (event 3080): the head (the scaling product's gradient, 524,288), the
    # fp32 identity lora_A keeps (2,359,296), lora_A's output of it (24,576), lora_weight, the scaled copy and the sum
    # (786,432 each), before lora_A's output of x and lora_result (16,384 + 524,288: saved tensors not made yet);
    # the residual's partial sum is the MLP pre-norm's saved input (the caller passes 0). The stop is 507,904 B lower.
    tail = lora_recompute_tail((Adapter(DOWN, 8, True),), tokens=TOKENS, residual=0, mlp_input=TOKENS * HIDDEN * 4,
                               byte_sizes=(4, 4, 4), autocast=False)
    assert tail == 524_288 + 2_359_296 + 24_576 + 3 * 786_432 - (16_384 + 524_288)


def test_pure_bf16_dora_llama_toy_peaks_at_the_weight_norm_step() -> None:
    # the same moment at pure bf16, fp32 adapters (event 3613): the head (the fp32 output gradient, its bf16 cast and
    # the scaling product's: 1,310,720), the residual and the MLP input (262,144 each), down_proj's bf16 input
    # (786,432; peft's fp32 cast of it is lora_A's saved input), the identity and lora_A's output of it, lora_weight
    # and the base weight cast to fp32, the scaled copy and the sum
    tail = lora_recompute_tail((Adapter(DOWN, 8, True),), tokens=TOKENS, residual=TOKENS * HIDDEN * 2,
                               mlp_input=TOKENS * HIDDEN * 2, byte_sizes=(2, 4, 2), autocast=False)
    assert tail == (1_310_720 + 2 * 262_144 + 786_432 + 2_359_296 + 24_576 + 4 * 786_432
                    - (16_384 + 524_288))


def test_lora_dropout_autocast_llama_toy_peaks_at_lora_a() -> None:
    # the trace's extras at down_proj's lora_A matmul (memplan trace, Llama toy, bf16-mixed, --lora-dropout 0.1, event
    # 2568) but the output gradient: the scaling product's gradient, the residual, the MLP input, the base result
    # (262,144 each), the projection's input (786,432), its fp32 cast and the dropout's fp32 output (1,572,864 each);
    # lora_B's 16-bit weight copy (4,096) not made yet
    assert _tail((Adapter(DOWN, 8, False),), dropout=True) == 4 * 262_144 + 786_432 + 2 * 1_572_864 - 4_096


def test_dora_dropout_autocast_llama_toy_peaks_at_the_dropped_out_base_product() -> None:
    # the trace's extras at F.linear(dropout(x), weight) in down_proj's DoRA forward (Llama toy, bf16-mixed,
    # --lora-dropout 0.1, event 4763) but the output gradient: the head's three tensors; the residual, the MLP input,
    # the projection's input, its fp32 cast, the base layer's own result, the dropout's fp32 output; the identity's
    # 16-bit copy and lora_A's output of it, lora_weight and the base weight cast to fp32, autocast's 16-bit copy of
    # the dropped-out input for the linear
    head = 524_288 + 262_144 + 524_288
    locals_ = 262_144 + 262_144 + 786_432 + 1_572_864 + 262_144 + 1_572_864
    dora = 1_179_648 + 12_288 + 786_432 + 786_432 + 786_432
    assert _tail((Adapter(DOWN, 8, True),), dropout=True) == head + locals_ + dora


def test_an_fp32_input_under_autocast_is_unsaved_without_a_cast() -> None:
    # GPT-2's c_proj under autocast reads gelu_new's fp32 output (the GELU_NEW term: three fp32 tensors): peft's cast to
    # the fp32 adapters is a no-op and lora_A saves a 16-bit copy, so the input (fp32) is the one unsaved tensor of it
    c_proj = LinearModule("transformer.h.1.mlp.c_proj", 768, 256, layer=1)
    gelu = Term("mlp gelu_new intermediates", 12 * TOKENS * 768, "rep", "body", role=TermRole.GELU_NEW, tensors=3)
    fp32_input = lora_recompute_tail((Adapter(c_proj, 8, False),), tokens=TOKENS, residual=0, mlp_input=0,
                                     byte_sizes=(2, 4, 2), autocast=True, mlp_terms=[gelu])
    plain = lora_recompute_tail((Adapter(c_proj, 8, False),), tokens=TOKENS, residual=0, mlp_input=0,
                                byte_sizes=(2, 4, 2), autocast=True)
    # the 16-bit input and its fp32 cast, against the fp32 input alone
    assert plain - fp32_input == TOKENS * 768 * (2 + 4) - TOKENS * 768 * 4


def test_dora_on_the_fp32_stream_of_a_quantized_base_matches_the_trace() -> None:
    # memplan trace, Llama toy, bf16-mixed, DoRA all-linear on nf4, full, layer 1 at its peak (event 4373,
    # (mag_norm_scale - 1) * base_result): the MLP's fp32 product down_proj reads (1,572,864, unsaved: lora_A saves
    # its 16-bit copy), the fp32 norm output (524,288), the head: the product by scaling's fp32 gradient alone (peft's
    # bnb layer returns the fp32 sum uncast), the identity's 16-bit copy and lora_A's output of it, lora_weight and the
    # dequantized weight cast to fp32 (786,432 each), the fp32 product; the residual is the MLP norm's saved input
    adapters = (Adapter(DOWN, 8, True),)
    trace = 1_572_864 + 524_288 + 524_288 + 1_179_648 + 12_288 + 2 * 786_432 + 524_288
    kwargs = {"tokens": TOKENS, "residual": 0, "mlp_input": TOKENS * HIDDEN * 4, "byte_sizes": (2, 4, 2),
              "autocast": True, "fp32_input": True}
    assert lora_recompute_tail(adapters, **kwargs) == trace  # type: ignore[arg-type]
    # an 8-bit base keeps the fp32 input and the MLP's input (MatMul8bitLt's ctx.tensors)
    assert lora_recompute_tail(adapters, base_keeps_input=True, **kwargs) == trace - 1_572_864 - 524_288  # type: ignore[arg-type]
    # LoRA's tail on the fp32 stream is not priced
    assert lora_recompute_tail((Adapter(DOWN, 8, False),), **kwargs) == 0  # type: ignore[arg-type]
