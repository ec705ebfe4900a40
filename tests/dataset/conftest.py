"""Fixtures: a tokenizer trained here (byte-level BPE, a chat template) and variable-length datasets."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

WORDS = ("memory", "token", "batch", "gradient", "layer", "attention", "packing", "sequence", "step", "peak",
         "the", "a", "of", "to", "and", "model", "train", "data", "row", "shape")
TEMPLATE = ("{% for m in messages %}{{ bos_token }}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}")


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE trained on the fixture words, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([sentence(rng, 30) for _ in range(300)], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(folder)
    return folder


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def write_jsonl():
    """``write_jsonl(path, rows)``: the rows as JSON Lines at ``path``."""
    return _write_jsonl


@pytest.fixture(scope="session")
def text_rows() -> list[dict]:
    rng = random.Random(1)
    return [{"text": sentence(rng, int(rng.lognormvariate(3.0, 0.9)) + 1)} for _ in range(203)]


@pytest.fixture(scope="session")
def chat_rows() -> list[dict]:
    rng = random.Random(2)
    return [{"messages": [{"role": "user", "content": sentence(rng, rng.randint(1, 40))},
                          {"role": "assistant", "content": sentence(rng, rng.randint(1, 120))}]}
            for _ in range(150)]


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MEMPLAN_CACHE", str(cache))
    return cache


@pytest.fixture
def make_model_dir(tokenizer_dir: Path, tmp_path: Path):
    """``make_model_dir(config)``: a model folder with this config.json and the fixture tokenizer's files."""
    import shutil

    def make(config: dict) -> Path:
        folder = tmp_path / "model"
        shutil.copytree(tokenizer_dir, folder)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return make
