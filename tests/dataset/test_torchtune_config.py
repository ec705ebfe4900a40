"""``memplan fit --emit torchtune``: the file merged into torchtune's own recipe config by torchtune's own
parser (what ``tune run RECIPE --config base.yaml key=value ...`` does), and the recipe's data pipeline —
``PackedDataset`` or ``padded_collate_sft``, ``StatefulDistributedSampler`` (seed 0), ``StatefulDataLoader``
with ``drop_last`` — run on the merged values gives memplan's step shapes, step by step.

Needs torchtune (0.6.1) and torchao: 0.16.0 imports beside torch 2.13 (with a line saying its C++ extensions are
skipped) and satisfies peft too; 0.11.0 imports but peft refuses it (it needs 0.16 or later); 0.12 and later than
0.16 do not import with torchtune 0.6.1 (see requirements-nodeps.txt).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from memplan.dataset import Batching, Fields, find_tokenizer, plan_steps
from memplan.dataset.lengths import token_lengths

pytest.importorskip("torchao", reason="torchao is not installed (requirements-nodeps.txt: torchao 0.16.0)")
tt_parse = pytest.importorskip("torchtune.config._parse", reason="torchtune is not installed (requirements-test.txt)")

def _recipe_config() -> Path:
    spec = importlib.util.find_spec("recipes")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune's recipe configs are not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "configs" / "llama3_2" / "1B_full_single_device.yaml"
    if not path.is_file():
        pytest.skip("torchtune's recipe configs are not installed")
    return path


def _overrides(data: dict, prefix: str = "") -> list[str]:
    """The emitted YAML as ``tune run``'s ``key=value`` overrides."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += _overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value) if isinstance(value, bool) else value}")
    return out


def _torchtune_shapes(lengths: np.ndarray, cfg) -> list[tuple[int, int]]:
    """The recipe's own loader (full_finetune_single_device._setup_data) over examples of these lengths."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
    from torchtune.data import padded_collate_packed, padded_collate_sft
    from torchtune.datasets import PackedDataset

    max_seq_len = cfg.tokenizer.max_seq_len
    rows = [{"tokens": [1] * min(int(n), max_seq_len), "labels": [1] * min(int(n), max_seq_len)} for n in lengths]
    data = PackedDataset(rows, max_seq_len=max_seq_len, split_across_pack=False) if cfg.dataset.packed else rows
    sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=cfg.shuffle, seed=0)
    collate = padded_collate_packed if cfg.dataset.packed else padded_collate_sft
    loader = StatefulDataLoader(data, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate, drop_last=True)
    return [tuple(batch["tokens"].shape) for batch in loader]


def _merged(emitted: Path, *extra: str):
    """The recipe config with the emitted file's values, as ``tune run ... --config base.yaml k=v ...`` merges them."""
    parser = tt_parse.TuneRecipeArgumentParser(description="memplan test")
    args, rest = parser.parse_known_args(["--config", str(_recipe_config()),
                                          *_overrides(yaml.safe_load(emitted.read_text())), *extra])
    return tt_parse._merge_yaml_and_cli_args(args, rest)


def test_emitted_config_through_torchtunes_parser_gives_the_shapes(fit_emit, tokenizer_dir, isolated_cache) -> None:
    _, data, emitted, document = fit_emit("torchtune", "torchtune", 4, 8)
    chosen = document["chosen"]  # the search chose packing on this data
    cfg = _merged(emitted)
    assert cfg.batch_size == chosen["micro_batch_size"]
    assert cfg.gradient_accumulation_steps == chosen["gradient_accumulation_steps"]
    assert cfg.tokenizer.max_seq_len == chosen["max_length"] == 128
    assert cfg.dataset.packed is (chosen["batching"] == "torchtune-packing")
    assert cfg.enable_activation_checkpointing is (chosen["recompute"] == "full")
    assert cfg.model._component_ == "torchtune.models.llama3_2.llama3_2_1b"  # the recipe's own keys are kept
    lengths, _ = token_lengths(str(data), Fields(text="text"), find_tokenizer(str(tokenizer_dir), None))
    # The emitted setting, and the same file without packing (torchtune's unpacked rule), step by step.
    for cfg in (cfg, _merged(emitted, f"dataset.packed={json.dumps(not cfg.dataset.packed)}")):
        rule = "torchtune-packing" if cfg.dataset.packed else "torchtune"
        ours = plan_steps(lengths, Batching(rule=rule, micro_batch_size=cfg.batch_size,
                                            max_length=cfg.tokenizer.max_seq_len, seed=cfg.seed))
        theirs = _torchtune_shapes(lengths, cfg)
        assert len(theirs) > 10
        assert list(zip(ours.batch_size.tolist(), ours.seq_length.tolist())) == theirs, rule
