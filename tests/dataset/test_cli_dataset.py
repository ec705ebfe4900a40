"""``memplan estimate --dataset``: the JSON section, the worst step, --plot, and bad input (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 512,
          "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
          "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


@pytest.fixture
def model_dir(make_model_dir) -> Path:
    return make_model_dir(CONFIG)


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_json_section_and_worst_step_equals_estimate(model_dir, chat_rows, tmp_path, write_jsonl, isolated_cache):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    plot = tmp_path / "steps.png"
    out = _run("estimate", str(model_dir), "--dataset", str(path), "--messages-field", "messages", "--mbs", "4",
               "--gbs", "8", "--gpu", "a100-40gb", "--json", "--plot", str(plot))
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    section = doc.pop("dataset")
    assert section["examples"] == len(chat_rows)
    assert section["steps"] == -(-len(chat_rows) // 4)
    assert set(section["length_percentiles"]) == {"p50", "p90", "p99", "p100"}
    assert section["steps_over_gpu"] == 0
    worst = section["worst_step"]
    assert worst["peak_allocated_bytes"] == doc["peak_allocated_bytes"] == section["step_peak_percentiles_bytes"]["p100"]
    plain = _run("estimate", str(model_dir), "--mbs", str(worst["batch_size"]), "--seq", str(worst["seq_length"]),
                 "--gbs", str(2 * worst["batch_size"]), "--gpu", "a100-40gb", "--json")
    assert json.loads(plain.stdout) == doc
    assert plot.stat().st_size > 10_000


def test_packed_steps_are_priced_with_packing(model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    out = _run("estimate", str(model_dir), "--dataset", str(path), "--batching", "trl-packing", "--max-length",
               "256", "--mbs", "2", "--json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    worst = doc["dataset"]["worst_step"]
    assert worst["batch_size"] == 1 and worst["seq_length"] <= 512
    assert "--packing" in doc["dataset"]["pricing"] and doc["job"]["batch"]["packing"] is True


@pytest.mark.parametrize("rows, extra, message", [
    ([{"body": "x"}], (), "row 1 has no field 'text'"),
    ([{"text": "x"}], ("--messages-field", "text"), "row 1, field 'text': must be a non-empty list"),
    ([{"text": "x"}], ("--tokenizer", "/nonexistent/tok"), "--tokenizer: must be a tokenizer.json"),
])
def test_bad_input_exits_2(rows, extra, message, model_dir, tmp_path, write_jsonl, isolated_cache):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    plot = tmp_path / "p.png"
    out = _run("estimate", str(model_dir), "--dataset", str(path), *extra, "--plot", str(plot))
    assert out.exit_code == 2
    assert message in out.output and len(out.output.strip().splitlines()) == 1
    assert not plot.exists()


def test_preset_without_tokenizer_says_so(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])
    out = _run("estimate", "llama-3.2-1b", "--dataset", str(path))
    assert out.exit_code == 2 and "a tokenizer is needed" in out.output


def test_dataset_options_need_dataset():
    out = _run("estimate", "llama-3.2-1b", "--batching", "trl")
    assert out.exit_code == 2 and "--batching: needs --dataset" in out.output


def test_hf_args_give_the_batching(model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    """An SFTConfig JSON selects TRL's rule and its fields; a flag typed on the command line wins."""
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    args = tmp_path / "sft.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "packing": True, "max_length": 128,
                                "seed": 5, "dataset_text_field": "text"}))
    out = _run("estimate", str(model_dir), "--dataset", str(path), "--hf-args", str(args), "--json")
    assert out.exit_code == 0, out.output
    section = json.loads(out.stdout)["dataset"]
    assert section["batching"] == "trl-packing" and section["worst_step"]["seq_length"] <= 256
    out = _run("estimate", str(model_dir), "--dataset", str(path), "--hf-args", str(args), "--batching", "trl",
               "--json")
    section = json.loads(out.stdout)["dataset"]
    assert section["batching"] == "trl" and section["worst_step"]["batch_size"] == 2


def test_hf_args_script_form_gives_the_batching(model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    """A launch script's command line (--hf-args as a text file) gives the same batching as the JSON form."""
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc_per_node 1 sft.py \\\n  --per_device_train_batch_size 2 --packing \\\n"
                      "  --max_length 128 --seed 5 --dataset_text_field text --num_train_epochs 2\n")
    args = tmp_path / "sft.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "packing": True, "max_length": 128, "seed": 5,
                                "dataset_text_field": "text", "num_train_epochs": 2}))
    by_script = _run("estimate", str(model_dir), "--dataset", str(path), "--hf-args", str(script), "--json")
    by_json = _run("estimate", str(model_dir), "--dataset", str(path), "--hf-args", str(args), "--json")
    assert by_script.exit_code == 0, by_script.output
    section, other = json.loads(by_script.stdout)["dataset"], json.loads(by_json.stdout)["dataset"]
    assert section.pop("lengths_from_cache") is False and other.pop("lengths_from_cache") is True
    assert section["batching"] == "trl-packing" and section == other


