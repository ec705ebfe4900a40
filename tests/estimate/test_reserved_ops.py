"""A dense decoder layer's backward op by op in the reserved-memory schedule (issue 25, item 8), pinned to a
memplan trace of small Hugging Face models built from config on CPU.

The schedule's gated MLP (:mod:`memplan.estimate.reserved_mlp_backward`), eager attention core
(:mod:`memplan.estimate.reserved_attention_backward`) and recomputed layers
(:mod:`memplan.estimate.reserved_recompute`) make and free the tensors of the sizes that only those ops
allocate (the MLP's weight gradients, its intermediate-sized tensors, the 16-bit and fp32 attention scores)
in the order the trace allocates and frees them, over the whole backward of the second step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_reserved_mechanics import _scheduled_backward, _traced_backward

from memplan import estimate, load_model
from memplan.estimate.engine import _stages
from memplan.jobflags import build_job

_SEQ, _HIDDEN, _INTER, _HEADS = 192, 256, 1280, 8
_LLAMA = {"model_type": "llama", "hidden_size": _HIDDEN, "intermediate_size": _INTER, "num_attention_heads": _HEADS,
          "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
          "tie_word_embeddings": False}
_GEMMA2 = {"model_type": "gemma2", "hidden_size": _HIDDEN, "intermediate_size": _INTER, "num_attention_heads": _HEADS,
           "num_key_value_heads": 2, "head_dim": _HIDDEN // _HEADS, "num_hidden_layers": 2, "vocab_size": 1000,
           "max_position_embeddings": 512, "query_pre_attn_scalar": _HIDDEN // _HEADS, "sliding_window": 4096,
           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True}
_FLAGS = {"seq": _SEQ, "precision": "bf16", "attention": "eager", "framework": "hf"}
#: Sizes only these ops allocate: an MLP weight's gradient, an intermediate-sized tensor, 16-bit and fp32 scores.
_NAMES = {_HIDDEN * _INTER * 2: "W", _SEQ * _INTER * 2: "a", _HEADS * _SEQ * _SEQ * 2: "s", _HEADS * _SEQ * _SEQ * 4: "F"}


@pytest.mark.parametrize(("model", "recompute"), [("llama", "none"), ("llama", "full"), ("gemma2", "none"),
                                                  ("gemma2", "full")])
def test_a_dense_layers_backward_frees_and_makes_as_its_trace(tmp_path: Path, model: str, recompute: str) -> None:
    """Per layer: the down, up and gate projections' weight gradients each made between the frees of their
    op's tensors, the softmax backward's fp32 upcast beside the saved fp32 softmax output (Gemma 2: the
    soft cap's tanh chain around it); under full recompute the layer's forward first, temporaries included.
    The schedule used to make the layer's gradients at once and free its tensors after."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_LLAMA if model == "llama" else _GEMMA2), encoding="utf-8")
    flags = {**_FLAGS, "recompute": recompute}
    traced = _traced_backward(str(config), flags, _NAMES)
    assert traced.count("+W") == 2 * 3 and "+F" in traced
    assert _scheduled_backward(str(config), flags, _NAMES) == traced


def test_the_op_by_op_plans_are_explained_and_stay_off_where_they_do_not_apply(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_LLAMA), encoding="utf-8")
    for flags, applies in (({**_FLAGS}, True), ({**_FLAGS, "recompute": "full"}, True),
                           ({**_FLAGS, "attention": "sdpa"}, False), ({**_FLAGS, "gpus": 2, "tp": 2}, False)):
        _stages.cache_clear()
        est = estimate(load_model(str(config)), build_job(flags), reserved="simulated")
        assert any("op by op" in a for a in est.assumptions) == applies, flags
