"""``memplan alloc simulate`` of an FSDP2 trace: each stream has its own pool of cached blocks."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.events import Trace, read_trace, write_trace

pytest.importorskip("torch")
runner = CliRunner()
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}


@pytest.fixture(scope="module")
def fsdp_trace_file(tmp_path_factory: pytest.TempPathFactory):
    from memplan.trace import trace

    folder = tmp_path_factory.mktemp("fsdp-streams")
    (folder / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    result = trace(str(folder / "config.json"), seq=64, mbs=1, precision="bf16-mixed", device="cuda", fsdp=2)
    path = folder / "fsdp2.mptrace"
    write_trace(result.trace, path)
    flat = folder / "one-stream.mptrace"
    write_trace(Trace(events=tuple(e._replace(stream=0) for e in result.trace.events), meta=result.trace.meta), flat)
    return result, path, flat


def _simulate(path) -> dict:
    outcome = runner.invoke(app, ["alloc", "simulate", str(path), "--json"])
    assert outcome.exit_code == 0, outcome.output
    return json.loads(outcome.stdout)


def test_trace_file_keeps_streams_and_simulate_pools_them(fsdp_trace_file) -> None:
    result, path, flat = fsdp_trace_file
    assert read_trace(path).events == result.trace.events  # the stream field survives the file
    streams = _simulate(path)
    one_stream = _simulate(flat)
    # Segments are never released without empty_cache: the final map shows every stream's pool.
    assert {segment["stream"] for segment in streams["segments"]} == {0, 1, 3}
    assert {segment["stream"] for segment in one_stream["segments"]} == {0}
    assert streams["peak_reserved_bytes"] >= one_stream["peak_reserved_bytes"]
    assert streams["peak_reserved_bytes"] == result.summary.reserved.peak_reserved_bytes
