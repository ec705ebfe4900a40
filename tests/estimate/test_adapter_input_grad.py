"""What an adapter keeps when its input needs no gradient (:func:`~memplan.estimate.adapter_acts.adapter_terms`): the
first layer's attention input projections under a frozen embedding, and in a parallel-residual layer (GPT-NeoX) its
MLP input projections too (``mlp_input_needs_grad``; witnessed by tests/trace/test_parallel_residual_adapters_trace.py)."""

from __future__ import annotations

from memplan.estimate.activations import ActivationShape
from memplan.estimate.adapter_acts import adapter_terms
from memplan.model.linears import LinearModule
from memplan.peft.params import Adapter

SHAPE = ActivationShape(seq=256, kv_seq=256, micro_batch=2, hidden=256, tp=1, sequence_parallel=False, act_bytes=2,
                        residual_bytes=4, attention="eager", dropout=False, kernels="eager")
UP = Adapter(LinearModule("gpt_neox.layers.0.mlp.dense_h_to_4h", 256, 1024, layer=0), 8, True)


def _bytes(mlp_input_needs_grad: bool) -> int:
    terms = adapter_terms((UP,), SHAPE, autocast=True, dropout=True, compute_bytes=2,
                          mlp_input_needs_grad=mlp_input_needs_grad)
    return sum(t.bytes for t in terms)


def test_an_mlp_input_adapter_without_input_gradient_keeps_no_mask_cast_copy_nor_scale() -> None:
    # the trace's layer 0 of the GPT-NeoX toy (DoRA, --lora-dropout 0.1, bf16-mixed, no recompute) keeps no dropout
    # mask (512 x 256 B), no 16-bit cast of the base weight for the dropped-out input (2 x 256 x 1,024 B), no 16-bit
    # lora_A weight copy (2 x 8 x 256 B) and no scale - 1 vector (4 x 1,024 B) for dense_h_to_4h
    assert _bytes(True) - _bytes(False) == 512 * 256 + 2 * 256 * 1024 + 2 * 8 * 256 + 4 * 1024
