"""The frozen embedding's output as a leaf under Hugging Face checkpointing (memplan.estimate.input_leaf): kept apart
from the checkpointed inputs only where the model makes the first layer's input a new tensor."""

from __future__ import annotations

from memplan.estimate.input_leaf import NOTE, input_leaf_bytes, leaf_apart_bytes
from tests.estimate.test_reserved_mechanics import _ctx

_LORA = {"seq": 1024, "mbs": 1, "precision": "bf16-mixed", "framework": "hf", "peft": "lora", "recompute": "full"}
_GPT2 = {**_LORA, "lora_targets": "c_attn"}


def test_gpt2_adds_position_embeddings() -> None:
    """GPT-2's first layer reads inputs_embeds + position_embeds: the leaf (bf16 frozen base) is one more tensor."""
    ctx = _ctx("gpt2-xl", _GPT2)
    assert leaf_apart_bytes(ctx) == input_leaf_bytes(ctx) == 1024 * 1600 * 2


def test_llama_feeds_the_leaf_itself() -> None:
    """Llama's first layer reads the embedding's output itself: its checkpointed input is the leaf."""
    ctx = _ctx("mistral-7b", _LORA)
    assert input_leaf_bytes(ctx) == 1024 * 4096 * 2
    assert leaf_apart_bytes(ctx) == 0


def test_no_leaf_without_checkpointing_or_with_a_trained_embedding() -> None:
    assert leaf_apart_bytes(_ctx("gpt2-xl", {**_GPT2, "recompute": "none"})) == 0
    assert leaf_apart_bytes(_ctx("gpt2-xl", {**_GPT2, "peft": "none", "lora_targets": "auto"})) == 0


def test_the_note_says_so() -> None:
    from memplan.estimate.engine import estimate
    from memplan.inputs import JobRequest, load_job

    loaded = load_job(JobRequest(model="gpt2-xl", flags=_GPT2))
    assert NOTE in estimate(loaded.model, loaded.job).assumptions
