"""Tensor parallelism in the reserved-memory schedule (issue 25, item 8), pinned to a trace.

Hugging Face's TP plan splits each decoder layer's linear weights over the ranks, keeps the norms and the
embedding whole and gathers the head's output, so every rank's loss holds whole-vocabulary logits and the
embedding's gradient and moments are vocabulary-sized. A memplan trace of a small tied Llama under TP 2
allocates exactly that; the schedule's tensors must have the same sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_reserved_mechanics import _ctx, _schedule

from memplan.estimate.context import StageContext
from memplan.estimate.reserved_tp import rank_numel
from memplan.model.linears import ParamTensor, model_parameters

_CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 512,
           "tie_word_embeddings": True}
_FLAGS = {"seq": 128, "precision": "bf16-mixed", "attention": "sdpa", "tp": 2, "framework": "hf"}


def _traced(config: str) -> dict[str, int]:
    """Bytes of the trace's log-softmax output and the embedding's gradient (one TP rank)."""
    pytest.importorskip("transformers")
    from memplan.trace import trace

    result = trace(config, **_FLAGS, recompute="none", optimizer="adamw", device="cuda", iterations=1)
    events = [tuple(e) for e in result.trace.events]
    softmax = next(e[3] for e in events if e[7] == "aten._log_softmax.default")
    gradient = next(e[3] for e in events if e[4] == "gradient" and e[8] == "model.embed_tokens")
    return {"log_softmax": softmax, "embedding_gradient": gradient}


def test_hf_tp_keeps_the_vocabulary_whole_on_every_rank(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_CONFIG), encoding="utf-8")
    traced = _traced(str(config))
    vocab, hidden, seq = _CONFIG["vocab_size"], _CONFIG["hidden_size"], _FLAGS["seq"]
    assert traced == {"log_softmax": seq * vocab * 4, "embedding_gradient": vocab * hidden * 4}

    events = _schedule(str(config), {**_FLAGS, "gpus": 2})
    forward = max(i for i, e in enumerate(events) if e == ("moment", "forward"))
    # the loss: the 16-bit logits, their fp32 upcast and the log-softmax, each of the whole vocabulary
    assert events[forward + 1:forward + 4] == [("take", seq * vocab * 2), ("take", traced["log_softmax"]),
                                               ("take", traced["log_softmax"])]
    assert ("take", traced["embedding_gradient"]) in events[forward:]


def _rank(ctx: StageContext, tensor: ParamTensor) -> int:
    """rank_numel for the stage's model, framework profile and TP degree."""
    run = ctx.run
    return rank_numel(run.model, run.profile, run.job.parallel.tp, tensor)


def test_rank_numel_splits_the_layers_linears_and_keeps_norms_whole() -> None:
    hf = _ctx("llama-3.2-1b", {"seq": 1024, "tp": 2, "gpus": 2, "framework": "hf"})
    megatron = _ctx("llama-3.2-1b", {"seq": 1024, "tp": 2, "gpus": 2, "framework": "megatron"})
    single = _ctx("llama-3.2-1b", {"seq": 1024, "framework": "hf"})
    tensors = {t.name: t for t in model_parameters(hf.run.model)}
    q, norm = tensors["model.layers.0.self_attn.q_proj.weight"], tensors["model.layers.0.input_layernorm.weight"]
    embedding = tensors["model.embed_tokens.weight"]
    assert _rank(hf, q) == q.numel // 2 and _rank(hf, norm) == norm.numel
    assert _rank(hf, embedding) == embedding.numel  # Hugging Face's plan: the embedding whole
    assert _rank(megatron, embedding) == embedding.numel // 2  # vocabulary-parallel
    assert all(_rank(single, t) == t.numel for t in tensors.values())