def test_hf_args_script_group_by_length(model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    """Trainer flags in a script: --group_by_length and --dataloader_drop_last reach the HF rule."""
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    script = tmp_path / "train.sh"
    script.write_text("python train.py --per_device_train_batch_size 4 --group_by_length --dataloader_drop_last "
                      "true --seed 3\n")
    flags = ("--mbs", "4", "--group-by-length", "--drop-last", "--seed", "3")
    by_script = _run("estimate", str(model_dir), "--dataset", str(path), "--hf-args", str(script), "--json")
    by_flags = _run("estimate", str(model_dir), "--dataset", str(path), *flags, "--json")
    assert by_script.exit_code == 0, by_script.output
    section, other = json.loads(by_script.stdout)["dataset"], json.loads(by_flags.stdout)["dataset"]
    shape = ("batching", "examples", "steps", "length_percentiles")  # the peaks also price the script's fp32
    assert {k: section[k] for k in shape} == {k: other[k] for k in shape} and section["steps"] == 203 // 4
    assert [section["worst_step"][k] for k in ("index", "batch_size", "seq_length")] == \
        [other["worst_step"][k] for k in ("index", "batch_size", "seq_length")]


def test_report_has_the_per_step_section(model_dir, chat_rows, tmp_path, write_jsonl, isolated_cache):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    page = tmp_path / "r.html"
    out = _run("report", str(model_dir), "--dataset", str(path), "--messages-field", "messages", "--mbs", "4",
               "--gpu", "a100-40gb", "-o", str(page))
    assert out.exit_code == 0, out.output
    text = page.read_text()
    estimate = json.loads(_run("estimate", str(model_dir), "--dataset", str(path), "--messages-field", "messages",
                               "--mbs", "4", "--gpu", "a100-40gb", "--json").stdout)
    worst = estimate["dataset"]["worst_step"]
    assert "Per-step peak on the dataset" in text and "<polyline" in text
    assert f"<td>{worst['index']}</td><td>{worst['batch_size']}</td><td>{worst['seq_length']}</td>" in text


@pytest.mark.parametrize("missing", ["datasets", "numpy"])
def test_missing_package_is_one_line(missing, tmp_path, write_jsonl):
    import os
    import subprocess
    import sys

    import memplan

    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])
    code = (f"import sys\nsys.modules[{missing!r}] = None\n"
            f"sys.argv = ['memplan', 'estimate', 'llama-3.2-1b', '--dataset', {str(path)!r}]\n"
            "from memplan.cli import main\nmain()\n")
    env = {**os.environ, "PYTHONPATH": str(Path(memplan.__file__).resolve().parents[1]), "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --dataset needs {missing}; install it with pip install 'memplan[dataset]'"]


def _one_line_nothing_written(out, message, cache, *written):
    assert out.exit_code == 2, out.output
    assert message in out.output and len(out.output.strip().splitlines()) == 1
    assert not any(p.exists() for p in written)
    assert not list(cache.rglob("*.npy")) and not list(cache.rglob("*.partial"))


def test_failing_chat_template_exits_2(model_dir, tmp_path, write_jsonl, isolated_cache):
    """The template's own error: one line with the file, row and field; no cache, plot or emitted file."""
    import shutil

    rows = [{"messages": [{"role": "user", "content": "hi"}]}] * 3 + [{"messages": [{"role": "tool", "content": "x"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}")
    plot, emitted = tmp_path / "p.png", tmp_path / "e.json"
    out = _run("estimate", str(folder), "--dataset", str(path), "--messages-field", "messages", "--plot", str(plot))
    _one_line_nothing_written(out, f"{path}: row 4, field 'messages': the chat template", isolated_cache, plot)
    out = _run("fit", str(folder), "--dataset", str(path), "--messages-field", "messages", "--emit", "hf",
               str(emitted))
    _one_line_nothing_written(out, "row 4, field 'messages'", isolated_cache, emitted)


def test_vocabulary_mismatch_and_empty_file_exit_2(model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    import shutil

    small = tmp_path / "small"
    shutil.copytree(model_dir, small)
    (small / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 50}))
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    plot = tmp_path / "p.png"
    out = _run("estimate", str(small), "--dataset", str(path), "--plot", str(plot))
    _one_line_nothing_written(out, f"{path}: row 1, field 'text': token id", isolated_cache, plot)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = _run("estimate", str(model_dir), "--dataset", str(empty), "--plot", str(plot))
    _one_line_nothing_written(out, f"{empty}: the file is empty", isolated_cache, plot)
