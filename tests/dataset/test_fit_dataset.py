"""``memplan fit --dataset``: the search, and --emit configs loaded by the real libraries that reproduce
the chosen step shapes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from memplan.cli import app
from memplan.dataset import Batching, Fields, find_tokenizer, plan_steps
from memplan.dataset.lengths import token_lengths

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 2048,
          "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
          "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


@pytest.fixture
def model_dir(make_model_dir) -> Path:
    return make_model_dir(CONFIG)


def _fit(*args: str) -> dict:
    out = CliRunner().invoke(app, ["fit", *args, "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_search_keeps_the_global_batch_and_fits(model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    path = write_jsonl(tmp_path / "t.jsonl", text_rows * 4)
    doc = _fit(str(model_dir), "--dataset", str(path), "--mbs", "8", "--gbs", "32", "--gpu", "rtx-4090",
               "--framework", "hf")
    settings = doc["settings"]
    assert all(s["micro_batch_size"] * s["gradient_accumulation_steps"] == 32 for s in settings)
    chosen = doc["chosen"]
    assert chosen == settings[0] and chosen["fits"]
    usable = doc["dataset"]["gpu_usable_bytes"] * (1 - doc["margin"])
    assert chosen["worst_peak_allocated_bytes"] <= usable
    fitting = [s for s in settings if s["fits"] and s["tokens_truncated"] == 0]
    assert chosen["predicted_epoch_s"] == min(s["predicted_epoch_s"] for s in fitting)
    assert any(not s["fits"] for s in settings)  # the search really rejects settings


def _trainer_shapes(args, rows, tokenizer_dir, tmp_path, sft):
    from datasets import Dataset
    from transformers import AutoTokenizer, DataCollatorWithPadding, LlamaConfig, LlamaForCausalLM, Trainer, set_seed

    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if sft:
        from trl import SFTTrainer

        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    else:
        ds = Dataset.from_list(rows).map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
        trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=DataCollatorWithPadding(tok))
    set_seed(args.seed)
    return [tuple(b["input_ids"].shape) for b in trainer.get_train_dataloader()]


@pytest.mark.parametrize("kind", ["hf", "trl"])
def test_emitted_config_loads_and_reproduces_the_shapes(kind, model_dir, text_rows, tokenizer_dir, tmp_path,
                                                       write_jsonl, isolated_cache):
    from transformers import TrainingArguments

    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    emitted = tmp_path / f"{kind}.json"
    batching = ["--batching", "trl", "--max-length", "200"] if kind == "trl" else []
    doc = _fit(str(model_dir), "--dataset", str(path), "--mbs", "4", "--gbs", "8", "--gpu", "rtx-4090",
               *batching, "--emit", kind, str(emitted))
    config = json.loads(emitted.read_text())
    assert doc["emitted"]["config"] == config
    config["output_dir"] = str(tmp_path / "out")
    if kind == "trl":
        from trl import SFTConfig

        args = SFTConfig(**config, report_to=[], use_cpu=True)
    else:
        args = TrainingArguments(**config, report_to=[], use_cpu=True)
    chosen = doc["chosen"]
    assert args.per_device_train_batch_size == chosen["micro_batch_size"]
    assert args.gradient_accumulation_steps == chosen["gradient_accumulation_steps"]
    theirs = _trainer_shapes(args, text_rows, tokenizer_dir, tmp_path, sft=kind == "trl")
    fields = Fields(text="text", add_eos=kind == "trl")
    lengths, _ = token_lengths(str(path), fields, find_tokenizer(str(tokenizer_dir), None))
    ours = plan_steps(lengths, Batching(rule=chosen["batching"], micro_batch_size=chosen["micro_batch_size"],
                                        max_length=chosen["max_length"], group_by_length=chosen["group_by_length"],
                                        gradient_accumulation_steps=chosen["gradient_accumulation_steps"]))
    assert list(zip(ours.batch_size.tolist(), ours.seq_length.tolist())) == theirs
    assert np.unique(ours.seq_length).size > 2


def test_torchtune_keys_are_the_recipe_configs(model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    emitted = tmp_path / "tt.yaml"
    _fit(str(model_dir), "--dataset", str(path), "--mbs", "2", "--gbs", "4", "--gpu", "rtx-4090", "--batching",
         "torchtune-packing", "--max-length", "256", "--emit", "torchtune", str(emitted))
    ours = yaml.safe_load(emitted.read_text())
    assert ours["tokenizer"]["max_seq_len"] == 256 and ours["batch_size"] * ours["gradient_accumulation_steps"] == 4
    try:
        import importlib.util

        spec = importlib.util.find_spec("recipes")
    except ImportError:
        spec = None
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("torchtune's recipe configs are not installed")
    recipe = Path(list(spec.submodule_search_locations)[0]) / "configs" / "llama3_2" / "1B_full_single_device.yaml"
    if not recipe.is_file():
        pytest.skip("torchtune's recipe configs are not installed")
    theirs = yaml.safe_load(recipe.read_text())
    for key, value in ours.items():
        assert key in theirs
        if isinstance(value, dict):
            assert set(value) <= set(theirs[key])


def test_emit_without_dataset_is_refused():
    out = CliRunner().invoke(app, ["fit", "llama-3.2-1b", "--emit", "hf", "x.json"])
    assert out.exit_code == 2 and "--emit: needs --dataset" in out.output


def test_changes_only_when_nothing_fits_without(model_dir, chat_rows, tmp_path, write_jsonl, isolated_cache):
    """On a 16 GB card full fine-tuning fits no setting of its own: 8-bit AdamW is tried, and listed."""
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    emitted = tmp_path / "ta.json"
    doc = _fit(str(model_dir), "--dataset", str(path), "--messages-field", "messages", "--mbs", "4", "--gbs", "8",
               "--gpu", "v100-16gb", "--framework", "hf", "--emit", "hf", str(emitted))
    own = [s for s in doc["settings"] if not s["changes"]]
    assert own and not any(s["fits"] for s in own)
    chosen = doc["chosen"]
    assert chosen["fits"] and chosen["changes"] == ["optimizer adamw8bit"]
    from transformers import TrainingArguments

    config = json.loads(emitted.read_text())
    assert TrainingArguments(**{**config, "output_dir": str(tmp_path / "o")}).optim == "adamw_bnb_8bit"


@pytest.mark.parametrize("extra", [("--top", "3"), ("--all",), ("--gpus-per-node", "4"), ("--max-seq",), ("--methods",),
                                   ("--torchtitan-config", "t.toml")])
def test_options_the_dataset_search_does_not_read_are_refused(extra, model_dir, text_rows, tmp_path, write_jsonl,
                                                              isolated_cache):
    """Each was accepted and dropped: the --dataset branch reads none of them."""
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    out = CliRunner().invoke(app, ["fit", str(model_dir), "--dataset", str(path), *extra])
    assert out.exit_code == 2, out.output
    assert out.output.startswith(f"error: {extra[0]}: does not apply with --dataset")
