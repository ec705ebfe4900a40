"""``--dropout`` and ``--attention-dropout`` reach every dropout of the traced model, the config class's defaults
included, and the estimate prices what the trace keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate

#: GPT-2 without its ``*_pdrop`` keys: transformers' class defaults are 0.1, which the trace kept whatever
#: --dropout said (the estimate at --dropout 0 was 6.5% under the trace's activations on the eager cell).
GPT2 = {"model_type": "gpt2", "n_embd": 256, "n_head": 8, "n_layer": 2, "vocab_size": 2048, "n_positions": 1024}


def _activation_error(path: Path, attention: str, **flags: float) -> float:
    result = trace(str(path), seq=256, mbs=2, precision="bf16-mixed", attention=attention, recompute="none",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, **flags)
    rows = {row.category: row for row in compare_with_estimate(str(path), result.options, result.summary).rows}
    return rows["activation"].relative or 0.0


@pytest.mark.parametrize("attention, flags", [
    ("eager", {}),
    ("eager", {"dropout": 0.1, "attention_dropout": 0.0}),
    ("sdpa", {"dropout": 0.1}),
    ("sdpa", {"dropout": 0.0, "attention_dropout": 0.1}),
])
def test_gpt2_dropouts_follow_the_job(tmp_path: Path, attention: str, flags: dict[str, float]) -> None:
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(GPT2))
    assert abs(_activation_error(path, attention, **flags)) <= 0.005
