"""The reserved-memory schedule's autocast cache and block recompute (issue 25, item 8), pinned to a trace.

torch.autocast caches the 16-bit copy of every fp32 weight that requires a gradient until the outermost
autocast region exits; a checkpointed region saves none of them, so the cache alone holds them from the
layer's forward to the end of the loss's forward. A memplan trace of a small Llama under torchtitan's
per-op SAC shows exactly that, and the schedule must make and free the same copies at the same places.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_reserved_mechanics import _ctx, _schedule

from memplan.estimate.reserved_autocast import layer_cached_copies
from memplan.estimate.reserved_forward import layer_blocks
from memplan.estimate.reserved_terms import DROPPED, KEPT

_CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 512,
           "tie_word_embeddings": False}
_FLAGS = {"seq": 128, "precision": "bf16-mixed", "attention": "sdpa", "recompute": "selective",
          "framework": "torchtitan"}


def _traced_cache(config: str) -> tuple[list[tuple[int, int]], int, int, int]:
    """(layer, bytes) of the weight copies the trace's forward makes and frees only after the loss's
    log-softmax, the log-softmax's event index, the last such free's, and the first backward event's."""
    pytest.importorskip("transformers")
    from memplan.trace import trace

    result = trace(config, **{k: v for k, v in _FLAGS.items()}, optimizer="adamw", device="cuda", iterations=1)
    events = [tuple(e) for e in result.trace.events]
    softmax = next(e[0] for e in events if e[7] == "aten._log_softmax.default")
    backward = next(e[0] for e in events if e[5] == "backward")
    made: dict[int, tuple] = {}
    cached, last = [], 0
    for e in events:
        if e[1] == "alloc":
            made[e[2]] = e
            continue
        a = made.pop(e[2], None)
        if a and a[7] == "aten._to_copy.default" and a[8].endswith("_proj") and a[0] < softmax < e[0]:
            cached.append((int(a[8].split(".")[2]), a[3]))
            last = max(last, e[0])
    return cached, softmax, last, backward


def test_checkpointed_layers_weight_copies_live_in_autocasts_cache_until_the_loss(tmp_path: Path) -> None:
    """Trace: every linear's 16-bit weight copy (7 per layer) is made in its layer's forward and freed after
    the loss's log-softmax, before the first backward event. Schedule: the same copies, made in each layer's
    forward, freed right after the loss's fp32 upcast and before its gradients."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_CONFIG), encoding="utf-8")
    cached, softmax, last, backward = _traced_cache(str(config))
    assert len(cached) == 7 * _CONFIG["num_hidden_layers"] and softmax < last < backward

    ctx = _ctx(str(config), _FLAGS)
    layers = list(ctx.layout.layer_indices)
    total = sum(size for _, size in cached)
    planned = layer_cached_copies(ctx, layers, total, None)
    assert [sorted(p) for p in planned] == [sorted(s for i, s in cached if i == layer) for layer in layers]
    assert layer_cached_copies(ctx, layers, total + 1, None) == [[], []]  # not the estimate's cache: not laid out

    events = _schedule(str(config), _FLAGS)
    forward = max(i for i, e in enumerate(events) if e == ("moment", "forward"))
    loss = max(i for i, e in enumerate(events) if e == ("moment", "loss"))
    gives = [i for i in range(forward, loss) if events[i][0] == "give"]
    upcast = gives[0]  # the fp32 upcast, freed once the log-softmax is made
    freed = events[upcast + 1:upcast + 1 + len(cached)]
    assert sorted(size for _, size in freed) == sorted(size for _, size in cached)
    assert all(e[0] == "take" for e in events[upcast + 2 + len(cached):loss])  # then the 16-bit logits, the grads


def test_layers_left_out_of_block_recompute_keep_their_split_tensors() -> None:
    """Megatron's block method recomputes the first N layers; the others save what they save without
    recompute, so the schedule lays their tensors out as a plain job's layer (the terms split), not as one
    block; a recomputed layer keeps its input and makes the rest in the forward and frees it."""
    flags = {"seq": 1024, "precision": "bf16-mixed", "recompute": "full", "recompute_method": "block",
             "recompute_layers": 4, "framework": "hf"}
    ctx, plain = _ctx("llama-3.2-1b", flags), _ctx("llama-3.2-1b", {**flags, "recompute": "none"})
    assert 0 in ctx.recomputed and 10 not in ctx.recomputed
    from memplan.estimate.layer_costs import layer_costs

    full = layer_costs(ctx.run, ctx.run.model.layers[10], 10)[1]
    blocks = layer_blocks(ctx, 10, full)
    assert blocks == layer_blocks(plain, 10, full) and len(blocks) > 10
    assert sum(size for size, kind, _ in blocks if kind == KEPT) == full
    kept = layer_costs(ctx.run, ctx.run.model.layers[0], 0)[0]
    again = layer_blocks(ctx, 0, kept)
    assert any(kind == DROPPED for _, kind, _ in again)
