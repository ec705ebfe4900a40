"""Fully trained weights autocast never casts (memplan.estimate.partial_freeze.uncast_trained_numel; helper bw15,
session 15): a trained norm's weight and an untied embedding table get no 16-bit copy (``F.embedding`` and the norms'
products are not on torch.autocast's lower-precision list), so nothing of theirs is cached or saved."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.job import FineTuning
from memplan.estimate.partial_freeze import uncast_trained_numel
from tests.estimate.test_grouped_experts_walk import _estimate
from tests.estimate.test_made_gradients import _COMMON, _LLAMA
from tests.trace.test_agreement_grid import CONFIGS

_GPT_OSS = {**_COMMON, **CONFIGS["gpt_oss"]}


@pytest.mark.parametrize("config, flags, traced, before", [
    # the embedding table (2,048 x 256) and the norm weight counted as autocast copies: +1,049,088 B at the loss
    (_GPT_OSS, {"trainable": "embed_tokens,layers.1.input_layernorm"}, 51_781_632, 0.02108),
    (_LLAMA, {"trainable": "embed_tokens,layers.1", "seq": 1024}, 352_389_632, -0.00670),
])
def test_a_trained_embedding_and_norm_have_no_autocast_copy(tmp_path: Path, config: dict[str, object],
                                                            flags: dict[str, object], traced: int,
                                                            before: float) -> None:
    """memplan trace (bf16-mixed, eager, 256 tokens x 2 unless said, AdamW foreach); ``before``: the error at 83e1fcf
    (the Llama cell's also lacked its softmax backward's gradients: tests/estimate/test_made_gradients.py)."""
    peak = _estimate(tmp_path, config, **{"seq": 256, "attention": "eager", **flags})
    assert abs(peak / traced - 1) <= 0.001


def test_a_tied_table_is_the_heads_weight(tmp_path: Path) -> None:
    """A tied embedding table is the head's weight: the head's linear casts it (counted), the norms are not."""
    import json

    from memplan.model.hf import load_hf_config

    for tied in (False, True):
        path = tmp_path / f"tied{tied}.json"
        path.write_text(json.dumps({**_LLAMA, "tie_word_embeddings": tied}), encoding="utf-8")
        model = load_hf_config(path)
        numel = uncast_trained_numel(model, FineTuning(trainable="embed_tokens,norm"), (0, 1), True, True)
        assert numel == (0 if tied else 2048 * 256) + 256
