"""``memplan trace`` runs the HF Trainer's forward under ``torch.autocast`` also at ``--precision bf16`` / ``fp16``
(the model loaded in that dtype): accelerate's ``native_amp`` follows the trainer's ``--bf16`` / ``--fp16``, and
``prepare_model`` wraps the forward in autocast (``TraceSetup.autocast``). CUDA autocast runs ``layer_norm`` in fp32,
so GPT-2's LayerNorms return fp32 from bf16 inputs; DeepSpeed's engine applies no autocast (the control)."""

from __future__ import annotations

import json

import pytest

from memplan.trace import trace

_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 4, "vocab_size": 128, "n_positions": 256}
_TOKENS, _HIDDEN = 2 * 64, 64


def _layer_norm_outputs(tmp_path, framework: str, precision: str) -> list[int]:
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(_GPT2), encoding="utf-8")
    result = trace(str(path), framework=framework, precision=precision, seq=64, mbs=2, attention="eager",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=1)
    return [e.size for e in result.trace.events if e.kind == "alloc" and e.phase == "forward"
            and e.op == "aten.native_layer_norm.default" and e.size >= _TOKENS * _HIDDEN]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_hf_pure_16_bit_runs_layer_norm_in_fp32(tmp_path, precision: str) -> None:
    sizes = _layer_norm_outputs(tmp_path, "hf", precision)
    assert sizes and set(sizes) == {4 * _TOKENS * _HIDDEN}  # ln_1, ln_2, ln_f: fp32 outputs


def test_deepspeed_pure_bf16_keeps_layer_norm_in_bf16(tmp_path) -> None:
    sizes = _layer_norm_outputs(tmp_path, "deepspeed", "bf16")
    assert sizes and set(sizes) == {2 * _TOKENS * _HIDDEN}
