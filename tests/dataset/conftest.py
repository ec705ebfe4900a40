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


#: A small Llama whose full fine-tune on an RTX 4090 leaves the search a choice (the emit tests).
EMIT_MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 2048,
              "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
              "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


@pytest.fixture
def fit_emit(make_model_dir, text_rows, tmp_path: Path, write_jsonl):
    """``fit_emit(kind, rule, mbs, gbs)``: ``memplan fit --dataset ... --max-length 128 --emit kind FILE --json`` on
    the text rows and EMIT_MODEL (rtx-4090); the model folder, the data file, the emitted file and the document."""
    from typer.testing import CliRunner

    from memplan.cli import app

    def run(kind: str, rule: str, mbs: int, gbs: int) -> tuple[Path, Path, Path, dict]:
        model = make_model_dir(EMIT_MODEL)
        data = write_jsonl(tmp_path / "t.jsonl", text_rows)
        emitted = tmp_path / f"{kind}.yaml"
        out = CliRunner().invoke(app, ["fit", str(model), "--dataset", str(data), "--mbs", str(mbs), "--gbs", str(gbs),
                                       "--gpu", "rtx-4090", "--batching", rule, "--max-length", "128", "--emit", kind,
                                       str(emitted), "--json"])
        assert out.exit_code == 0, out.output
        return model, data, emitted, json.loads(out.stdout)

    return run
