"""The fast counts of memplan.dataset.fastcount equal Tokenizer.encode_batch_fast's lengths, row by row, for
the byte-level BPE pipelines it claims (GPT-2's, Llama 3's Split + ByteLevel, NFC), and it declines the rest."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("regex")

from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

from memplan.dataset.fastcount import count_tokens  # noqa: E402

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
WORDS = ("memory", "Token", "BATCH", "it's", "we'll", "I'M", "they've", "x1", "2048", "12345", "a.b", "(c)", "--",
         "!?", "e=mc^2", "__init__", "tab\there", "line\nbreak", "crlf\r\nx", "   ", "\n\n", "end.", "'quote'")


def _rows(seed: int, count: int = 300) -> list[str]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(0, 60))]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, len(words)), rng.choice(["</s>", "<s>", "x</s>y", "<|im_start|>", "<s><s>"]))
        rows.append(rng.choice([" ", "", "  ", "\n"]).join(words) + rng.choice(["", " ", "\n", "  "]))
    return rows + ["", " ", "\n", "</s>", "a</s>", "café au lait", "naïve </s> \u00a0x", "\x0bvertical", "emoji 🙂"]


def _tokenizer(kind: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, ignore_merges=kind == "llama3"))
    if kind == "llama3":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(LLAMA3), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_rows(0, 200), trainer=trainer)
    tok.add_tokens(["<|im_start|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _check(tok: Tokenizer, special: bool) -> np.ndarray:
    rows = _rows(1)
    counted = count_tokens(rows, tok, json.loads(tok.to_str()), add_special_tokens=special)
    assert counted is not None
    expected = np.array([len(e) for e in tok.encode_batch_fast(rows, add_special_tokens=special)])
    fast = counted >= 0
    assert np.array_equal(counted[fast], expected[fast])
    return counted


@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
@pytest.mark.parametrize("special", [False, True])
def test_counts_equal_encode_batch_fast(kind, special):
    counted = _check(_tokenizer(kind), special)
    rows = _rows(1)
    left = {rows[i] for i in np.flatnonzero(counted < 0)}
    assert left == {"café au lait", "naïve </s> \u00a0x", "\x0bvertical", "emoji 🙂"}  # non-ASCII, controls
    assert (counted >= 0).sum() == len(rows) - 4


def test_declines_pipelines_it_does_not_reproduce():
    tok = _tokenizer("gpt2")
    spec = json.loads(tok.to_str())
    assert count_tokens(["a"], tok, {**spec, "normalizer": {"type": "Lowercase"}}, add_special_tokens=False) is None
    assert count_tokens(["a"], tok, {**spec, "model": {**spec["model"], "dropout": 0.1}},
                        add_special_tokens=False) is None
    prefix = {**spec, "pre_tokenizer": {**spec["pre_tokenizer"], "add_prefix_space": True}}
    assert count_tokens(["a"], tok, prefix, add_special_tokens=False) is None
    metaspace = {**spec, "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"}}
    assert count_tokens(["a"], tok, metaspace, add_special_tokens=False) is None
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert count_tokens(["a"], tok, json.loads(tok.to_str()), add_special_tokens=False) is None


def test_lengths_use_it_and_equal_the_reference(tokenizer_dir, chat_rows, tmp_path, write_jsonl, isolated_cache):
    """token_lengths (the fast path inside) equals apply_chat_template(tokenize=True) row by row."""
    from transformers import AutoTokenizer

    from memplan.dataset import Fields, find_tokenizer
    from memplan.dataset.lengths import token_lengths

    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    lengths, cached = token_lengths(str(path), Fields(messages="messages"), find_tokenizer(str(tokenizer_dir), None))
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = [len(reference.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
                for r in chat_rows]
    assert not cached and lengths.tolist() == expected


def test_two_processes_count_what_one_counts(tokenizer_dir):
    """The forked split (memplan.dataset.forked) gives the single-process counts, row for row."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    rust, spec = Tokenizer.from_file(str(path)), json.loads(path.read_text(encoding="utf-8"))
    texts = [f"row {i}: " + "hello world, " * (i % 17) + ("\u00e9t\u00e9" if i % 5 == 0 else "") for i in range(301)]
    one = count_tokens(texts, rust, spec, add_special_tokens=True, parallel_rows=10**9)
    two = count_tokens(texts, rust, spec, add_special_tokens=True, parallel_rows=1)
    assert one is not None and two is not None
    assert two.tolist() == one.tolist() and (one == -1).sum() == 61  # the non-ASCII rows are left to Rust


def test_a_failed_child_is_counted_here():
    """A child that dies (here: killed by its count) leaves its half to the parent; the result is whole."""
    from memplan.dataset import forked

    parent = os.getpid()

    def count(rows):
        if os.getpid() != parent:
            os._exit(3)
        return np.array([len(r) for r in rows], dtype=np.int64)

    rows = ["a" * i for i in range(11)]
    assert forked.in_two_halves(rows, count).tolist() == list(range(11))
