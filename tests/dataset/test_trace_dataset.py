"""``memplan trace MODEL --dataset ... --device cpu``: every step's shape traced; a step's peak is the trace of
that shape on its own."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli import app

pytest.importorskip("torch")
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "torch_dtype": "float32", "rms_norm_eps": 1e-5}


def test_trace_dataset_per_step(make_model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    model = make_model_dir(TINY)
    path = write_jsonl(tmp_path / "t.jsonl", text_rows[:12])
    common = ["--precision", "fp32", "--device", "cpu", "--attention", "eager", "--iterations", "1", "--json"]
    out = CliRunner().invoke(app, ["trace", str(model), "--dataset", str(path), "--mbs", "4", *common])
    assert out.exit_code == 0, out.output
    section = json.loads(out.stdout)["dataset"]
    peaks = section["per_step_peak_allocated_bytes"]
    assert section["steps"] == 3 == len(peaks) and section["device"] == "cpu"
    assert peaks[section["worst_step"]] == max(peaks) == section["worst_peak_allocated_bytes"]
    worst = section["worst_step_shape"]
    single = CliRunner().invoke(app, ["trace", str(model), "--mbs", str(worst["batch_size"]), "--seq",
                                      str(worst["seq_length"]), *common])
    assert single.exit_code == 0, single.output
    assert json.loads(single.stdout)["peak_allocated_bytes"] == max(peaks)


def test_trace_dataset_refuses_single_trace_outputs(make_model_dir, text_rows, tmp_path, write_jsonl):
    model = make_model_dir(TINY)
    path = write_jsonl(tmp_path / "t.jsonl", text_rows[:4])
    out = CliRunner().invoke(app, ["trace", str(model), "--dataset", str(path), "--device", "cpu", "-o",
                                   str(tmp_path / "x.mptrace")])
    assert out.exit_code == 2 and "--dataset" in out.output and not (tmp_path / "x.mptrace").exists()
