"""Reading every format, the length cache, and bad input (one line naming file, row and field; exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memplan.dataset import Fields, find_tokenizer
from memplan.dataset.lengths import token_lengths
from memplan.errors import ConfigError


def _lengths(path: Path | str, tokenizer_dir: Path, fields: Fields = Fields(text="text"), **kw) -> np.ndarray:
    return token_lengths(str(path), fields, find_tokenizer(str(tokenizer_dir), None), **kw)[0]


def test_formats_give_the_same_lengths(tokenizer_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    from datasets import Dataset
    from transformers import AutoTokenizer

    ds = Dataset.from_list(text_rows)
    ds.to_parquet(str(tmp_path / "t.parquet"))
    ds.to_csv(str(tmp_path / "t.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "t.json").write_text(json.dumps(text_rows))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    paths = [write_jsonl(tmp_path / "t.jsonl", text_rows), tmp_path / "t.json", tmp_path / "t.parquet",
             tmp_path / "t.csv", tmp_path / "saved", arrow]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = [len(tok(r["text"])["input_ids"]) for r in text_rows]
    for path in paths:
        assert _lengths(path, tokenizer_dir).tolist() == expected, path


def test_messages_match_apply_chat_template(tokenizer_dir, chat_rows, tmp_path, write_jsonl, isolated_cache):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    expected = [len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
                for r in chat_rows]
    assert _lengths(path, tokenizer_dir, Fields(messages="messages")).tolist() == expected


def test_prompt_completion(tokenizer_dir, tmp_path, write_jsonl, isolated_cache):
    from transformers import AutoTokenizer

    rows = [{"prompt": "the model of", "completion": " memory " * n} for n in (1, 5, 9)]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = [len(tok(r["prompt"] + r["completion"] + "</s>")["input_ids"]) for r in rows]
    got = _lengths(path, tokenizer_dir, Fields(prompt="prompt", completion="completion", add_eos=True))
    assert got.tolist() == expected


def test_second_run_reads_the_cache(tokenizer_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    tok = find_tokenizer(str(tokenizer_dir), None)
    first, cached_first = token_lengths(str(path), Fields(text="text"), tok)
    second, cached_second = token_lengths(str(path), Fields(text="text"), tok)
    assert (cached_first, cached_second) == (False, True)
    assert np.array_equal(first, second)
    write_jsonl(path, text_rows[:-1])  # new content: a new key
    third, cached_third = token_lengths(str(path), Fields(text="text"), tok)
    assert not cached_third and len(third) == len(text_rows) - 1


@pytest.mark.parametrize("content, message", [
    ("", "the file is empty"),
    ('{"text": "a"}\n{"text": "b"\n', "row 2: not valid JSON"),
    ('{"text": "a"}\n{"body": "b"}\n', "row 2, field 'text': must be a string"),
    ('{"body": "a"}\n', "row 1 has no field 'text'"),
])
def test_bad_files(content, message, tokenizer_dir, tmp_path, isolated_cache):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        _lengths(path, tokenizer_dir)
    assert str(path) in str(info.value)
    assert not list(isolated_cache.rglob("*.npy"))  # nothing half-written


def test_tokenizer_outside_the_models_vocabulary(tokenizer_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    with pytest.raises(ConfigError, match=r"row 1, field 'text': token id \d+ is outside the model's vocabulary of 50"):
        _lengths(path, tokenizer_dir, vocab_size=50)


def test_failing_chat_template(tokenizer_dir, tmp_path, write_jsonl, isolated_cache):
    import shutil

    broken = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, broken)
    (broken / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}")
    rows = [{"messages": [{"role": "user", "content": "hi"}]}] * 3 + [{"messages": [{"role": "tool", "content": "x"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(ConfigError, match=r"row 4, field 'messages': the chat template .* failed \(no tools\)"):
        _lengths(path, broken, Fields(messages="messages"))


def test_preset_needs_a_tokenizer():
    with pytest.raises(ConfigError, match="a tokenizer is needed"):
        find_tokenizer(None, "llama-3.1-8b")
