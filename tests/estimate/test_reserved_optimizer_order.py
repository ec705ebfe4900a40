"""The order in which the reserved-memory schedule makes the optimizer's states and a foreach step's temporaries
(memplan.estimate.reserved_sizes.piece_sizes): torch.optim makes them lazily in the first ``step()``, tensor by
tensor in its param groups' order (``Adam._init_group``; ``_multi_tensor_adam`` runs its foreach ops over the same
lists), which is ``model.parameters()``' order: the embedding, the decoder layers, then the final norm and the
head. The schedule made the root unit's (embedding and head) first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.estimate.reserved_sizes import in_parameter_order, parameter_lead, piece_sizes
from memplan.estimate.reserved_trainable import trainable_lead, trainable_units
from tests.estimate.test_reserved_mechanics import _ctx, _schedule

MiB = 2**20
#: A small untied Llama whose embedding's and head's states (32 MiB each) and linear layers' (2 to 8 MiB) are
#: above the caching allocator's small-pool limit (1 MiB, ``kSmallSize`` in c10/cuda/CUDACachingAllocator.cpp):
#: the states that share the large segments. The norms' (4 KiB) are left out.
_TOY = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8,
        "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 8192, "tie_word_embeddings": False}
_FLAGS = {"seq": 128, "mbs": 1, "precision": "bf16-mixed", "attention": "sdpa", "optimizer_impl": "foreach"}


def _traced_states(config: str, flags: dict[str, object]) -> list[int]:
    """The first step's optimizer states above 1 MiB, in the order a memplan trace (AdamW) allocates them."""
    pytest.importorskip("transformers")
    from memplan.trace import trace

    result = trace(config, **flags, optimizer="adamw", device="cuda", iterations=2)  # type: ignore[arg-type]
    return [e.size for e in result.trace.events
            if e.kind == "alloc" and e.iteration == 0 and e.category == "optimizer_state" and e.size > MiB]


def _scheduled_states(config: str, flags: dict[str, object]) -> list[int]:
    """What the schedule makes above 1 MiB from its first step's end of the backward on: the states, then the
    step's temporaries."""
    events = _schedule(config, {**flags, "optimizer": "adamw"})
    start = events.index(("moment", "end of backward"))
    return [size for kind, size in events[start:] if kind == "take" and size > MiB]  # type: ignore[operator]


@pytest.mark.parametrize("framework", ["hf", "torchtitan"])
def test_the_states_are_made_in_the_parameters_order(tmp_path: Path, framework: str) -> None:
    """The embedding's two states first, each layer's, the head's last, as the trace makes them; the schedule
    made the embedding's and the head's first (four 32 MiB states, then the layers')."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_TOY), encoding="utf-8")
    flags = {**_FLAGS, "framework": framework}
    traced = _traced_states(str(config), flags)
    vocab = _TOY["vocab_size"] * _TOY["hidden_size"] * 4
    assert traced[:2] == traced[-2:] == [vocab, vocab] and vocab not in traced[2:-2]
    assert _scheduled_states(str(config), flags)[:len(traced)] == traced


def test_the_root_is_split_around_the_layers() -> None:
    assert in_parameter_order([[5, 6, 7], [1], [2]], 1) == [[5], [1], [2], [6, 7]]
    assert in_parameter_order([[5, 6, 7], [1]], None) == [[5, 6, 7], [1]]
    assert in_parameter_order([[], [1]], 1) == [[], [1], []]  # a stage without the root (pipeline)


def test_the_foreach_temporaries_follow_the_states_order() -> None:
    """``_multi_tensor_adam``'s ``_foreach_sqrt`` makes one tensor per ``exp_avg_sq`` in the same order: the
    embedding's, the layers', the head's (units: root = embedding 100, head 60; one layer of 10)."""
    _, states, temps = piece_sizes(2 * 170, 170, 0, ((100, 60), (10,)), 1)
    assert [s for unit in states for s in unit] == [100, 100, 10, 10, 60, 60]
    assert [t for unit in temps for t in unit] == [100, 10, 60]


def test_a_trained_embeddings_states_come_before_the_layers() -> None:
    """Under PEFT the root's trainable tensors keep ``model.parameters()``' order: a ``modules_to_save`` copy
    of the embedding lies inside the embedding, before the layers; the head's copy after them."""
    flags = {"seq": 1024, "framework": "hf", "peft": "lora", "modules_to_save": "embed_tokens,lm_head"}
    ctx = _ctx("qwen2.5-7b", flags)
    units = trainable_units(ctx, list(ctx.layout.layer_indices))
    assert units is not None and trainable_lead(ctx) == 1 and len(units[0]) == 2
    assert trainable_lead(_ctx("qwen2.5-7b", {**flags, "modules_to_save": "lm_head"})) == 0
    assert parameter_lead(_ctx("qwen2.5-7b", {"seq": 1024})) == 1  # embed_tokens
    assert parameter_lead(_ctx("gpt2", {"seq": 1024})) == 2  # wte and wpe
