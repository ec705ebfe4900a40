"""A parallel-residual layer (GPT-NeoX's ``use_parallel_residual``) feeds its MLP the layer input: in the first layer,
under a frozen embedding and without checkpointing, the MLP input projection's adapter reads an input that needs no
gradient, so autograd keeps neither its dropout mask, nor DoRA's cast of the base weight for the dropped-out input,
nor lora_A's 16-bit weight copy, nor one of DoRA's scale vectors (helper dora15;
:func:`~memplan.estimate.adapter_acts.adapter_terms`' ``mlp_input_needs_grad``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trace.test_lora_recompute_tail_trace import _peak_error


#: Peak allocated at 36c517b: neox dora --lora-dropout 0.1 +1.21% (dense_h_to_4h's mask and weight cast in layer 0,
#: 655,360 B), lora --lora-dropout 0.1 and dora without dropout within 0.02%.
@pytest.mark.parametrize("peft, dropout", [("dora", 0.1), ("lora", 0.1), ("dora", 0.0)])
def test_neox_first_layer_mlp_adapters_without_input_gradient(tmp_path: Path, peft: str, dropout: float) -> None:
    error = _peak_error(tmp_path, "neox", "eager", "none", peft=peft, lora_targets="all-linear", lora_dropout=dropout)
    assert abs(error) <= 0.0005
