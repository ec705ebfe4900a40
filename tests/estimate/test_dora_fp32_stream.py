"""Where DoRA's fp32 result starts the fp32 stream on a quantized base (:mod:`memplan.estimate.dora_fp32_stream`)."""

from __future__ import annotations

from memplan.estimate.dora_fp32_stream import adapter_input_bytes, fp32_start
from memplan.estimate.dora_fp32_stream import fp32_blocks as _fp32_blocks
from memplan.model.linears import LinearModule
from memplan.peft.params import Adapter


def _adapter(name: str, dora: bool = True) -> Adapter:
    return Adapter(module=LinearModule(name=name, in_features=8, out_features=8, layer=int(name.split(".")[2]),
                                       bias=False), rank=2, dora=dora)


def fp32_blocks(layers: tuple[tuple[Adapter, ...], ...], index: int) -> tuple[bool, bool]:
    return _fp32_blocks(layers, index, fp32_start(layers))


def test_the_stream_is_fp32_after_the_first_dora_adapter() -> None:
    down = (_adapter("model.layers.0.mlp.down_proj"),)
    layers = (down, (), ())
    assert [fp32_blocks(layers, i) for i in range(3)] == [(False, False), (True, True), (True, True)]
    o = (_adapter("model.layers.1.self_attn.o_proj"),)
    # DoRA in the attention block: that layer's MLP block already reads the fp32 residual
    assert [fp32_blocks(((), o, ()), i) for i in range(3)] == [(False, False), (False, True), (True, True)]
    # on q/k/v the attention kernel (an autocast op) reads the fp32 result and returns 16 bits
    q = (_adapter("model.layers.1.self_attn.q_proj"),)
    assert [fp32_blocks(((), q, ()), i) for i in range(3)] == [(False, False)] * 3
    # LoRA's result comes back in the base's dtype
    assert fp32_blocks(((_adapter("model.layers.0.mlp.down_proj", dora=False),), ()), 1) == (False, False)
    assert fp32_start(layers) == 0 and fp32_start(((), q, ())) == 3


def test_the_output_projection_reads_the_16_bit_attention_output() -> None:
    assert adapter_input_bytes(_adapter("model.layers.1.self_attn.o_proj"), (True, True)) == 0
    assert adapter_input_bytes(_adapter("model.layers.1.self_attn.q_proj"), (True, True)) == 4
    assert adapter_input_bytes(_adapter("model.layers.1.self_attn.q_proj"), (False, True)) == 0
    assert adapter_input_bytes(_adapter("model.layers.1.mlp.up_proj"), (False, True)) == 4
