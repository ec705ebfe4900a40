"""``POST /v1/dataset``: the user's data as an upload, answered as ``memplan estimate --dataset --json`` answers.

Starlette's TestClient against the real app (the work runs in the server's child process); the dataset
and the tokenizer (trained in the test, see conftest) are uploads, never paths of the server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

pytest.importorskip("starlette")
pytest.importorskip("multipart", reason="python-multipart is needed for forms (the serve extra)")
from starlette.testclient import TestClient  # noqa: E402

from memplan.cli import app as cli  # noqa: E402
from memplan.serve import ServeLimits, create_app  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 512,
          "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
          "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}
JOB = {"model_config": CONFIG, "mbs": 4, "gbs": 8, "gpu": "a100-40gb"}


@pytest.fixture(scope="module")
def client() -> Any:
    with TestClient(create_app(ServeLimits(max_upload_bytes=1 << 20, time_limit_s=60))) as test_client:
        yield test_client


def _files(tokenizer_dir: Path, data: Path, name: str | None = None) -> list[tuple[str, tuple[str, bytes]]]:
    """The dataset and every tokenizer file the fixture saved, as the form's file parts."""
    parts = [("file", (name or data.name, data.read_bytes()))]
    for part, file in (("tokenizer", "tokenizer.json"), ("tokenizer_config", "tokenizer_config.json"),
                       ("chat_template", "chat_template.jinja")):
        if (tokenizer_dir / file).is_file():
            parts.append((part, (file, (tokenizer_dir / file).read_bytes())))
    return parts


def _post(client: Any, files: list, **fields: Any) -> Any:
    data = {"job": json.dumps(fields.pop("job", JOB)), **{k: str(v) for k, v in fields.items()}}
    return client.post("/v1/dataset", data=data, files=files)


def test_answer_equals_the_command_line(client, tokenizer_dir, chat_rows, tmp_path, write_jsonl, make_model_dir,
                                        isolated_cache) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    answer = _post(client, _files(tokenizer_dir, data), messages_field="messages", max_length=200,
                   group_by_length="true")
    assert answer.status_code == 200, answer.text
    served = answer.json()
    assert not isolated_cache.exists()  # the request kept its caches in its own folder, gone with it
    model = make_model_dir(CONFIG)
    local = CliRunner().invoke(cli, ["estimate", str(model), "--dataset", str(data), "--messages-field", "messages",
                                     "--max-length", "200", "--group-by-length", "--mbs", "4", "--gbs", "8", "--gpu",
                                     "a100-40gb", "--json"])
    assert local.exit_code == 0, local.output
    expected = json.loads(local.stdout)["dataset"]
    got = served["dataset"]
    for section in (got, expected):
        section.pop("lengths_from_cache")
    assert got == expected
    assert got["worst_step"]["peak_allocated_bytes"] == served["peak_allocated_bytes"]
    assert got["length_percentiles"]["p100"] <= 200
    assert got["steps_over_gpu"] == 0 and got["gpu_usable_bytes"] == served["gpu"]["usable_bytes"]
    assert len(got["step_peaks"]["max_bytes"]) == got["steps"] and got["step_peaks"]["steps_per_point"] == 1
    assert max(got["step_peaks"]["max_bytes"]) == got["worst_step"]["peak_allocated_bytes"]
    assert sum(b["count"] for b in got["length_histogram"]) == len(chat_rows)


def test_packing_rule_and_the_model_tokenizer_from_a_text_column(client, tokenizer_dir, text_rows, tmp_path,
                                                                 write_jsonl) -> None:
    data = write_jsonl(tmp_path / "text.jsonl", text_rows)
    answer = _post(client, _files(tokenizer_dir, data), batching="trl-packing", max_length=256)
    assert answer.status_code == 200, answer.text
    section = answer.json()["dataset"]
    assert section["batching"] == "trl-packing" and "packing" in section["pricing"]
    assert section["worst_step"]["seq_length"] <= 256 * 4


@pytest.mark.parametrize(("fields", "name", "status", "message"), [
    ({}, "train.txt", 400, "file: must be a dataset file named with one of"),
    ({"tokenizer": "/etc/passwd"}, None, 400, "tokenizer: is not a field of the dataset form"),
    ({"images_field": "images"}, None, 400, "images_field: is not served"),
    ({"text_field": "missing"}, None, 400, "'missing'"),
    ({"max_length": "many"}, None, 400, "max_length: must be an integer"),
    ({"group_by_length": "yes"}, None, 400, "group_by_length: must be true or false"),
    ({"batching": "nope"}, None, 400, "nope"),
    ({"job": {"model": "/etc"}}, None, 400, "model: must be a preset"),
])
def test_bad_input_is_one_line(client, tokenizer_dir, text_rows, tmp_path, write_jsonl, fields, name, status,
                               message) -> None:
    data = write_jsonl(tmp_path / "text.jsonl", text_rows[:20])
    answer = _post(client, _files(tokenizer_dir, data, name), **fields)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and "\n" not in error["message"]
    assert "memplan-upload" not in answer.text and "memplan-serve" not in answer.text and "/tmp" not in answer.text


def test_malformed_and_missing_uploads(client, tokenizer_dir, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b"}\n{"text": \n')
    answer = _post(client, _files(tokenizer_dir, bad))
    assert answer.status_code == 400, answer.text
    assert "row 2: not valid JSON" in answer.json()["error"]["message"]
    assert "/tmp" not in answer.text
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "file: is empty" in _post(client, _files(tokenizer_dir, empty)).json()["error"]["message"]
    no_file = _post(client, _files(tokenizer_dir, bad)[1:])
    assert no_file.status_code == 400 and "file: is required" in no_file.json()["error"]["message"]
    broken = _files(tokenizer_dir, bad)
    broken[1] = ("tokenizer", ("tokenizer.json", b"{not json"))
    answer = _post(client, [("file", ("ok.jsonl", b'{"text": "a b"}\n'))] + broken[1:2])
    assert answer.status_code == 400, answer.text
    assert "tokenizer: upload not a tokenizer.json the tokenizers library can read" in answer.json()["error"]["message"]
    json_body = client.post("/v1/dataset", json={"job": JOB})
    assert json_body.status_code == 415


def test_uploads_are_bounded(tokenizer_dir, text_rows, tmp_path, write_jsonl) -> None:
    data = write_jsonl(tmp_path / "text.jsonl", text_rows * 40)
    with TestClient(create_app(ServeLimits(max_upload_bytes=4096))) as small:
        answer = _post(small, _files(tokenizer_dir, data))
    assert answer.status_code == 413 and "at most 4096 bytes" in answer.json()["error"]["message"]
    with TestClient(create_app(ServeLimits(time_limit_s=0.05))) as hurried:
        answer = _post(hurried, _files(tokenizer_dir, data))
    assert answer.status_code == 503 and "time limit" in answer.json()["error"]["message"]
