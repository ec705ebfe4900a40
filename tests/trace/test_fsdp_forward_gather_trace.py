"""``memplan trace --fsdp``: the communication category at its highest is a copy-out in the forward, where torch 2.13
``FSDPParamGroup.wait_for_unshard`` still holds the previous unit's all-gather output beside the unit's output and
its unsharded parameters; the estimate prices that moment (memplan.estimate.fsdp_forward_gather,
tests/estimate/test_fsdp_forward_gather.py). A tied head: one unit (the root) holds the embedding, final norm and
head, kept unsharded after its forward, so the first block's copy-out holds it twice (its output parked) where the
vocabulary is large, a later block's three blocks beside it where it is small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY
from tests.estimate.test_hf_fsdp_policy import FLAGS


@pytest.mark.parametrize(("vocab", "traced"), [(2048, 5_574_144), (8192, 11_406_336)])
def test_tied_toy_communication_at_its_highest(tmp_path: Path, vocab: int, traced: int) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_TOY, "tie_word_embeddings": True, "vocab_size": vocab}), encoding="utf-8")
    result = trace(str(path), device="cuda", iterations=2, framework="hf", recompute="none", **FLAGS)
    row = compare_with_estimate(str(path), result.options, result.summary).row("communication")
    assert (row.traced_bytes, row.estimated_bytes) == (traced, traced)
