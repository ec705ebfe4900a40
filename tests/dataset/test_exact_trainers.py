"""Every step's shape equals what the real trainer's sampler and collator give, step by step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memplan.dataset import Batching, Fields, find_tokenizer, plan_steps
from memplan.dataset.lengths import token_lengths

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config)


def _hf_shapes(tokenizer_dir: Path, texts: list[str], tmp_path: Path, epochs: int, **args) -> list[tuple]:
    from datasets import Dataset
    from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    max_length = args.pop("max_length", None)
    ds = Dataset.from_dict({"text": texts}).map(
        lambda b: tok(b["text"], truncation=max_length is not None, max_length=max_length), batched=True,
        remove_columns=["text"])
    pad = args.pop("pad_to_multiple_of", None)
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, **args)
    trainer = Trainer(model=_tiny_model(), args=targs, train_dataset=ds,
                      data_collator=DataCollatorWithPadding(tok, pad_to_multiple_of=pad))
    transformers.set_seed(targs.seed)
    loader = trainer.get_train_dataloader()
    shapes = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        shapes += [tuple(batch["input_ids"].shape) for batch in loader]
    return shapes


def _ours(tokenizer_dir: Path, path: Path, batching: Batching) -> list[tuple]:
    lengths, _ = token_lengths(str(path), Fields(text="text"), find_tokenizer(str(tokenizer_dir), None))
    steps = plan_steps(lengths, batching)
    return list(zip(steps.batch_size.tolist(), steps.seq_length.tolist()))


@pytest.mark.parametrize("args", [
    {"per_device_train_batch_size": 8, "seed": 3},
    {"per_device_train_batch_size": 5, "seed": 11, "dataloader_drop_last": True, "max_length": 60},
    {"per_device_train_batch_size": 4, "seed": 7, "data_seed": 99, "pad_to_multiple_of": 8},
    {"per_device_train_batch_size": 6, "seed": 5, "train_sampling_strategy": "group_by_length",
     "gradient_accumulation_steps": 2},
])
def test_hf_trainer_steps(args, write_jsonl, tokenizer_dir, text_rows, tmp_path, isolated_cache):
    path = write_jsonl(tmp_path / "train.jsonl", text_rows)
    theirs = _hf_shapes(tokenizer_dir, [r["text"] for r in text_rows], tmp_path, 2, **dict(args))
    batching = Batching(rule="hf", micro_batch_size=args["per_device_train_batch_size"], seed=args["seed"],
                        data_seed=args.get("data_seed"), drop_last=args.get("dataloader_drop_last", False),
                        max_length=args.get("max_length"), pad_to_multiple_of=args.get("pad_to_multiple_of"),
                        group_by_length=args.get("train_sampling_strategy") == "group_by_length",
                        gradient_accumulation_steps=args.get("gradient_accumulation_steps", 1), epochs=2)
    ours = _ours(tokenizer_dir, path, batching)
    if batching.group_by_length:  # the global RNG is re-seeded per epoch only by set_seed: compare epoch 0
        half = len(theirs) // 2
        theirs, ours = theirs[:half], ours[:half]
    assert ours == theirs
    assert len({s[1] for s in ours}) > 3  # lengths really vary


def _trl_shapes(tokenizer_dir: Path, rows: list[dict], tmp_path: Path, **config) -> list[tuple]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, **config)
    trainer = SFTTrainer(model=_tiny_model(), args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tok)
    transformers.set_seed(args.seed)
    loader = trainer.get_train_dataloader()
    return [tuple(batch["input_ids"].shape) for batch in loader]


@pytest.mark.parametrize("config", [
    {"per_device_train_batch_size": 4, "seed": 1, "max_length": 400},
    {"per_device_train_batch_size": 3, "seed": 2, "max_length": None, "padding_free": True},
    {"per_device_train_batch_size": 2, "seed": 4, "max_length": 128, "packing": True},
    {"per_device_train_batch_size": 2, "seed": 4, "max_length": 96, "packing": True, "shuffle_dataset": True},
    {"per_device_train_batch_size": 3, "seed": 6, "max_length": 80, "packing": True,
     "packing_strategy": "wrapped"},
])
@pytest.mark.parametrize("kind", ["text", "messages"])
def test_trl_sft_steps(config, kind, write_jsonl, tokenizer_dir, text_rows, chat_rows, tmp_path, isolated_cache):
    pytest.importorskip("trl")
    rows = text_rows if kind == "text" else chat_rows
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    theirs = _trl_shapes(tokenizer_dir, rows, tmp_path, **dict(config))
    rule = "trl-packing" if config.get("packing") else "trl-padding-free" if config.get("padding_free") else "trl"
    batching = Batching(rule=rule, micro_batch_size=config["per_device_train_batch_size"], seed=config["seed"],
                        max_length=config["max_length"], shuffle_dataset=config.get("shuffle_dataset", False),
                        packing_strategy=config.get("packing_strategy", "bfd"))
    fields = Fields(text="text", add_eos=True) if kind == "text" else Fields(messages="messages")
    lengths, _ = token_lengths(str(path), fields, find_tokenizer(str(tokenizer_dir), None))
    steps = plan_steps(lengths, batching)
    assert list(zip(steps.batch_size.tolist(), steps.seq_length.tolist())) == theirs
    if config.get("packing_strategy") != "wrapped":  # wrapped rows are full by design
        assert np.unique(steps.seq_length).size > 2
