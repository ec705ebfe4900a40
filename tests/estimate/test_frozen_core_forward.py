"""Partial freezing with an attention output projection trained alone (helper bw16, session 16): the block saves its
projection's input only, its eager core's softmax backward does not run, and the core's forward moment (the s x s
scores, their fp32 copy and the probabilities, with what the modeling code binds there) sets the peak
(memplan.estimate.frozen_core_forward; memplan.estimate.partial_freeze.BlockFlow.output_linear_only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan import load_model
from memplan.estimate import estimate
from memplan.jobflags import build_job

#: The agreement grid's Llama toy (tests/trace/test_agreement_grid.py).
_TOY = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 2048, "tie_word_embeddings": False, "max_position_embeddings": 1024,
        "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6}
_JOB = {"seq": 1024, "mbs": 2, "precision": "bf16-mixed", "attention": "eager", "recompute": "none",
        "optimizer": "adamw", "optimizer_impl": "foreach", "framework": "hf", "device": "cuda"}
_O_AND_MLP = "layers.1.self_attn.o_proj,layers.1.mlp"


def _peak(tmp_path: Path, family: str, **flags: object) -> int:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": family, **_TOY}), encoding="utf-8")
    stage = estimate(load_model(str(path)), build_job({**_JOB, **flags})).stages[0]
    return stage.peak_allocated_bytes - stage.workspace_bytes


@pytest.mark.parametrize("family, flags, traced, before", [
    # peak at layer 1's _softmax in the forward: masked scores (32 MiB), their fp32 copy and the probabilities (64 MiB
    # each), q, k, v and repeat_kv's copies, the layer's input, the norm's output, the 4-D mask, RoPE's tables
    ("llama", {"trainable": _O_AND_MLP}, 190_623_232, 0.14847),
    ("qwen2", {"trainable": _O_AND_MLP}, 190_626_304, 0.14846),
    ("llama", {"trainable": "layers.1.self_attn.o_proj"}, 184_724_992, 0.14044),
    # sdpa (peak in the backward): the frozen post-attention norm keeps no 16-bit normalized tensor
    ("llama", {"trainable": _O_AND_MLP, "attention": "sdpa"}, 82_104_832, 0.04867),
])
def test_an_output_projection_trained_alone_matches_the_trace(tmp_path: Path, family: str, flags: dict[str, object],
                                                              traced: int, before: float) -> None:
    """memplan trace (fake tensors, ``--device cuda``, 2 iterations, AdamW foreach); ``before``: the error at
    23de8e3."""
    assert abs(_peak(tmp_path, family, **flags) / traced - 1) <= 0.0005


def test_the_output_projection_alone_saves_its_input_only(tmp_path: Path) -> None:
    """The attention block's terms under the flow of ``--trainable layers.1.self_attn.o_proj`` (its input needs no
    gradient): the output projection's input alone; any other trained linear makes the q, k and v need one."""
    from memplan.estimate.activations import ActivationShape, layer_terms_by_block
    from memplan.estimate.partial_freeze import BlockFlow, block_terms
    from memplan.estimate.terms import TermRole

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **_TOY}), encoding="utf-8")
    layer = load_model(str(path)).layers[1]
    shape = ActivationShape(seq=1024, kv_seq=1024, micro_batch=2, hidden=256, tp=1, sequence_parallel=False,
                            act_bytes=2, residual_bytes=2, attention="eager", dropout=False, kernels="eager")
    attention, _ = layer_terms_by_block(layer, shape)
    alone = BlockFlow(input_grad=False, linears_train=True, norm_trains=False, output_linear_only=True)
    assert [t.role for t in block_terms(attention, shape, alone)] == [TermRole.OUTPUT_PROJECTION_INPUT]
    assert not alone.inner_grad
    assert BlockFlow(input_grad=False, linears_train=True, norm_trains=False).inner_grad
